"""CrossBatchMemory: FIFO queue, reference set, self-pair exclusion, miner, state_dict."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dmlkit.distances import LpDistance
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses.base import BaseLoss
from dmlkit.losses.cross_batch_memory import CrossBatchMemory
from dmlkit.losses.proxy_losses import ProxyAnchorLoss


class TinyContrastive(BaseLoss):
    """Contrastive on Euclidean distance over the given pairs, mean over the pairs it is given.

    ``L = (sum_{(a,p)} [d(a,p) - m_pos]_+ + sum_{(a,n)} [m_neg - d(a,n)]_+) / (#pos + #neg)``.
    Without indices: every pair of the reference set but the diagonal (when ref is the batch).
    """

    accepts_indices = True

    def __init__(self, pos_margin: float = 0.0, neg_margin: float = 1.0):
        super().__init__(LpDistance())
        self.pos_margin, self.neg_margin = pos_margin, neg_margin
        self.calls: list[tuple] = []

    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        ref, ref_l = (embeddings, labels) if ref_emb is None else (ref_emb, ref_labels)
        if indices is None:
            same = labels[:, None] == ref_l[None, :]
            eye = torch.zeros_like(same)
            if ref_emb is None:
                eye.fill_diagonal_(True)
            a1, p = torch.nonzero(same & ~eye, as_tuple=True)
            a2, n = torch.nonzero(~same, as_tuple=True)
        else:
            a1, p, a2, n = indices
        self.calls.append((a1.clone(), p.clone(), a2.clone(), n.clone(), ref.shape[0]))
        if len(a1) + len(a2) == 0:
            return self.zero_loss(embeddings)
        dp = self.distance.paired(embeddings[a1], ref[p])
        dn = self.distance.paired(embeddings[a2], ref[n])
        total = (dp - self.pos_margin).relu().sum() + (self.neg_margin - dn).relu().sum()
        return total / (len(a1) + len(a2))


class NoIndicesLoss(BaseLoss):
    def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
        return embeddings.sum()


class RecordingMiner(torch.nn.Module):
    """Returns every pair *including* the self pairs (so XBM must drop them); records its args."""

    output_type = "pair"

    def __init__(self, triplets: bool = False):
        super().__init__()
        self.triplets = triplets
        self.seen: list[tuple[int, int]] = []

    def forward(self, embeddings, labels, ref_emb=None, ref_labels=None):
        self.seen.append((embeddings.shape[0], ref_emb.shape[0]))
        same = labels[:, None] == ref_labels[None, :]
        if self.triplets:
            a, p, n = torch.nonzero(same[:, :, None] & ~same[:, None, :], as_tuple=True)
            return a, p, n
        a1, p = torch.nonzero(same, as_tuple=True)
        a2, n = torch.nonzero(~same, as_tuple=True)
        return a1, p, a2, n


def ref_step_loss(x, labels, memory, pos_margin=0.0, neg_margin=1.0):
    """Loops: anchors = batch rows; references = batch rows (not itself) + memory rows."""
    refs = [(x[j], int(labels[j]), j) for j in range(len(x))] + [
        (e, int(lab), None) for e, lab in memory
    ]
    total, count = 0.0, 0
    for i in range(len(x)):
        for r, lab, j in refs:
            if j == i:
                continue
            d = torch.sqrt(
                sum((x[i][k] / x[i].norm() - r[k] / r.norm()) ** 2 for k in range(len(r)))
            )
            if lab == int(labels[i]):
                total = total + torch.clamp(d - pos_margin, min=0)
            else:
                total = total + torch.clamp(neg_margin - d, min=0)
            count += 1
    return total / count


def _stream(steps: int, batch: int, dim: int = 3, classes: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, dim, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize(("batch", "memory_size"), [(4, 10), (5, 5), (6, 4), (3, 1)])
def test_matches_loop_reference_over_steps_value_and_gradient(batch, memory_size):
    xbm = CrossBatchMemory(TinyContrastive(0.1, 0.9), embedding_size=3, memory_size=memory_size)
    memory: list[tuple[torch.Tensor, int]] = []  # FIFO of (embedding, label)
    for x, labels in _stream(5, batch):
        x1 = x.clone().requires_grad_()
        ours = xbm(x1, labels)
        ours.backward()
        x2 = x.clone().requires_grad_()
        ref = ref_step_loss(x2, labels, memory, 0.1, 0.9)
        ref.backward()
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-9, atol=1e-12)
        memory = (memory + [(e.clone(), int(lab)) for e, lab in zip(x, labels)])[-memory_size:]
        assert xbm.num_stored == len(memory)
        stored = sorted(tuple(e.tolist()) for e in xbm.memory()[0])
        assert stored == sorted(tuple(e.tolist()) for e, _ in memory)


def test_queue_is_detached_and_first_call_equals_plain_loss():
    inner = TinyContrastive()
    xbm = CrossBatchMemory(inner, embedding_size=3, memory_size=8)
    (x, labels), (x2, labels2) = _stream(2, 6)
    x = x.requires_grad_()
    torch.testing.assert_close(xbm(x, labels), TinyContrastive()(x, labels))
    assert not xbm.embedding_memory.requires_grad
    x2 = x2.requires_grad_()
    xbm(x2, labels2).backward()
    assert x.grad is None  # the stored batch gets no gradient from later steps
    assert x2.grad is not None


def test_self_pairs_excluded_and_reference_layout():
    inner = TinyContrastive()
    xbm = CrossBatchMemory(inner, embedding_size=2, memory_size=16)
    x = torch.randn(4, 2)
    labels = torch.tensor([0, 0, 1, 1])
    xbm(x, labels)
    xbm(x, labels)  # same embeddings again: memory rows equal the batch but are real pairs
    a1, p, a2, n, ref_size = inner.calls[-1]
    assert ref_size == 8
    assert not (a1 == p).any()  # no anchor with its own row
    pos = set(zip(a1.tolist(), p.tolist()))
    assert pos == {
        (0, 1),
        (1, 0),
        (2, 3),
        (3, 2),
        (0, 4),
        (0, 5),
        (1, 4),
        (1, 5),
        (2, 6),
        (2, 7),
        (3, 6),
        (3, 7),
    }
    assert len(a2) == 4 * 4


def test_miner_receives_reference_and_self_pairs_are_removed():
    inner, miner = TinyContrastive(), RecordingMiner()
    xbm = CrossBatchMemory(inner, embedding_size=3, memory_size=10, miner=miner)
    stream = _stream(3, 4)
    for x, labels in stream:
        xbm(x, labels)
    assert miner.seen == [(4, 4), (4, 8), (4, 12)]
    a1, p, *_ = inner.calls[-1]
    assert not (a1 == p).any()
    # with the self pairs removed, the miner path equals the default all-pairs path
    plain = CrossBatchMemory(TinyContrastive(), embedding_size=3, memory_size=10)
    mined = CrossBatchMemory(
        TinyContrastive(), embedding_size=3, memory_size=10, miner=RecordingMiner()
    )
    for x, labels in stream:
        torch.testing.assert_close(mined(x, labels), plain(x, labels))


def test_triplet_miner_self_triplets_removed():
    class Recorder(TinyContrastive):
        def compute(self, embeddings, labels, indices, ref_emb, ref_labels):
            self.calls.append(indices)
            return embeddings.sum() * 0

    inner = Recorder()
    xbm = CrossBatchMemory(
        inner, embedding_size=3, memory_size=10, miner=RecordingMiner(triplets=True)
    )
    x, labels = torch.randn(5, 3), torch.tensor([0, 0, 1, 1, 1])
    xbm(x, labels)
    a, p, n = inner.calls[-1]
    assert len(a) > 0 and not (a == p).any()
    assert (labels[a] == labels[p]).all() and (labels[a] != labels[n]).all()


def test_extra_indices_are_appended():
    inner = TinyContrastive()
    xbm = CrossBatchMemory(inner, embedding_size=3, memory_size=10)
    x, labels = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    extra = (torch.tensor([0]), torch.tensor([2]), torch.tensor([1]), torch.tensor([0]))
    xbm(x, labels, indices=extra)
    a1, p, a2, n, _ = inner.calls[-1]
    assert len(a1) == 4 + 1 and len(a2) == 8 + 1
    assert (a1[-1], p[-1], a2[-1], n[-1]) == (0, 2, 1, 0)
    with pytest.raises(ShapeError, match="pairs or triplets"):
        xbm(x, labels, indices=(torch.tensor([0]), torch.tensor([2]), torch.tensor([1])))


def test_state_dict_round_trip_resumes_identically():
    stream = _stream(6, 4, seed=3)
    a = CrossBatchMemory(TinyContrastive(), embedding_size=3, memory_size=7)
    for x, labels in stream[:3]:
        a(x.float(), labels)
    state = a.state_dict()
    assert {"embedding_memory", "label_memory", "queue_ptr", "queue_count"} <= set(state)
    b = CrossBatchMemory(TinyContrastive(), embedding_size=3, memory_size=7)
    b.load_state_dict(state)
    assert b.num_stored == a.num_stored == 7
    for x, labels in stream[3:]:
        torch.testing.assert_close(a(x.float(), labels), b(x.float(), labels))
    b.reset_queue()
    assert b.num_stored == 0


def test_bfloat16_and_batch_larger_than_memory():
    xbm = CrossBatchMemory(TinyContrastive(), embedding_size=8, memory_size=5)
    for _ in range(3):
        x = torch.randn(12, 8).bfloat16().requires_grad_()
        out = xbm(x, torch.randint(0, 3, (12,)))
        out.backward()
        assert torch.isfinite(out.float()) and torch.isfinite(x.grad.float()).all()
    assert xbm.num_stored == 5 and xbm.embedding_memory.dtype == torch.float32


def test_a_queue_widened_under_inference_mode_still_trains():
    # the first float64 call (a validation loss under torch.inference_mode()) re-typed the queue
    # as an inference tensor; every later training call's enqueue then raised "Inplace update
    # to inference tensor outside InferenceMode"
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.arange(12) % 4
    xbm = CrossBatchMemory(TinyContrastive(), embedding_size=8, memory_size=30)
    with torch.inference_mode():
        xbm(x, labels)
    assert xbm.embedding_memory.dtype == torch.float64 and not xbm.embedding_memory.is_inference()
    emb = x.clone().requires_grad_()
    xbm(emb, labels).backward()
    assert xbm.num_stored == 24 and torch.isfinite(emb.grad).all()


def test_no_pairs_gives_zero_with_gradient():
    xbm = CrossBatchMemory(TinyContrastive(), embedding_size=2, memory_size=4)
    x = torch.randn(1, 2, requires_grad=True)
    out = xbm(x, torch.tensor([0]))  # a single sample, empty memory: no pair at all
    out.backward()
    assert out.item() == 0.0 and x.grad is not None
    assert xbm.num_stored == 1


def test_errors():
    with pytest.raises(ConfigError, match="pair-based"):
        CrossBatchMemory(ProxyAnchorLoss(3, 4), embedding_size=4)
    with pytest.raises(ConfigError, match="indices"):
        CrossBatchMemory(NoIndicesLoss(), embedding_size=4)
    with pytest.raises(ConfigError):
        CrossBatchMemory(torch.nn.MSELoss(), embedding_size=4)
    with pytest.raises(ConfigError):
        CrossBatchMemory(TinyContrastive(), embedding_size=4, memory_size=0)
    xbm = CrossBatchMemory(TinyContrastive(), embedding_size=4)
    with pytest.raises(ShapeError, match="embedding_size=4"):
        xbm(torch.randn(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match="ref_emb"):
        xbm(
            torch.randn(2, 4),
            torch.tensor([0, 1]),
            ref_emb=torch.randn(2, 4),
            ref_labels=torch.tensor([0, 1]),
        )


_HAS_PAIR_LOSSES = importlib.util.find_spec("dmlkit.losses.pair_losses") is not None


@pytest.mark.skipif(not _HAS_PAIR_LOSSES, reason="dmlkit.losses.pair_losses not written yet")
def test_with_dmlkit_contrastive_loss():
    from dmlkit.losses.pair_losses import ContrastiveLoss

    stream = _stream(4, 6, dim=5, seed=7)
    xbm = CrossBatchMemory(ContrastiveLoss(), embedding_size=5, memory_size=9)
    for x, labels in stream:
        x = x.requires_grad_()
        out = xbm(x, labels)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(x.grad).all()
    # the first call (empty memory) is the plain in-batch loss
    x, labels = stream[0]
    fresh = CrossBatchMemory(ContrastiveLoss(), embedding_size=5, memory_size=9)
    torch.testing.assert_close(fresh(x, labels), ContrastiveLoss()(x, labels))


@pytest.mark.skipif(not _HAS_PAIR_LOSSES, reason="dmlkit.losses.pair_losses not written yet")
@pytest.mark.parametrize("name", ["contrastive", "triplet", "multi_similarity"])
def test_values_match_pytorch_metric_learning_xbm(name):
    """pml enqueues first and keeps ``memory_size`` entries *including* the current batch, so
    pml with ``M + B`` slots holds the same reference set as dmlkit with ``M``."""
    pml = pytest.importorskip("pytorch_metric_learning.losses")
    from dmlkit.losses import get_loss

    peer = {
        "contrastive": pml.ContrastiveLoss,
        "triplet": lambda: pml.TripletMarginLoss(margin=0.2),  # pml's default margin is 0.05
        "multi_similarity": pml.MultiSimilarityLoss,
    }[name]
    batch, memory_size = 8, 20
    ours = CrossBatchMemory(get_loss(name), embedding_size=6, memory_size=memory_size)
    theirs = pml.CrossBatchMemory(peer(), embedding_size=6, memory_size=memory_size + batch)
    for x, labels in _stream(6, batch, dim=6, classes=4, seed=11):
        torch.testing.assert_close(ours(x, labels), theirs(x, labels).to(x.dtype))
