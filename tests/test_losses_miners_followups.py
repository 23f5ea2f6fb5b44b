"""Follow-ups of an audit of the losses, miners and samplers: labels of any integer dtype index
per-class parameters, the combined loss checks its terms' numbers, miners inside a cross-batch
memory leave each row's pair with itself out before mining, and sizes refuse booleans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.config import LossConfig
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import ContrastiveLoss, CrossBatchMemory, MarginLoss
from dmlkit.miners import HardNegativePairMiner, MultiSimilarityMiner
from dmlkit.samplers import EpisodeSampler, MPerClassSampler
from dmlkit.training.builders import build_loss


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int16])
def test_margin_loss_per_class_beta_for_any_integer_labels(dtype):
    """Was: uint8 labels indexed the betas as a boolean mask (0.4073 for 0.6530, or a shape
    error for a batch of other size than the class count)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    loss = MarginLoss(num_classes=4)
    with torch.no_grad():
        loss.beta.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
    for y in (torch.tensor([1, 1, 3, 3]), torch.tensor([0, 0, 1, 1])):
        assert loss(x, y.to(dtype)).item() == pytest.approx(loss(x, y).item(), rel=1e-6)


@pytest.mark.parametrize("term, message", [
    ({"name": "triplet", "params": {"margin": float("nan")}},
     "loss.params.losses[0].params.margin must be a finite number"),
    ({"name": "contrastive", "params": {"pos_margin": True}},
     "loss.params.losses[0].params.pos_margin is a number"),
    ({"name": "triplet", "weight": float("nan")}, "weight must be a finite number >= 0"),
    ({"name": "triplet", "weight": float("inf")}, "weight must be a finite number >= 0"),
    ({"name": "triplet", "weight": True}, "weight must be a finite number >= 0"),
])
def test_combined_loss_terms_refuse_non_finite_and_boolean_numbers(term, message):
    """Was: NaN margins and weights inside ``combined`` were accepted (the first step then blamed
    the embeddings), a boolean margin trained as 1.0."""
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_loss(LossConfig(name="combined", params={"losses": [term]}), 4, 6)


def test_combined_loss_accepts_finite_weights():
    loss = build_loss(LossConfig(name="combined", params={"losses": [{"name": "triplet", "weight": 2}]}), 4, 6)
    assert loss.weights == [2.0]


def test_hard_negative_pairs_in_a_cross_batch_memory_mine_ratio_times_the_positives():
    """Was: each anchor's pair with its own copy in the memory's references counted as a
    positive, so k = ratio x P took B extra negatives (16 for 8 positives here)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    miner = HardNegativePairMiner(neg_pos_ratio=1.0)
    memory = CrossBatchMemory(ContrastiveLoss(), 6, memory_size=64, miner=miner)
    memory(x, y)
    assert miner.stats == {"num_pos_pairs": 8, "num_neg_pairs": 8}
    a1, p, a2, n = miner(x, y, x.clone(), y.clone(), ref_starts_with_batch=True)
    assert bool((a1 != p).all()) and a2.numel() == 8


def test_multi_similarity_in_a_cross_batch_memory_keeps_no_negative_without_a_positive():
    """Was: an anchor whose only "positive" was its own copy kept the negatives within epsilon
    of similarity 1 (the rule is: no positive, no negative)."""
    x = torch.tensor([[1.0, 0.0], [0.999, 0.0447], [0.0, 1.0], [0.05, 0.9987]])
    y = torch.tensor([0, 1, 2, 3])
    miner = MultiSimilarityMiner()
    out = miner(x, y, x.clone(), y.clone(), ref_starts_with_batch=True)
    assert [t.numel() for t in out] == [0, 0, 0, 0]


def test_ref_starts_with_batch_needs_the_batch_rows():
    x, y = torch.randn(4, 3), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ShapeError, match="ref_starts_with_batch needs at least the batch's 4"):
        HardNegativePairMiner()(x, y, x[:2], y[:2], ref_starts_with_batch=True)


@pytest.mark.parametrize("make", [
    lambda labels: MPerClassSampler(labels, True, 3),
    lambda labels: MPerClassSampler(labels, 2, True),
    lambda labels: EpisodeSampler(labels, n_way=True, k_shot=1, n_query=1, episodes=2),
])
def test_sampler_sizes_refuse_booleans(make):
    """Was: True was taken as 1 (the epoch already refused booleans)."""
    with pytest.raises(ConfigError, match="must be a positive integer, got True"):
        make(np.repeat(np.arange(7), 5))
