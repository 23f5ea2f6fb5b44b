"""Findings of the loss audit, one test each: the Euclidean distance's gradient for near pairs,
SNR contrastive's regulariser without pairs, MarginLoss's float64 beta, ``combined`` with
cross-batch memory / a BN neck, every loss on an empty batch, zero rows' gradient through the
normalisation, and the preflight's miner / memory pairing checks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from _reference import tiny_sections
from dmlkit.config import ExperimentConfig, LossConfig
from dmlkit.distances import LpDistance, _safe_sqrt
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import LOSSES, CombinedLoss, CrossBatchMemory, get_loss
from dmlkit.training.builders import build_loss, build_miner
from dmlkit.training.preflight import build_problems
from dmlkit.validation import safe_normalize

DIM = 8
NUM_CLASSES = 6
#: Losses that cannot be built from their defaults alone.
PARAMS = {
    "combined": {"losses": [{"name": "contrastive"}, {"name": "triplet", "weight": 0.5}]},
    "soft_triple": {"centers_per_class": 3},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (conftest)


def make(name: str, dtype: torch.dtype = torch.float32):
    """The registered loss ``name`` from its defaults, in ``dtype``."""
    torch.manual_seed(0)
    params = dict(PARAMS.get(name, {}))
    if getattr(LOSSES[name], "requires_num_classes", False):
        params.update(num_classes=NUM_CLASSES, embedding_size=DIM)
    return get_loss(name, **params).to(dtype)


def euclidean_losses() -> list[str]:
    """Registered losses whose default distance is a Euclidean one (plain or squared)."""
    out = []
    for name in sorted(LOSSES):
        loss = make(name)
        if isinstance(getattr(loss, "distance", None), LpDistance):
            out.append(name)
    return out


# -- 1. the Euclidean distance's gradient ------------------------------------------------------
def test_sqrt_gradient_is_exact_below_1e6_and_zero_at_zero():
    """d sqrt(s) / ds = 1 / (2 sqrt(s)) for every positive s (it was floored at sqrt = 1e-6)."""
    for dtype in (torch.float32, torch.float64):
        squared = torch.tensor([0.0, 1e-20, 1e-14, 4.0], dtype=dtype, requires_grad=True)
        _safe_sqrt(squared).sum().backward()
        root = squared.detach().sqrt()
        expected = torch.where(root > 0, 0.5 / root, torch.zeros_like(root))
        torch.testing.assert_close(squared.grad, expected, rtol=1e-6, atol=0)


def test_contrastive_gradient_of_a_near_pair_matches_the_formula():
    """float64, d = 6e-8: the gradient read 0.018 where the formula (and pml) give 0.29."""
    torch.manual_seed(0)
    v0 = torch.randn(8, dtype=torch.float64)
    u = torch.randn(8, dtype=torch.float64)
    labels = torch.tensor([0, 1])
    for eps in (1e-7, 1e-9):
        x = torch.stack([v0, v0 + eps * u]).requires_grad_(True)
        get_loss("contrastive")(x, labels).backward()
        ref = x.detach().clone().requires_grad_(True)
        xn = F.normalize(ref, dim=1)
        torch.relu(1 - (xn[0] - xn[1]).norm()).backward()
        torch.testing.assert_close(x.grad, ref.grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_euclidean_losses_finite_on_duplicates_and_identical_rows_at_zero(dtype):
    """Rows repeated within and across classes: the exact gradient stays finite for every loss
    on a Euclidean distance, identical rows stay exactly 0 apart (recomputed from their
    difference), and a near pair's gradient is that of its exact distance."""
    names = euclidean_losses()
    assert {"contrastive", "triplet", "margin", "nca", "fastap"} <= set(names)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, DIM, generator=g, dtype=dtype)
    x[1] = x[0]
    x[5] = x[4]
    x[6] = x[2]  # another class
    x[9] = x[8] + 1e-9 * torch.randn(DIM, generator=g, dtype=dtype)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 5])
    for name in names:
        loss = make(name, dtype)
        xx = x.clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value = loss(xx, labels)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(xx.grad).all(), name
    mat = LpDistance()(x)
    assert mat[0, 1] == 0 and mat[4, 5] == 0 and mat[2, 6] == 0
    # the near pair (8, 9): its distance's gradient is (x8 - x9) / d, a unit vector
    xx = x.clone().requires_grad_(True)
    LpDistance(normalize_embeddings=False)(xx)[8, 9].backward()
    if dtype == torch.float64:
        torch.testing.assert_close(xx.grad[9].norm(), torch.tensor(1.0, dtype=dtype))


# -- 2. SNR contrastive's regulariser -----------------------------------------------------------
def test_snr_regulariser_is_kept_without_pairs():
    """B = 1 and an empty miner output: the loss is lambda mean_i |sum_k h_ik| (pml: the same
    0.00239546 at B = 1), not 0."""
    torch.manual_seed(0)
    loss = get_loss("snr_contrastive", regularizer_weight=0.001)
    x = (torch.randn(1, 8) + 0.5).requires_grad_(True)
    value = loss(x, torch.tensor([3]))
    value.backward()
    torch.testing.assert_close(value, 0.001 * x.detach().sum(1).abs().mean())
    assert x.grad.abs().max() > 0
    x = (torch.randn(8, 8) + 0.5).requires_grad_(True)
    empty = torch.zeros(0, dtype=torch.long)
    value = loss(x, torch.arange(8) // 2, (empty, empty, empty, empty))
    torch.testing.assert_close(value, 0.001 * x.detach().sum(1).abs().mean())


# -- 3. MarginLoss's beta in float64 ------------------------------------------------------------
def test_margin_single_beta_is_not_rounded_to_float32():
    torch.manual_seed(0)
    x = torch.randn(12, 8, dtype=torch.float64)
    y = torch.arange(12) // 3
    loss = get_loss("margin", beta=1.2).double()
    loss.beta.data.fill_(1.2)  # exactly 1.2 in float64
    value = loss(x, y)
    xn = F.normalize(x, dim=1)
    d = torch.cdist(xn, xn)
    same = y[:, None] == y[None]
    eye = torch.eye(12, dtype=torch.bool)
    pos = torch.relu(d - 1.2 + 0.2)[same & ~eye]
    neg = torch.relu(1.2 - d + 0.2)[~same]
    ref = (pos.sum() + neg.sum()) / ((pos > 0).sum() + (neg > 0).sum())
    assert abs(value.item() - ref.item()) < 1e-14


# -- 4. combined + cross-batch memory -------------------------------------------------------------
def test_combined_cannot_be_wrapped_in_cross_batch_memory():
    combined = get_loss("combined", num_classes=4, embedding_size=16,
                        losses=[{"name": "triplet"}])
    with pytest.raises(ConfigError, match="cross_batch_memory"):
        CrossBatchMemory(combined, embedding_size=16, memory_size=64)
    with pytest.raises(ConfigError, match="cross_batch_memory"):
        build_loss(LossConfig(name="combined", params={"losses": [{"name": "triplet"}]},
                              cross_batch_memory=64), 10, 16)
    x, y = torch.randn(6, 16), torch.arange(6) // 2
    with pytest.raises(ConfigError, match="ref_emb"):  # was silently ignored
        combined(x, y, ref_emb=x, ref_labels=y)


# -- 5. every loss on an empty batch ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_gives_zero_with_a_gradient_on_an_empty_batch(name):
    """``contrastive`` raised (``max()`` of an empty class count)."""
    loss = make(name)
    x = torch.zeros(0, DIM, requires_grad=True)
    value = loss(x, torch.zeros(0, dtype=torch.long))
    value.backward()
    assert value.item() == 0.0
    assert x.grad is not None and x.grad.shape == x.shape


# -- 6. combined with a BN neck ---------------------------------------------------------------------
SPEC = [{"name": "triplet", "params": {"reduction": "batch_hard"}},
        {"name": "softmax", "bn_neck": True, "params": {"bias": False}}]


def test_combined_bn_neck_accepts_float64_and_refuses_one_row_clearly():
    torch.manual_seed(0)
    loss = get_loss("combined", num_classes=4, embedding_size=8, losses=SPEC)
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    value = loss(x, torch.arange(8) // 2)
    value.backward()
    assert value.dtype == torch.float64 and torch.isfinite(x.grad).all()
    # the neck in float32, cast back: the same value as the float32 batch
    x32 = x.detach().float()
    torch.testing.assert_close(value.detach().float(), loss(x32, torch.arange(8) // 2),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match="at least 2 embeddings"):
        loss(torch.randn(1, 8), torch.tensor([1]))
    loss.eval()  # running statistics: a batch of one is fine
    assert torch.isfinite(loss(torch.randn(1, 8), torch.tensor([1])))
    assert isinstance(loss, CombinedLoss)


# -- 7. zero rows through the normalisation --------------------------------------------------------
@pytest.mark.parametrize("name", ["contrastive", "triplet", "multi_similarity", "ntxent", "circle",
                                  "arcface"])
def test_zero_row_gets_zero_gradient(name):
    """It got 1e11-1e13 through F.normalize's eps."""
    torch.manual_seed(0)
    x = torch.randn(8, DIM)
    x[3] = 0
    x.requires_grad_(True)
    make(name)(x, torch.arange(8) // 2).backward()
    assert torch.all(x.grad[3] == 0)
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() < 100


def test_safe_normalize_zero_rows_forward_unchanged_gradient_zero():
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    x[2] = 0
    x.requires_grad_(True)
    out = safe_normalize(x, dim=1)
    assert torch.equal(out.detach(), F.normalize(x.detach(), dim=1))  # bit for bit
    out.sum().backward()
    assert torch.all(x.grad[2] == 0)
    ref = x.detach().clone().requires_grad_(True)
    F.normalize(ref, dim=1).sum().backward()
    keep = torch.arange(6) != 2
    torch.testing.assert_close(x.grad[keep], ref.grad[keep])


# -- 8. the preflight's pairing checks --------------------------------------------------------------
def config(loss: dict, miner: dict | None) -> ExperimentConfig:
    sections = tiny_sections()
    sections["loss"] = loss
    return ExperimentConfig.model_validate({
        "name": "audit", "seed": 0,
        "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28},
        **sections, "miner": miner,
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4},
        "training": {"epochs": 1, "device": "cpu"},
    })


@pytest.mark.parametrize(("loss", "miner", "key"), [
    ({"name": "arcface"}, {"name": "batch_hard"}, "miner"),
    ({"name": "coupled_clusters"}, {"name": "batch_hard"}, "miner"),
    ({"name": "combined", "params": {"losses": [{"name": "triplet"}]}, "cross_batch_memory": 64},
     None, "loss.cross_batch_memory"),
])
def test_preflight_reports_a_miner_or_memory_the_loss_cannot_use(loss, miner, key):
    cfg = config(loss, miner)
    problems = [p for p in build_problems(cfg, num_classes=16) if p.severity == "error"]
    assert [p.key for p in problems] == [key]
    assert loss["name"] in problems[0].message and problems[0].fix == f"--set {key}=null"
    if miner is not None:  # what the first training step would raise
        built = build_loss(cfg.loss, 16, 16, build_miner(cfg.miner))
        with pytest.raises(ConfigError, match="miner"):
            built(torch.randn(8, 16), torch.arange(8) // 2, build_miner(cfg.miner)(
                torch.randn(8, 16), torch.arange(8) // 2))


def test_preflight_reports_a_miner_no_combined_term_takes():
    """combined passes a miner's indices only to terms that take them: with none, the miner would
    run every step for nothing."""
    terms = [{"name": "arcface"}, {"name": "triplet", "use_indices": False}]
    problems = [p for p in build_problems(config({"name": "combined", "params": {"losses": terms}},
                                                 {"name": "batch_hard"}), num_classes=16)
                if p.severity == "error"]
    assert [p.key for p in problems] == ["miner"] and "no term" in problems[0].message


def test_preflight_accepts_the_usual_pairings():
    for loss, miner in (({"name": "triplet"}, {"name": "batch_hard"}),
                        ({"name": "contrastive", "cross_batch_memory": 64}, {"name": "batch_hard"}),
                        ({"name": "combined", "params": {"losses": [{"name": "arcface"}, {"name": "triplet"}]}},
                         {"name": "batch_hard"}),
                        ({"name": "arcface"}, None)):
        problems = build_problems(config(loss, miner), num_classes=16)
        assert not [p for p in problems if p.severity == "error"], problems
