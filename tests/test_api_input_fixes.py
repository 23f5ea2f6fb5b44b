"""Public-API input types and layouts (audit s37/apifuzz): losses, miners and distances treat
mixed float dtypes and zero-width embeddings as every other entry point does."""

from __future__ import annotations

import pytest
import torch

from dmlkit.distances import CosineSimilarity, LpDistance
from dmlkit.exceptions import ShapeError
from dmlkit.losses import LOSSES, BaseLoss, get_loss
from dmlkit.losses.prototypical import prototypical_loss
from dmlkit.miners import MINERS, get_miner


def _batch_and_references() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g)
    r = torch.randn(10, 8, generator=g, dtype=torch.float64)
    return x, torch.arange(12) % 4, r, torch.arange(10) % 4


def _loss(name: str) -> BaseLoss:
    """Every registered loss, for 4 classes of 8-d embeddings where it needs them."""
    if not getattr(LOSSES[name], "requires_num_classes", False):
        return get_loss(name)
    extra = {"losses": [{"name": "triplet"}, {"name": "arcface"}]} if name == "combined" else {}
    return get_loss(name, num_classes=4, embedding_size=8, **extra)


def test_mixed_float_dtypes_are_promoted_by_miners_distances_and_prototypical_loss():
    # float32 embeddings with a float64 (or bfloat16) reference set raised torch's "mat1 and mat2
    # must have the same dtype" from 6 miners, every distance and prototypical_loss; losses
    # already promoted both to one dtype, which is what the float64 computation gives
    x, y, r, ry = _batch_and_references()
    for name in sorted(MINERS):
        mixed = get_miner(name)(x, y, r, ry)
        wide = get_miner(name)(x.double(), y, r, ry)
        assert all(torch.equal(a, b) for a, b in zip(mixed, wide)), name
    half = r.bfloat16()
    assert all(torch.equal(a, b) for a, b in zip(get_miner("batch_hard")(x, y, half, ry),
                                                 get_miner("batch_hard")(x, y, half.float(), ry)))
    for dist in (CosineSimilarity(), LpDistance()):
        assert torch.equal(dist(x, r), dist(x.double(), r))
        assert torch.equal(dist.paired(x[:10], r), dist.paired(x[:10].double(), r))
        with pytest.raises(ShapeError, match="torch tensor"):
            dist(x.numpy())
        with pytest.raises(ShapeError, match="floating-point"):
            dist((x * 3).long())
    assert torch.equal(prototypical_loss(x, y, r, ry), prototypical_loss(x.double(), y, r, ry))


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_refuses_a_reference_set_of_another_width(name):
    # checked once in BaseLoss.forward: AngularLoss normalises by itself, without the distance
    # object's width check, and raised torch's size mismatch
    x, y, r, ry = _batch_and_references()
    with pytest.raises(ShapeError, match="ref_emb has 7 features but embeddings have 8"):
        _loss(name)(x, y, ref_emb=r[:, :7].float(), ref_labels=ry)


@pytest.mark.parametrize(("kind", "name"), [("loss", n) for n in sorted(LOSSES)]
                         + [("miner", n) for n in sorted(MINERS)] + [("prototypical_loss", "")])
def test_zero_width_embeddings_are_refused_by_every_loss_and_miner(kind, name):
    # (B, 0) embeddings (emb[:, 128:] of a 128-d output) gave a loss value (contrastive 1.0,
    # ntxent 2.3026) and mined triplets; evaluate refuses them as empty
    x = torch.zeros(12, 0, requires_grad=True)
    y = torch.arange(12) % 4
    call = {"loss": lambda: _loss(name)(x, y), "miner": lambda: get_miner(name)(x.detach(), y),
            "prototypical_loss": lambda: prototypical_loss(x, y, x, y)}[kind]
    with pytest.raises(ShapeError, match=r"have no features \(shape \(12, 0\)\)"):
        call()
