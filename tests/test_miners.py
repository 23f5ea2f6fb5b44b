"""Miners against slow references written from their definitions (explicit loops, float64),
and against pytorch-metric-learning's miners where the two are equivalent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dmlkit.distances import CosineSimilarity, LpDistance, SNRDistance
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.miners import (
    MINERS,
    AllPairsMiner,
    AllTripletsMiner,
    BatchAllMiner,
    BatchHardMiner,
    DistanceWeightedMiner,
    HardNegativePairMiner,
    MultiSimilarityMiner,
    SemiHardMiner,
    get_miner,
    label_masks,
    pairs_from_triplets,
    triplets_from_pairs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MARGIN = 0.2


# ------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------
def make_batch(kind: str, seed: int = 0, dim: int = 6):
    g = torch.Generator().manual_seed(seed)
    if kind == "classes":
        labels = torch.randint(0, 4, (18,), generator=g)
    elif kind == "one_class":
        labels = torch.zeros(9, dtype=torch.long)
    elif kind == "singletons":
        labels = torch.arange(9)
    elif kind == "mixed":  # classes of sizes 1..4
        labels = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 5])
    else:
        raise ValueError(kind)
    emb = torch.randn(labels.shape[0], dim, generator=g, dtype=torch.float64)
    return emb, labels


KINDS = ["classes", "one_class", "singletons", "mixed"]


def ref_value(x: np.ndarray, y: np.ndarray, dist: str) -> float:
    """Farness (smaller = closer) of one pair, from the formula."""
    if dist == "cosine":
        return -float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    if dist == "euclidean":
        xn, yn = x / np.linalg.norm(x), y / np.linalg.norm(y)
        return float(math.sqrt(((xn - yn) ** 2).sum()))
    if dist == "snr":
        return float(np.var(y - x, ddof=1) / np.var(x, ddof=1))
    raise ValueError(dist)


DIST_OBJ = {"cosine": CosineSimilarity, "euclidean": LpDistance, "snr": SNRDistance}


class Ref:
    """Loop-based view of a batch: farness f[i][j], positive and negative pair lists."""

    def __init__(self, emb, labels, ref_emb=None, ref_labels=None, dist="cosine"):
        same = ref_emb is None
        x = emb.double().numpy()
        r = x if same else ref_emb.double().numpy()
        lab = labels.tolist()
        rlab = lab if same else ref_labels.tolist()
        self.n, self.m = len(lab), len(rlab)
        self.f = [[ref_value(x[i], r[j], dist) for j in range(self.m)] for i in range(self.n)]
        self.pos = {i: [j for j in range(self.m) if rlab[j] == lab[i] and not (same and i == j)] for i in range(self.n)}
        self.neg = {i: [j for j in range(self.m) if rlab[j] != lab[i]] for i in range(self.n)}

    def pos_pairs(self):
        return {(i, j) for i in range(self.n) for j in self.pos[i]}

    def neg_pairs(self):
        return {(i, j) for i in range(self.n) for j in self.neg[i]}

    def triplets(self):
        return {(a, p, n) for a in range(self.n) for p in self.pos[a] for n in self.neg[a]}


def as_set(*tensors):
    return set(zip(*[t.tolist() for t in tensors]))


def run(miner, emb, labels, ref_emb=None, ref_labels=None, device="cpu"):
    args = [emb.to(device), labels.to(device)]
    if ref_emb is not None:
        args += [ref_emb.to(device), ref_labels.to(device)]
    out = miner(*args)
    for t in out:
        assert t.dtype == torch.long and t.device.type == torch.device(device).type
    return tuple(t.cpu() for t in out)


def ref_case(kind, ref: bool, seed=0):
    emb, labels = make_batch(kind, seed)
    if not ref:
        return emb, labels, None, None
    g = torch.Generator().manual_seed(seed + 100)
    ref_labels = torch.cat([labels[:5], torch.randint(0, 6, (7,), generator=g)])
    ref_emb = torch.randn(ref_labels.shape[0], emb.shape[1], generator=g, dtype=torch.float64)
    return emb, labels, ref_emb, ref_labels


CASES = [(k, False) for k in KINDS] + [("classes", True), ("mixed", True)]
CASE_IDS = [f"{k}{'-ref' if r else ''}" for k, r in CASES]


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------
def test_label_masks():
    labels = torch.tensor([0, 0, 1])
    pos, neg = label_masks(labels)
    assert pos.tolist() == [[False, True, False], [True, False, False], [False, False, False]]
    assert neg.tolist() == [[False, False, True], [False, False, True], [True, True, False]]
    pos, neg = label_masks(labels, torch.tensor([1, 0]))
    assert pos.tolist() == [[False, True], [False, True], [True, False]]
    assert (neg == ~pos).all()
    pos, _ = label_masks(labels, labels.clone(), exclude_self=True)
    assert not pos.diagonal().any()
    with pytest.raises(ShapeError):
        label_masks(labels, torch.tensor([1, 0]), exclude_self=True)


def test_pairs_triplets_conversion():
    emb, labels = make_batch("classes")
    ref = Ref(emb, labels)
    a, p, n = AllTripletsMiner()(emb, labels)
    a1, pp, a2, nn = pairs_from_triplets(a, p, n)
    assert as_set(a1, pp) == ref.pos_pairs()
    assert as_set(a2, nn) == {(i, j) for i, j in ref.neg_pairs() if ref.pos[i]}
    assert len(a1) == len(ref.pos_pairs())  # unique
    dup = pairs_from_triplets(a, p, n, unique=False)
    assert len(dup[0]) == len(a) and torch.equal(dup[3], n)
    # triplets_from_pairs: every combination sharing an anchor
    pairs = AllPairsMiner()(emb, labels)
    t = triplets_from_pairs(*pairs)
    assert as_set(*t) == ref.triplets() and len(t[0]) == len(ref.triplets())
    # with mined subsets: reference by loops
    sub = (pairs[0][::3], pairs[1][::3], pairs[2][::2], pairs[3][::2])
    expected = [
        (x, y, z)
        for x, y in zip(sub[0].tolist(), sub[1].tolist())
        for x2, z in zip(sub[2].tolist(), sub[3].tolist())
        if x2 == x
    ]
    got = triplets_from_pairs(*sub)
    assert list(zip(*[v.tolist() for v in got])) == expected
    empty = triplets_from_pairs(*(torch.empty(0, dtype=torch.long),) * 4)
    assert all(v.numel() == 0 for v in empty)


# ------------------------------------------------------------------------------------------
# Each miner against its loop reference
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_all_pairs_and_all_triplets(kind, use_ref, device):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab)
    a1, p, a2, n = run(AllPairsMiner(), emb, labels, remb, rlab, device)
    assert as_set(a1, p) == ref.pos_pairs() and len(a1) == len(ref.pos_pairs())
    assert as_set(a2, n) == ref.neg_pairs() and len(a2) == len(ref.neg_pairs())
    a, p, n = run(AllTripletsMiner(), emb, labels, remb, rlab, device)
    assert list(zip(a.tolist(), p.tolist(), n.tolist())) == sorted(ref.triplets())


@pytest.mark.parametrize("dist", ["cosine", "euclidean", "snr"])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_batch_hard(kind, use_ref, dist):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab, dist)
    expected = set()
    for a in range(ref.n):
        if ref.pos[a] and ref.neg[a]:
            p = max(ref.pos[a], key=lambda j: ref.f[a][j])
            n = min(ref.neg[a], key=lambda j: ref.f[a][j])
            expected.add((a, p, n))
    miner = BatchHardMiner(distance=DIST_OBJ[dist]())
    got = run(miner, emb, labels, remb, rlab)
    assert as_set(*got) == expected and len(got[0]) == len(expected)
    assert miner.stats == {"num_triplets": len(expected)} and miner.num_mined == len(expected)


@pytest.mark.parametrize("strategy", ["blocks", "sort"])
@pytest.mark.parametrize("nonzero", [True, False])
@pytest.mark.parametrize("dist", ["cosine", "euclidean"])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_batch_all(kind, use_ref, dist, nonzero, strategy):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab, dist)
    expected = {
        (a, p, n)
        for (a, p, n) in ref.triplets()
        if not nonzero or ref.f[a][n] - ref.f[a][p] < MARGIN
    }
    miner = BatchAllMiner(margin=MARGIN, nonzero=nonzero, distance=DIST_OBJ[dist](), strategy=strategy)
    got = run(miner, emb, labels, remb, rlab)
    assert as_set(*got) == expected and len(got[0]) == len(expected)


@pytest.mark.parametrize("strategy", ["blocks", "sort"])
@pytest.mark.parametrize("fallback", ["easiest", "hardest", "none"])
@pytest.mark.parametrize("dist", ["cosine", "euclidean"])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_semi_hard(kind, use_ref, dist, fallback, strategy):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab, dist)
    margin = 0.3
    hardest, every = set(), set()
    for a in range(ref.n):
        for p in ref.pos[a]:
            fap = ref.f[a][p]
            semi = [n for n in ref.neg[a] if fap < ref.f[a][n] < fap + margin]
            every |= {(a, p, n) for n in semi}
            farther = [n for n in ref.neg[a] if ref.f[a][n] > fap]
            if farther:
                n = min(farther, key=lambda j: ref.f[a][j])
                if ref.f[a][n] < fap + margin:
                    hardest.add((a, p, n))
            elif ref.neg[a] and fallback != "none":
                pick = max if fallback == "easiest" else min
                hardest.add((a, p, pick(ref.neg[a], key=lambda j: ref.f[a][j])))
    d = DIST_OBJ[dist]()
    got = run(SemiHardMiner(margin, fallback=fallback, distance=d, strategy=strategy), emb, labels, remb, rlab)
    assert as_set(*got) == hardest and len(got[0]) == len(hardest)
    got = run(SemiHardMiner(margin, negatives="all", distance=d, strategy=strategy), emb, labels, remb, rlab)
    assert as_set(*got) == every and len(got[0]) == len(every)


@pytest.mark.parametrize("ratio", [1.0, 0.5, 3.0])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_hard_negative_pairs(kind, use_ref, ratio):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab)
    pos = ref.pos_pairs()
    negs = sorted(ref.neg_pairs(), key=lambda ij: ref.f[ij[0]][ij[1]])
    k = min(round(ratio * len(pos)), len(negs))
    a1, p, a2, n = run(HardNegativePairMiner(neg_pos_ratio=ratio), emb, labels, remb, rlab)
    assert as_set(a1, p) == pos and len(a1) == len(pos)
    assert as_set(a2, n) == set(negs[:k]) and len(a2) == k
    # hardest first
    f = [ref.f[i][j] for i, j in zip(a2.tolist(), n.tolist())]
    assert f == sorted(f)


@pytest.mark.parametrize("dist", ["cosine", "euclidean"])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_multi_similarity(kind, use_ref, dist):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    ref = Ref(emb, labels, remb, rlab, dist)
    eps = 0.1
    pos, neg = set(), set()
    for a in range(ref.n):
        if not ref.pos[a] or not ref.neg[a]:
            continue
        # in similarity terms s = -f: keep S_an > min S_ap - eps and S_ap < max S_an + eps
        hardest_pos = max(ref.f[a][j] for j in ref.pos[a])
        hardest_neg = min(ref.f[a][j] for j in ref.neg[a])
        pos |= {(a, j) for j in ref.pos[a] if ref.f[a][j] + eps > hardest_neg}
        neg |= {(a, j) for j in ref.neg[a] if ref.f[a][j] - eps < hardest_pos}
    a1, p, a2, n = run(MultiSimilarityMiner(eps, distance=DIST_OBJ[dist]()), emb, labels, remb, rlab)
    assert as_set(a1, p) == pos and len(a1) == len(pos)
    assert as_set(a2, n) == neg and len(a2) == len(neg)


def ref_dw_weights(ref: Ref, dim: int, cutoff=0.5, nz=1.4):
    w = np.zeros((ref.n, ref.m))
    for a in range(ref.n):
        for n in ref.neg[a]:
            d = ref.f[a][n]
            if d < nz:
                dc = max(d, cutoff)
                q = dc ** (dim - 2) * (1 - dc * dc / 4) ** ((dim - 3) / 2)
                w[a, n] = 1.0 / q
        if ref.neg[a] and w[a].sum() == 0:
            w[a, ref.neg[a]] = 1.0
        if w[a].sum() > 0:
            w[a] /= w[a].sum()
    return w


@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_distance_weighted(kind, use_ref):
    emb, labels, remb, rlab = ref_case(kind, use_ref)
    # a small dimension so that distances spread over [0, 2] and the cutoffs matter
    ref = Ref(emb, labels, remb, rlab, "euclidean")
    miner = DistanceWeightedMiner(seed=3)
    args = (emb, labels) if remb is None else (emb, labels, remb, rlab)
    w = miner.sampling_weights(*args).numpy()
    expected = ref_dw_weights(ref, emb.shape[1])
    np.testing.assert_allclose(w, expected, rtol=1e-9, atol=1e-12)
    a, p, n = run(miner, *args)
    pairs = {(i, j) for i, j in ref.pos_pairs() if ref.neg[i]}
    assert as_set(a, p) == pairs and len(a) == len(pairs)
    for i, j in zip(a.tolist(), n.tolist()):
        assert w[i, j] > 0
    # reproducible from the seed, different with another seed
    again = run(DistanceWeightedMiner(seed=3), *args)
    assert all(torch.equal(x, y) for x, y in zip((a, p, n), again))


def test_distance_weighted_frequencies():
    g = torch.Generator().manual_seed(5)
    labels = torch.tensor([0] * 401 + list(range(1, 9)))  # anchor 0: 400 positives, 8 negatives
    emb = torch.randn(409, 4, generator=g, dtype=torch.float64)
    miner = DistanceWeightedMiner(seed=0)
    w = miner.sampling_weights(emb, labels)[0].numpy()
    counts = np.zeros(409)
    for _ in range(10):  # 400 draws for anchor 0 per call
        a, _, n = miner(emb, labels)
        np.add.at(counts, n[a == 0].numpy(), 1)
    freq = counts / counts.sum()
    assert 0.5 * np.abs(freq - w).sum() < 0.03  # total variation
    seq0 = [DistanceWeightedMiner(seed=0)(emb, labels)[2] for _ in range(1)]
    m0, m1 = DistanceWeightedMiner(seed=0), DistanceWeightedMiner(seed=1)
    draws0 = torch.cat([m0(emb, labels)[2] for _ in range(20)])
    draws1 = torch.cat([m1(emb, labels)[2] for _ in range(20)])
    assert torch.equal(draws0[: seq0[0].numel()], seq0[0])
    assert not torch.equal(draws0, draws1)


def test_distance_weighted_requires_euclidean():
    with pytest.raises(ConfigError, match="Euclidean"):
        DistanceWeightedMiner(distance="cosine")
    with pytest.raises(ConfigError):
        DistanceWeightedMiner(cutoff=1.5, nonzero_loss_cutoff=1.4)


# ------------------------------------------------------------------------------------------
# Against pytorch-metric-learning
# ------------------------------------------------------------------------------------------
pml = pytest.importorskip("pytorch_metric_learning")


def _pml():
    from pytorch_metric_learning import distances, miners
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    return distances, miners, lmu


@pytest.mark.parametrize("dist", ["cosine", "euclidean"])
@pytest.mark.parametrize(("kind", "use_ref"), CASES, ids=CASE_IDS)
def test_against_pml(kind, use_ref, dist):
    pdist, pminers, lmu = _pml()
    emb, labels, remb, rlab = ref_case(kind, use_ref, seed=7)
    pd = pdist.CosineSimilarity() if dist == "cosine" else pdist.LpDistance()
    dd = DIST_OBJ[dist]()
    args = (emb, labels) if remb is None else (emb, labels, remb, rlab)

    assert as_set(*BatchHardMiner(distance=dd)(*args)) == as_set(*pminers.BatchHardMiner(distance=pd)(*args))
    for typ, ours in [
        ("semihard", SemiHardMiner(MARGIN, negatives="all", distance=dd)),
        ("all", BatchAllMiner(MARGIN, nonzero=True, distance=dd)),
    ]:
        theirs = pminers.TripletMarginMiner(margin=MARGIN, type_of_triplets=typ, distance=pd)(*args)
        mine = ours(*args)
        assert as_set(*mine) == as_set(*theirs) and len(mine[0]) == len(theirs[0])
    ms, pms = MultiSimilarityMiner(0.1, distance=dd)(*args), pminers.MultiSimilarityMiner(0.1, distance=pd)(*args)
    assert as_set(ms[0], ms[1]) == as_set(pms[0], pms[1])
    assert as_set(ms[2], ms[3]) == as_set(pms[2], pms[3])
    rl = labels if rlab is None else rlab
    theirs = lmu.get_all_pairs_indices(labels, rl if rlab is not None else labels)
    mine = AllPairsMiner()(*args)
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))  # same order too
    theirs = lmu.get_all_triplets_indices(labels, rl if rlab is not None else labels)
    mine = AllTripletsMiner()(*args)
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs))


# ------------------------------------------------------------------------------------------
# Contract, errors, dtypes
# ------------------------------------------------------------------------------------------
def test_registry_and_contract():
    assert set(MINERS) == {
        "all_pairs", "all_triplets", "batch_hard", "semi_hard", "batch_all",
        "hard_negative_pairs", "multi_similarity", "distance_weighted",
    }
    emb, labels = make_batch("classes")
    emb = emb.float().requires_grad_()
    for name, cls in MINERS.items():
        miner = get_miner(name)
        assert isinstance(miner, cls) and isinstance(miner, torch.nn.Module)
        out = miner(emb, labels)
        assert len(out) == (4 if miner.output_type == "pair" else 3)
        assert all(not t.requires_grad for t in out)
        assert miner.num_mined == sum(t.numel() for t in out[:: 2 if len(out) == 4 else 3])
    with pytest.raises(ConfigError, match="unknown miner"):
        get_miner("nope")
    with pytest.raises(ConfigError, match="bad parameters"):
        get_miner("batch_hard", margin=3)
    assert get_miner("batch_all", margin=0.5, distance="euclidean").margin == 0.5


def test_input_errors():
    miner = BatchHardMiner()
    emb, labels = make_batch("classes")
    with pytest.raises(ShapeError):
        miner(emb[0], labels)
    with pytest.raises(ShapeError):
        miner(emb, labels[:-1])
    with pytest.raises(ShapeError):
        miner(emb, labels.float())
    with pytest.raises(ShapeError):
        miner(emb, labels, emb)
    with pytest.raises(ShapeError):
        miner(emb, labels, emb[:, :3], labels)
    bad = emb.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        miner(bad, labels)
    with pytest.raises(ConfigError):
        SemiHardMiner(negatives="some")


def test_block_boundaries(monkeypatch):
    """Tiny blocks (a few positive pairs each) give the same triplets as one block."""
    emb, labels = make_batch("classes", seed=3)
    big = [m(emb, labels) for m in (BatchAllMiner(strategy="blocks"), SemiHardMiner(0.3, strategy="blocks"))]
    monkeypatch.setattr("dmlkit.losses._pairs.CPU_BLOCK_ELEMENTS", 40)
    small = [m(emb, labels) for m in (BatchAllMiner(strategy="blocks"), SemiHardMiner(0.3, strategy="blocks"))]
    for x, y in zip(big, small):
        assert as_set(*x) == as_set(*y) and len(x[0]) == len(y[0])
    with pytest.raises(ConfigError, match="max_triplets"):
        BatchAllMiner(max_triplets=5, strategy="blocks")(emb, labels)


def test_all_triplets_size_limit():
    labels = torch.arange(200) % 10
    emb = torch.randn(200, 8)
    with pytest.raises(ConfigError, match="built-in all-triplets mode"):
        AllTripletsMiner(max_triplets=10_000)(emb, labels)
    assert AllTripletsMiner(max_triplets=None)(emb, labels)[0].numel() == 200 * 19 * 180


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    emb, labels = make_batch("classes")
    for name in MINERS:
        ours = get_miner(name)(emb.to(dtype), labels)
        assert all(t.dtype == torch.long for t in ours)
    # batch hard on well-separated values gives the float64 answer
    exact = BatchHardMiner()(emb, labels)
    low = BatchHardMiner()(emb.to(dtype), labels)
    assert torch.equal(exact[0], low[0])


def test_large_batch_quadratic_memory():
    """B = 1024 with 256 classes: every miner runs without a B^3 tensor (would be 1.1e9 entries)."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(1024) // 4
    emb = torch.randn(1024, 32, generator=g)
    for name in ["batch_hard", "semi_hard", "multi_similarity", "hard_negative_pairs", "distance_weighted"]:
        out = get_miner(name)(emb, labels)
        assert out[0].numel() > 0
    out = BatchAllMiner(margin=0.05)(emb, labels)
    assert 0 < out[0].numel() < 1024 * 3 * 1020


def test_mining_under_bfloat16_autocast_uses_float32_distances():
    # the anchor's two negatives have cosines 0.899 and 0.900: equal in bfloat16 (8-bit
    # mantissa), so a bfloat16 matrix product would pick the first, not the hardest
    def at(c):
        return torch.tensor([c, (1 - c * c) ** 0.5, 0.0])

    x = torch.stack([torch.tensor([1.0, 0.0, 0.0]), at(0.5), at(0.899), at(0.900)])
    y = torch.tensor([0, 0, 1, 2])
    miner = get_miner("batch_hard")
    expected = miner(x, y)
    assert expected[2][0].item() == 3  # the hardest negative of anchor 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = miner(x, y)
        unguarded = miner.mine(x, y, x, y, True)  # what autocast alone would give
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert unguarded[2][0].item() == 2  # (so this batch does test the guard)
