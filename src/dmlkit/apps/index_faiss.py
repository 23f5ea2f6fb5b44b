"""The faiss structures behind an approximate :class:`~dmlkit.apps.index.EmbeddingIndex`.

* ``ivf_flat``: ``IndexIVFFlat``, an inverted file over k-means cells (Jegou et al., "Product
  quantization for nearest neighbor search", TPAMI 2011, sec. IV); ``nlist`` defaults to
  ``4 sqrt(N)`` cells (faiss's guideline), at most ``N / 39`` so every cell trains on 39+ points.
* ``ivf_pq``: ``IndexIVFPQ``, the same cells with ``m`` product-quantised sub-vectors of
  ``nbits`` bits of the residuals (default ``m``: the largest divisor of ``D`` up to ``D / 4``).
* ``hnsw``: ``IndexHNSWFlat`` in an ``IndexIDMap2`` (Malkov and Yashunin, TPAMI 2020).

IVF kinds train on up to ``256 nlist`` rows, keeping up to ``recall_queries`` rows (at most
10 %) out of the training for the held-out recall measurement. An HNSW graph keeps as many
rows of its first batch out of the graph until its recall has been measured
(:func:`add_to_structure`, :func:`flush_graph_reserve`): a query that is itself a node of the
graph finds its neighbours more easily than a new one, so in-graph queries overstate recall.
That deferred insertion is the one thing a search writes: it runs under the index's own lock,
so searches from several threads at once see the whole graph (:func:`flush_graph_reserve`).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit.exceptions import ConfigError, DataError, DependencyError, require

if TYPE_CHECKING:
    from dmlkit.apps.index import EmbeddingIndex

__all__ = [
    "KIND_SETTINGS", "SETTING_DEFAULTS", "add_to_structure", "default_nlist", "default_pq_m", "faiss_module",
    "flush_graph_reserve", "new_faiss_index", "refuse_unused_settings", "rows_of_keys", "search_params", "to_gpu",
]


def faiss_module() -> Any:
    """The faiss module (:class:`~dmlkit.exceptions.DependencyError` with the install hint if missing)."""
    return require("faiss", "faiss")


def default_nlist(n: int) -> int:
    """``4 sqrt(N)`` cells (faiss's guideline), at most ``N / 39`` so each cell trains on 39+ points."""
    return max(1, min(int(round(4 * math.sqrt(n))), n // 39))


def default_pq_m(d: int) -> int:
    """The largest divisor of ``d`` that is at most ``d / 4`` (4-dimensional sub-vectors)."""
    best = 1
    for m in range(1, max(1, d // 4) + 1):
        if d % m == 0:
            best = m
    return best


def _metric(distance: str) -> int:
    faiss = faiss_module()
    return faiss.METRIC_L2 if distance == "euclidean" else faiss.METRIC_INNER_PRODUCT


def to_gpu(index: EmbeddingIndex, structure: Any) -> Any:
    """``structure`` on GPU 0 when the index was built with ``gpu=True``, else unchanged."""
    if not index.params["gpu"]:
        return structure
    faiss = faiss_module()
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        raise DependencyError("gpu=True needs faiss with GPU support and a visible GPU: "
                              "install faiss-gpu (conda) or build without --gpu")
    if not hasattr(index, "_gpu_res"):
        index._gpu_res = faiss.StandardGpuResources()
    return faiss.index_cpu_to_gpu(index._gpu_res, 0, structure)


def new_faiss_index(index: EmbeddingIndex, emb: np.ndarray, keys: np.ndarray) -> Any:
    """A trained, empty faiss structure for ``index.kind`` (IVF kinds train on a sample of ``emb``).

    Fills the derived settings into ``index.params`` (``nlist``, ``pq_m``, ``pq_nbits``,
    ``nprobe``) and the trained rows' keys into ``index._trained_keys``.
    """
    faiss = faiss_module()
    d, n = emb.shape[1], emb.shape[0]
    p = index.params
    if index.kind == "hnsw":
        inner = faiss.IndexHNSWFlat(d, p["hnsw_m"], _metric(index.distance))
        inner.hnsw.efConstruction = p["ef_construction"]
        structure = faiss.IndexIDMap2(inner)  # faiss's wrapper keeps `inner` referenced
        index._trained_keys = np.empty((0,), dtype=np.int64)
        return structure
    # keep up to recall_queries rows (at most 10 %) out of the training: the recall sample
    reserve = min(index._recall_reserve, n // 10)
    if p["nlist"] and p["nlist"] * 39 > n - reserve:
        reserve = 0
    # cells for every row the index will hold (add_blocks trains on its first block), each
    # trained on 39+ of the rows at hand
    total = max(n, index._planned_rows)
    nlist = p["nlist"] or max(1, min(default_nlist(total - reserve), (n - reserve) // 39))
    if nlist > n:
        raise ConfigError(f"nlist={nlist} is larger than the {n} vectors to train on: use nlist <= {n}")
    p["nlist"] = int(nlist)
    quantizer = faiss.IndexFlatL2(d) if index.distance == "euclidean" else faiss.IndexFlatIP(d)
    if index.kind == "ivf_flat":
        structure = faiss.IndexIVFFlat(quantizer, d, nlist, _metric(index.distance))
        min_train = nlist * 256
    else:
        m = p["pq_m"] or default_pq_m(d)
        if d % m:
            raise ConfigError(f"pq_m={m} must divide the embedding size {d}")
        nbits = min(p["pq_nbits"], max(1, int(math.log2(max(2, (n - reserve) // 39)))))
        if n - reserve < 2**nbits:  # faiss's RuntimeError (a traceback) for one vector
            raise DataError(f"an ivf_pq index trains {2**nbits} codes per sub-vector on at least as many "
                            f"vectors, got {n - reserve}: index more vectors, or use --kind flat")
        p["pq_m"], p["pq_nbits"] = int(m), int(nbits)
        structure = faiss.IndexIVFPQ(quantizer, d, nlist, m, nbits, _metric(index.distance))
        min_train = max(nlist * 256, 2**nbits * 256)
        structure.pq.cp.seed = p["seed"]
    structure.cp.seed = p["seed"]
    rng = np.random.default_rng(p["seed"])
    pool = rng.permutation(n)[reserve:]
    rows = np.sort(pool[:min(len(pool), min_train)])
    structure.train(index._prepare(emb[rows]))
    index._trained_keys = keys[rows]
    if p["nprobe"] is None:
        p["nprobe"] = min(nlist, 8)
    elif p["nprobe"] > nlist:  # faiss scans every cell: say so, and report what is scanned
        warnings.warn(f"nprobe={p['nprobe']} is more than the index's {nlist} cells: every cell is scanned "
                      f"(nprobe={nlist})", stacklevel=2)
        p["nprobe"] = int(nlist)
    return to_gpu(index, structure)


def add_to_structure(index: EmbeddingIndex, emb: np.ndarray, keys: np.ndarray) -> None:
    """Add rows to the faiss structure (made, and trained, from the first batch: :func:`new_faiss_index`).

    The first batch of an HNSW index leaves up to
    ``recall_queries`` of its rows (at most 10 %, a seeded sample) out of the graph, in
    ``index._graph_reserve``, as the held-out queries of its recall measurement; they join the
    graph by :func:`flush_graph_reserve` once the recall is measured, or before anything else
    reads the graph (a search, save, remove)."""
    first = index._faiss_index is None
    if first:
        index._faiss_index = new_faiss_index(index, emb, keys)
    if first and index.kind == "hnsw":
        reserve = min(index._recall_reserve, emb.shape[0] // 10)
        held = np.zeros(emb.shape[0], dtype=bool)
        held[np.random.default_rng(index.params["seed"] + 1).choice(emb.shape[0], reserve, replace=False)] = True
        index._graph_reserve = keys[held]
        emb, keys = emb[~held], keys[~held]
    index._faiss_index.add_with_ids(index._prepare(emb), keys)


def flush_graph_reserve(index: EmbeddingIndex) -> None:
    """Insert the rows an HNSW graph held out for its recall measurement (no-op when none).

    Thread-safe: the first search of a fresh graph does this while other threads may be
    searching too. ``index._graph_lock`` is held over the check and the insertion, and the
    reserve is emptied only once the rows are in the graph, so a search that finds it empty
    searches the complete graph (emptied first, concurrent searches missed those rows and read a
    graph faiss was still changing: recall@10 0.86-0.93 instead of 0.997 with 4 threads)."""
    if index._graph_reserve.size == 0:  # the common case: no lock
        return
    with index._graph_lock:
        held = index._graph_reserve
        if held.size == 0:  # another thread inserted them while this one waited
            return
        index._faiss_index.add_with_ids(index._prepare(index.embeddings[index._rows_of_keys(held)]), held)
        index._graph_reserve = np.empty((0,), dtype=np.int64)


def rows_of_keys(own: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Row positions of faiss keys in the index's increasing keys ``own`` (``-1`` stays ``-1``).

    When the first key is 0 and the last ``n - 1`` (nothing removed) the keys are the rows
    themselves. A key the index never issued (a damaged or hand-edited ``faiss.index``: its id
    map or inverted lists name other keys; an ``IndexError`` traceback, or rows silently
    dropped for negative keys) is one :class:`DataError`."""
    n = own.size
    found = keys >= 0
    if n and own[0] == 0 and own[-1] == n - 1:
        rows = keys
        bad = (keys >= n) | (keys < -1)
    else:
        rows = np.where(found, np.searchsorted(own, np.where(found, keys, 0)), -1)
        inside = found & (rows < n)
        bad = (keys < -1) | (found & ~inside)
        bad[inside] |= own[rows[inside]] != keys[inside]
    if bad.any():
        key = int(keys[bad].flat[0])
        raise DataError(f"the index is damaged: its faiss structure returned key {key}, which is no item's "
                        f"({n} items): rebuild it with `dmlkit index`")
    return rows


#: The build and search settings each kind uses, and their defaults in
#: :class:`~dmlkit.apps.index.EmbeddingIndex` (``None``: chosen from the data).
#: (faiss has no GPU flat-with-ids or HNSW index: ``gpu`` is for the IVF kinds.)
KIND_SETTINGS = {"flat": (), "ivf_flat": ("nlist", "nprobe", "gpu"), "hnsw": ("hnsw_m", "ef_construction", "ef_search"),
                 "ivf_pq": ("nlist", "pq_m", "pq_nbits", "nprobe", "rerank", "gpu")}
SETTING_DEFAULTS = {"nlist": None, "pq_m": None, "pq_nbits": 8, "hnsw_m": 32, "ef_construction": 40,
                    "nprobe": None, "rerank": 4, "ef_search": 64, "gpu": False}


def refuse_unused_settings(kind: str, settings: dict[str, Any]) -> None:
    """Refuse a setting ``kind`` does not use, given a value other than its default
    (``EmbeddingIndex(kind="hnsw", nprobe=16)`` built an HNSW graph and ignored it; the CLI
    refused the same options): one :class:`ConfigError` naming them."""
    unused = [f"{name}={settings[name]!r}" for name, default in SETTING_DEFAULTS.items()
              if name not in KIND_SETTINGS[kind] and settings[name] != default]
    if unused:
        users = sorted({k for name in unused for k, uses in KIND_SETTINGS.items() if name.split("=")[0] in uses})
        raise ConfigError(f"{', '.join(unused)} {'do' if len(unused) > 1 else 'does'} not apply to {kind} indexes: "
                          f"leave {'them' if len(unused) > 1 else 'it'} out, or pick a kind that uses "
                          f"{'them' if len(unused) > 1 else 'it'} ({', '.join(users)})")


def search_params(kind: str, setting: dict[str, Any]) -> Any:
    """faiss search parameters of a setting: ``efSearch`` (HNSW) or ``nprobe`` (IVF)."""
    faiss = faiss_module()
    if kind == "hnsw":
        return faiss.SearchParametersHNSW(efSearch=int(setting["ef_search"]))
    return faiss.SearchParametersIVF(nprobe=int(setting["nprobe"]))
