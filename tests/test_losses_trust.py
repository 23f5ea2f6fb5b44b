"""Every registered loss on hostile but finite batches (issue 11, points 3 and 13).

* Extreme scales (``1e-20``, ``1e19``), an all-zero batch, a single class and one sample per
  class: the loss and its gradient are finite, or the loss raises a clear
  :class:`~dmlkit.exceptions.NonFiniteError` - never NaN/inf.
* Losses on a normalising distance are scale-invariant across the float32 range: the loss at
  ``1e-20`` / ``1e19`` equals the loss at scale 1 and the gradient scales as ``1 / s``.
* Under ``torch.autocast(dtype=torch.bfloat16)`` every loss computes in float32: the result is
  float32 and equal to the loss computed without autocast.

The registry is iterated, so a newly registered loss is covered automatically.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dmlkit.distances import DotProductSimilarity, LpDistance
from dmlkit.exceptions import NonFiniteError
from dmlkit.losses import LOSSES, BaseLoss, ContrastiveLoss, get_loss

DIM = 8
NUM_CLASSES = 6
LABELS = {
    "several": [0, 0, 0, 1, 1, 2, 2, 2, 3, 4],
    "one_class": [5] * 6,
    "singletons": [0, 1, 2, 3, 4, 5],
}
#: Losses whose value depends on the embeddings' norm with their default settings (raw
#: embeddings, the feature norm as a scale, or a regulariser on the raw sum). Every other
#: registered loss must be scale-invariant.
SCALE_DEPENDENT = {"softmax", "sphereface", "prototypical", "snr_contrastive"}
#: Losses that cannot be built from their defaults alone (and SoftTriple with fewer centres,
#: for speed: the properties tested do not depend on their number).
PARAMS = {
    "combined": {"losses": [{"name": "contrastive"}, {"name": "triplet", "weight": 0.5}]},
    "soft_triple": {"centers_per_class": 3},
}
NAMES = sorted(LOSSES)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(name: str) -> BaseLoss:
    torch.manual_seed(0)  # proxy/class weights
    params = dict(PARAMS.get(name, {}))
    if getattr(LOSSES[name], "requires_num_classes", False):
        params.update(num_classes=NUM_CLASSES, embedding_size=DIM)
    return get_loss(name, **params)


def embeddings(n: int, scale: float, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g) * scale


def value_and_grad(loss: BaseLoss, x: torch.Tensor, labels: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    value = loss(x, labels)
    value.backward()
    return value.detach(), x.grad


def test_every_loss_is_covered():
    assert len(NAMES) >= 27
    assert set(SCALE_DEPENDENT) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e19, 0.0], ids=["1e-20", "1", "1e19", "zero"])
def test_finite_or_clear_error(name, scale):
    for label_set, raw in LABELS.items():
        labels = torch.tensor(raw)
        x = embeddings(len(raw), scale) if scale else torch.zeros(len(raw), DIM)
        try:
            value, grad = value_and_grad(make(name), x, labels)
        except NonFiniteError as err:
            assert str(err), (name, label_set)
            # a clear error is only acceptable where the float32 computation is out of range
            assert name in SCALE_DEPENDENT, (name, label_set, str(err))
            continue
        assert value.dtype == torch.float32, (name, label_set)
        assert torch.isfinite(value), (name, scale, label_set, value)
        assert torch.isfinite(grad).all(), (name, scale, label_set)


@pytest.mark.parametrize("name", sorted(set(NAMES) - SCALE_DEPENDENT))
def test_scale_invariant_over_float32_range(name):
    labels = torch.tensor(LABELS["several"])
    x = embeddings(len(labels), 1.0)
    ref_value, ref_grad = value_and_grad(make(name), x, labels)
    assert ref_grad.abs().max() > 0, name  # the check below would be empty otherwise
    for scale in (1e-20, 1e19):
        value, grad = value_and_grad(make(name), x * scale, labels)
        torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-5, msg=f"{name} {scale}")
        tol = 1e-3 * float(ref_grad.abs().max())
        torch.testing.assert_close(grad * scale, ref_grad, rtol=1e-3, atol=tol, msg=f"{name} {scale}")


@pytest.mark.parametrize("name", NAMES)
def test_autocast_bfloat16_computes_in_float32(name):
    labels = torch.tensor(LABELS["several"])
    x = embeddings(len(labels), 1.0)
    loss = make(name)
    expected = loss(x, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss(x, labels)
    assert got.dtype == torch.float32
    # bfloat16 products would be off by ~4e-3 relative; float32 agrees to rounding
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_input_returns_float32_with_bfloat16_gradient(name):
    labels = torch.tensor(LABELS["several"])
    x = embeddings(len(labels), 1.0).to(torch.bfloat16).requires_grad_(True)
    loss = make(name)
    value = loss(x, labels)
    value.backward()
    assert value.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
    # the same bfloat16 values, upcast by hand: equal in float32
    torch.testing.assert_close(value, loss(x.detach().float(), labels), rtol=1e-5, atol=1e-6)


def test_overflow_raises_nonfinite_error():
    x = embeddings(6, 1e19)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    raw = ContrastiveLoss(distance=LpDistance(normalize_embeddings=False))
    with pytest.raises(NonFiniteError):
        raw(x, labels)
    with pytest.raises(NonFiniteError):
        ContrastiveLoss(distance=DotProductSimilarity(normalize_embeddings=False))(x, labels)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_embeddings_are_refused_by_every_loss(name, bad):
    """A NaN or infinite input is named as such, whatever the loss computes from it first (the
    check reads the device once, with the loss's own finiteness, after the computation)."""
    labels = torch.tensor(LABELS["several"])
    for rows in ([3], list(range(len(labels)))):
        x = embeddings(len(labels), 1.0)
        x[rows, 1] = bad
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no numpy or torch warning on the way
            with pytest.raises(NonFiniteError, match="embeddings contain NaN or infinity"):
                make(name)(x, labels)


@pytest.mark.parametrize("name", ["contrastive", "triplet", "normalized_softmax"])
def test_finite_embeddings_whose_sum_overflows_are_not_refused(name):
    """The finiteness check reads one sum per input (a NaN or infinity makes it non-finite);
    finite entries whose sum overflows float32 must go to the exact test, not be refused."""
    labels = torch.tensor(LABELS["several"])
    x = embeddings(len(labels), 1.0)
    x[:, 0] = 3e38  # every row finite; the column's sum is beyond float32's range
    assert not torch.isfinite(x.sum()) and torch.isfinite(x).all()
    assert torch.isfinite(make(name)(x, labels))


def test_a_nonfinite_batch_leaves_the_cross_batch_memory_as_it_was():
    """The finiteness check runs after the computation, but before the queue takes the batch."""
    from dmlkit.losses import CrossBatchMemory

    memory = CrossBatchMemory(make("contrastive"), embedding_size=8, memory_size=16)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    memory(embeddings(6, 1.0), labels)
    before = [t.clone() for t in memory.memory()]
    x = embeddings(6, 1.0)
    x[2, 1] = math.nan
    with pytest.raises(NonFiniteError, match="embeddings contain NaN"):
        memory(x, labels)
    assert all(torch.equal(a, b) for a, b in zip(before, memory.memory()))


class _HostReads:
    """Counts the reads from the device (``item``/``bool``/``int``, ``tolist``, ``nonzero``,
    ``unique``, ``bincount``) inside the block: each waits for the device on a GPU."""

    WAITING = {"_local_scalar_dense", "nonzero", "_unique2", "bincount", "masked_select"}

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        tolist = torch.Tensor.tolist

        def counted(t):
            self.count += 1
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.count += func.__name__.split(".")[0] in _HostReads.WAITING
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_the_trust_checks_read_the_device_once(monkeypatch):
    """Finite inputs and a finite loss are one read, after the computation (they were two, the
    first before it)."""

    class Plain(BaseLoss):
        def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
            return embeddings.square().sum()

    x, labels = embeddings(6, 1.0), torch.tensor([0, 0, 1, 1, 2, 2])
    with _HostReads(monkeypatch) as reads:
        Plain()(x, labels, ref_emb=x, ref_labels=labels)
    assert reads.count == 1
    with _HostReads(monkeypatch) as reads:
        make("multi_similarity")(x, labels)
    assert reads.count <= 5  # class coding 3, rows without negatives 1, the trust checks 1


def test_nonfinite_loss_is_refused():
    class Overflowing(BaseLoss):
        def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
            return (embeddings * 1e30).pow(2).sum()  # overflows float32

    with pytest.raises(NonFiniteError, match="Overflowing .*overflowed"):
        Overflowing()(torch.full((2, 3), 1e10), torch.tensor([0, 1]))


# ------------------------------------------------------------------ package structure (issue 10.5)
def test_every_loss_module_is_imported_and_every_loss_exported():
    import importlib
    import pkgutil
    import sys

    import dmlkit.losses as package

    # a deprecated alias, and the distributed shares of a loss (it registers none; the trainer
    # imports it): in the whole suite another test imports it first, alone this one ran without
    not_loss_modules = {"ranking_losses", "sharding"}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in not_loss_modules:
            assert f"dmlkit.losses.{info.name}" in sys.modules, info.name
    for cls in LOSSES.values():
        assert cls.__name__ in package.__all__ and getattr(package, cls.__name__) is cls
    assert all(hasattr(package, name) for name in package.__all__)
    # the old module path keeps every public name, with a deprecation warning
    new = importlib.import_module("dmlkit.losses.pair_weighting_losses")
    old = importlib.import_module("dmlkit.losses.ranking_losses")
    for name in new.__all__:
        with pytest.warns(DeprecationWarning, match="pair_weighting_losses"):
            assert getattr(old, name) is getattr(new, name)
    with pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_losses_and_miners_share_one_helper_module():
    from dmlkit import miners
    from dmlkit.losses import _pairs

    assert miners.label_masks is _pairs.label_masks
    labels = torch.tensor([0, 1, 0])
    pos, neg = _pairs.label_masks(labels)
    assert pos.tolist() == [[False, False, True], [False, False, False], [True, False, False]]
    assert (neg == (labels[:, None] != labels[None, :])).all()
    pos, _ = _pairs.label_masks(labels, labels.clone(), exclude_self=True)
    assert not pos.diagonal().any()


@pytest.mark.parametrize("name", NAMES)
def test_labels_that_are_not_an_integer_tensor_are_one_clear_error(name):
    """A Python list failed deep inside ('list' has no attribute 'dim' / 'numel'); bool labels
    were taken as two classes by most losses and crashed prototypical."""
    from dmlkit.exceptions import ShapeError

    loss, x = make(name), embeddings(6, 1.0)
    with pytest.raises(ShapeError, match="labels must be a .B,. tensor"):
        loss(x, [0, 1, 2, 0, 1, 2])
    with pytest.raises(ShapeError, match="labels must be integers"):
        loss(x, torch.tensor([True, False, True, False, True, False]))


def test_every_miner_returns_nothing_for_an_empty_batch():
    """Four miners raised torch's IndexError on a batch of 0 (every loss returns 0 there)."""
    from dmlkit.miners import MINERS, get_miner

    x, y = torch.randn(0, DIM), torch.zeros(0, dtype=torch.long)
    for name in sorted(MINERS):
        miner = get_miner(name)
        out = miner(x, y)
        assert len(out) == (4 if miner.output_type == "pair" else 3), name
        assert all(t.numel() == 0 and t.dtype == torch.long for t in out), name
        assert miner.num_mined == 0


def _direct_contrastive(x: torch.Tensor, labels: torch.Tensor, snr: bool) -> float:
    """The contrastive loss (margins 0 and 1, mean of the non-zero terms) from float64 pair
    differences, never the expanded form: an exact 0 for identical rows. Euclidean on
    L2-normalised rows, or (``snr``) the SNR distance with its zero-mean regulariser (weight
    0.001)."""
    x = x.double()
    z = x[None, :, :] - x[:, None, :] if snr else torch.nn.functional.normalize(x, dim=1)[None] - \
        torch.nn.functional.normalize(x, dim=1)[:, None]
    d = z.var(dim=2) / x.var(dim=1, keepdim=True) if snr else z.norm(dim=2)
    same = labels[:, None] == labels[None, :]
    off = ~torch.eye(len(labels), dtype=torch.bool)
    pos, neg = d[same & off], (1 - d[~same]).clamp_min(0)
    value = sum(float(t[t > 0].mean()) for t in (pos, neg) if bool((t > 0).any()))
    return value + (0.001 * float(x.sum(1).abs().mean()) if snr else 0.0)


@pytest.mark.parametrize("name", ["contrastive", "snr_contrastive"])
@pytest.mark.parametrize("dim", [8, 128])
def test_identical_embeddings_are_at_distance_zero_in_float32(name, dim):
    """A batch with repeated rows (``small_classes="replace"`` draws them): the repeated pairs'
    positive terms are exactly 0, so the mean of the non-zero terms leaves them out, as the peer
    does. The float32 expanded form ``|x|^2 + |y|^2 - 2<x, y>`` left rounding noise there (and the
    square root a 1e-6 floor), which counted them: the loss read 17-29 % low."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(16, dim, generator=g)
    x = torch.cat([base, base[:8]])
    labels = torch.cat([torch.arange(16) // 2, torch.arange(8) // 2])
    x.requires_grad_(True)
    value = get_loss(name)(x, labels)
    value.backward()
    assert float(value) == pytest.approx(_direct_contrastive(x.detach(), labels, name != "contrastive"),
                                         rel=1e-5)
    assert torch.isfinite(x.grad).all()


def test_distances_of_identical_rows_are_exactly_zero():
    """Identical rows (and, for the SNR, a row and its shifted copy) are at distance exactly 0 in
    float32 however the matrix product sums; other pairs keep the expanded form's value."""
    from dmlkit.distances import SNRDistance

    g = torch.Generator().manual_seed(7)
    x = torch.round(torch.randn(6, 256, generator=g) * 3 * 1024) / 1024  # x + 0.5 is exact
    twice = torch.cat([x, x, x + 0.5])
    lp = LpDistance(normalize_embeddings=False)(twice)
    for power in (1, 2):
        m = LpDistance(normalize_embeddings=False, power=power)(twice)
        assert (m[torch.arange(6), torch.arange(6) + 6] == 0).all()
        assert (m.diagonal() == 0).all()
    torch.testing.assert_close(lp[torch.arange(6), torch.arange(6) + 12], torch.full((6,), 0.5 * 16),
                               rtol=1e-4, atol=0)
    snr = SNRDistance()(twice)
    assert (snr[torch.arange(6), torch.arange(6) + 6] == 0).all()
    assert (snr[torch.arange(6), torch.arange(6) + 12] == 0).all()
    far = ~torch.eye(6, dtype=torch.bool)
    direct = (x[None] - x[:, None]).norm(dim=2)
    torch.testing.assert_close(lp[:6, :6][far], direct[far])


@pytest.mark.parametrize("p", [0.5, 1.0, 3.0])
def test_paired_lp_distances_have_finite_gradients_at_identical_rows(p):
    """``LpDistance(p).paired`` of identical rows: distance 0 with a zero gradient (the power
    form ``(sum |d|^p)^(1/p)`` gave NaN there, which triplet ``swap`` passed on with a finite
    loss), equal to the pairwise matrix's diagonal elsewhere."""
    from dmlkit.losses import TripletMarginLoss
    from dmlkit.miners import AllTripletsMiner

    x = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1])  # x[1] (class 0) == x[2] (class 1)
    distance = LpDistance(p=p)
    distance.paired(x, x.flip(0).detach().clone()).sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1:3] == 0).all()
    for indices in (None, AllTripletsMiner()(x.detach(), y)):
        x.grad = None
        TripletMarginLoss(swap=True, distance=distance)(x, y, indices=indices).backward()
        assert torch.isfinite(x.grad).all()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    torch.testing.assert_close(distance.paired(a, b), distance.pairwise(a, b).diagonal())
    tiny = torch.full((1, 3), 1e-30)  # float32: 1e-30 ** 3 underflows in the power form
    assert distance.paired(tiny, torch.zeros(1, 3)).item() > 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.int16, torch.float32])
def test_miner_indices_torch_reads_as_masks_are_refused(dtype):
    """uint8 indices were read as boolean masks: triplet 0.2 instead of 1.0513 with the same index
    values. Only int64 / int32 tensors index; anything else is one clear error."""
    from dmlkit.exceptions import ShapeError
    from dmlkit.losses import TripletMarginLoss

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.tensor([0, 0, 1, 1])
    triplets = (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 0, 3, 2]), torch.tensor([2, 3, 0, 1]))
    pairs = (triplets[0], triplets[1], triplets[0], triplets[2])
    for loss, idx in ((TripletMarginLoss(), triplets), (ContrastiveLoss(), pairs)):
        expected = loss(x, y, indices=idx)
        assert loss(x, y, indices=tuple(t.int() for t in idx)) == expected
        with pytest.raises(ShapeError, match=r"int64 \(or int32\) tensor, got dtype .*convert with .long\(\)"):
            loss(x, y, indices=tuple(t.to(dtype) for t in idx))


@pytest.mark.parametrize("name", ["contrastive", "multi_similarity", "triplet", "lifted_structure"])
def test_a_reference_set_in_another_float_dtype_is_promoted(name):
    """Float32 embeddings with float64 references raised torch's "mat1 and mat2 must have the
    same dtype"; both now compute in the wider one, as the loss of float64 inputs would."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.tensor([0, 0, 1, 1, 2, 2])
    ref, ref_y = torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 0, 1, 1])
    loss = get_loss(name)
    got = loss(x.requires_grad_(), y, ref_emb=ref, ref_labels=ref_y)
    want = loss(x.detach().double(), y, ref_emb=ref, ref_labels=ref_y)
    assert got.dtype == torch.float64 and torch.isfinite(got)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    got.backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
