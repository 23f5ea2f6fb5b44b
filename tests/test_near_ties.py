"""Near-ties in the kNN metrics are settled exactly (dmlkit.metrics.near_ties): P@1, R-Precision,
MAP@R and P@K equal the float64 ranking (ties by index) whatever the backend, the float32
summation order, or how many references tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.distances import CosineSimilarity, DotProductSimilarity, LpDistance
from dmlkit.metrics import evaluate, evaluate_streaming, faiss_available
from dmlkit.validation import normalize_rows

METRICS = ["precision_at_1", "r_precision", "map_at_r", "precision_at_3"]
BACKENDS = ["torch", "numba", pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="faiss"))]


def _brute(x: np.ndarray, labels: np.ndarray, distance, ref: np.ndarray | None = None,
           ref_labels: np.ndarray | None = None) -> dict[str, float]:
    """The metrics from a float64 ranking of the prepared float32 rows (ties by index)."""
    same = ref is None
    ref, ref_labels = (x, labels) if same else (ref, ref_labels)
    if isinstance(distance, CosineSimilarity):
        q64, r64 = normalize_rows(x).astype(np.float64), normalize_rows(ref).astype(np.float64)
    else:
        q64, r64 = x.astype(np.float64), ref.astype(np.float64)
    if isinstance(distance, LpDistance):
        s = -((q64[:, None, :] - r64[None, :, :]) ** 2).sum(-1)
    else:
        s = q64 @ r64.T
    out: dict[str, list[float]] = {m: [] for m in METRICS}
    for i in range(len(x)):
        keep = np.arange(len(ref)) != i if same else np.ones(len(ref), bool)
        sc, lab, ids = s[i][keep], ref_labels[keep], np.arange(len(ref))[keep]
        rel = lab[np.lexsort((ids, -sc))] == labels[i]
        r = int(rel.sum())
        if r == 0:
            continue
        out["precision_at_1"].append(float(rel[0]))
        out["precision_at_3"].append(float(rel[:3].mean()))
        out["r_precision"].append(float(rel[:r].mean()))
        hits = rel[:r]
        out["map_at_r"].append(float((np.cumsum(hits) / np.arange(1, r + 1) * hits).sum() / r))
    return {m: float(np.mean(v)) for m, v in out.items()}


def _near_duplicates(seed: int, n_tied: int = 40, spread: float = 3e-7, d: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """A query direction, ``n_tied`` references within ``spread`` of it (their float32 closeness
    to each other all 1.0 or a few ulps apart, their float64 closeness all different) of two
    shuffled labels, and 60 unrelated rows."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(d)
    base /= np.linalg.norm(base)
    tied = base[None] + spread * rng.standard_normal((n_tied, d))
    other = rng.standard_normal((60, d))
    x = np.concatenate([base[None], tied, other]).astype(np.float32)
    labels = np.concatenate([[0], rng.permutation(np.arange(n_tied) % 2), 2 + np.arange(60) % 20])
    return x, labels


def _check(got: dict, want: dict) -> None:
    for m in METRICS:
        assert float(got[m]) == pytest.approx(want[m], abs=1e-12), m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("distance", [CosineSimilarity(), DotProductSimilarity(normalize_embeddings=False),
                                      LpDistance(normalize_embeddings=False), LpDistance(power=2, normalize_embeddings=False)],
                         ids=["cosine", "dot", "euclidean", "squared-euclidean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_runs_of_near_ties_follow_the_float64_ranking(backend, distance, seed):
    """40 references whose float32 closeness is equal or ulps apart: the old rule (8 ulps, four
    odd-even passes) left them near index order (P@1 0.112 against 0.108, MAP@R off by 0.008)."""
    x, labels = _near_duplicates(seed)
    got = evaluate(torch.from_numpy(x), torch.from_numpy(labels), metrics=METRICS, distance=distance,
                   backend=backend)
    _check(got, _brute(x, labels, distance))


@pytest.mark.parametrize("backend", BACKENDS)
def test_references_tied_beyond_k_are_found(backend):
    """Queries whose one positive is the float64-closest of 40 references that are all 1.0 in
    float32: the kNN returns k = 2 of them (the first by index), so the positive is found only
    by searching again past the boundary."""
    rng = np.random.default_rng(7)
    d = 32
    base = rng.standard_normal(d)
    base /= np.linalg.norm(base)
    tied = (base[None] + 3e-7 * rng.standard_normal((40, d))).astype(np.float32)
    queries = np.repeat(base[None], 12, 0).astype(np.float32)
    s = queries[:1].astype(np.float64) @ normalize_rows(tied).astype(np.float64).T
    order = np.lexsort((np.arange(40), -s[0]))
    assert order[0] > 2  # the float64 best is not among the first references by index
    ref_labels = np.arange(40)
    query_labels = np.full(12, order[0])
    got = evaluate(torch.from_numpy(queries), torch.from_numpy(query_labels), torch.from_numpy(tied),
                   torch.from_numpy(ref_labels), metrics=["precision_at_1", "map_at_r"], backend=backend)
    assert float(got["precision_at_1"]) == 1.0
    assert float(got["map_at_r"]) == 1.0
    # streamed in blocks of 8 references: the boundary search reads every block again
    got = evaluate_streaming(queries, query_labels, tied, ref_labels, metrics=["precision_at_1", "map_at_r"],
                             backend=backend, block_rows=8)
    assert float(got["precision_at_1"]) == 1.0
    assert float(got["map_at_r"]) == 1.0


def test_streaming_settles_ties_like_evaluate(tmp_path):
    """The streaming path (blocks of references, the boundary search reading them again) gives
    the same numbers as the in-memory one and the float64 ranking."""
    x, labels = _near_duplicates(3)
    want = _brute(x, labels, CosineSimilarity())
    got = evaluate_streaming(x, labels, metrics=METRICS, block_rows=16)
    _check(got, want)


def test_far_apart_scores_are_left_as_the_knn_ranked_them():
    """Well-separated data: nothing is re-scored, the result equals the float32 kNN's."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    labels = np.arange(300) % 7
    got = evaluate(torch.from_numpy(x), torch.from_numpy(labels), metrics=METRICS, backend="torch")
    _check(got, _brute(x, labels, CosineSimilarity()))


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("distance", [CosineSimilarity(), DotProductSimilarity(normalize_embeddings=False),
                                      LpDistance(normalize_embeddings=False)], ids=["cosine", "dot", "euclidean"])
def test_collapsed_embeddings_follow_the_float64_ranking(backend, distance):
    """Every row within 1e-7 of one direction (a collapsed network): every query's neighbours
    tie past the boundary, so every row is searched again, within a 1 MiB budget (row chunks,
    column blocks, and for inner products the dense float64 product)."""
    rng = np.random.default_rng(11)
    base = rng.standard_normal(24)
    x = (base / np.linalg.norm(base) + 1e-7 * rng.standard_normal((300, 24))).astype(np.float32)
    labels = rng.integers(0, 6, 300)
    got = evaluate(torch.from_numpy(x), torch.from_numpy(labels), metrics=METRICS, distance=distance,
                   backend=backend, memory_budget=2**20)
    _check(got, _brute(x, labels, distance))


@pytest.mark.parametrize("entry", ["evaluate", "streaming"])
def test_metrics_multiply_in_full_float32_whatever_the_callers_precision(entry, monkeypatch):
    """Under torch.set_float32_matmul_precision("medium") (TF32 / bfloat16 products, errors
    ~1e-3) no bound of the metric paths would hold: every product of the metrics runs at
    "highest", and the caller's setting is back afterwards."""
    from dmlkit.metrics.knn import _Scorer

    seen: list[str] = []
    block = _Scorer.block

    def spy(self, *args, **kwargs):
        seen.append(torch.get_float32_matmul_precision())
        return block(self, *args, **kwargs)

    monkeypatch.setattr(_Scorer, "block", spy)
    x, labels = _near_duplicates(5)
    torch.set_float32_matmul_precision("medium")
    try:
        if entry == "evaluate":
            got = evaluate(torch.from_numpy(x), torch.from_numpy(labels), metrics=METRICS, backend="torch")
        else:
            got = evaluate_streaming(x, labels, metrics=METRICS, backend="torch", block_rows=32)
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert seen and set(seen) == {"highest"}
    _check(got, _brute(x, labels, CosineSimilarity()))


@pytest.mark.parametrize("longest", [2, 5, 32, 33, 70])
def test_runs_are_sorted_by_closeness_then_index(longest, monkeypatch):
    """Both ways of sorting within runs (odd-even transposition up to 32, three stable sorts
    beyond) give (float64 closeness descending, reference ascending) in every run, exact
    float64 ties included, with the closeness in the same order (the tie groups read it)."""
    from dmlkit.metrics.near_ties import _sorted_within_runs

    rng = np.random.default_rng(longest)
    lengths = rng.integers(1, longest + 1, 200)
    lengths[0] = longest
    runs = torch.from_numpy(np.repeat(np.arange(200), lengths))
    s64 = torch.from_numpy(rng.integers(0, 4, runs.numel()).astype(np.float64) / 3)  # many ties
    refs = torch.from_numpy(rng.permutation(10 * runs.numel())[: runs.numel()])
    got, got_s64 = (t.numpy() for t in _sorted_within_runs(runs, s64, refs))
    want, want_s64 = np.empty_like(got), np.empty_like(got_s64)
    first = 0
    for length in lengths:
        seg = slice(first, first + length)
        order = np.lexsort((refs.numpy()[seg], -s64.numpy()[seg]))
        want[seg] = refs.numpy()[seg][order]
        want_s64[seg] = s64.numpy()[seg][order]  # each closeness moves with its reference
        first += length
    assert (got == want).all() and (got_s64 == want_s64).all()


_PRODUCTS = {torch.mm, torch.matmul, torch.addmm, torch.bmm, torch.Tensor.__matmul__, torch.Tensor.mm,
             torch.Tensor.matmul}


class _PrecisionAtProducts(torch.overrides.TorchFunctionMode):
    """Records torch's float32 matmul precision at every matrix product made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PRODUCTS:
            self.seen.append(torch.get_float32_matmul_precision())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("entry", ["pos_neg_histograms", "knn"])
def test_other_metric_entries_multiply_in_full_float32(entry):
    """The histogram and kNN entry points too: every product at "highest", the caller's
    "medium" back afterwards."""
    from dmlkit.metrics import knn, pos_neg_histograms

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((200, 16)).astype(np.float32))
    labels = torch.from_numpy(np.arange(200) % 5)
    calls = {"pos_neg_histograms": lambda: pos_neg_histograms(x, labels),
             "knn": lambda: knn(x, None, 3, backend="torch")}
    torch.set_float32_matmul_precision("medium")
    try:
        with _PrecisionAtProducts() as mode:
            calls[entry]()
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert mode.seen and set(mode.seen) == {"highest"}, mode.seen[:5]
