"""An embedding index: exact or approximate nearest-neighbour search with measured recall.

Kinds (``EmbeddingIndex(kind=...)``):

* ``flat``: exact search with :func:`dmlkit.metrics.knn` (blockwise, bounded memory, ties by
  reference order), so the index returns the same neighbours as the metrics.
* ``ivf_flat``: faiss ``IndexIVFFlat``, an inverted file over k-means cells (Jegou et al.,
  "Product quantization for nearest neighbor search", TPAMI 2011, sec. IV); a query scans the
  ``nprobe`` nearest cells exactly.
* ``ivf_pq``: faiss ``IndexIVFPQ``, the same inverted file with product-quantised residual codes
  (Jegou et al. 2011); the ``rerank * k`` best candidates are re-scored exactly against the
  stored float32 vectors ("re-ranking with source coding", Jegou et al., ICASSP 2011).
* ``hnsw``: faiss ``IndexHNSWFlat``, a hierarchical navigable small-world graph (Malkov and
  Yashunin, TPAMI 2020); a query explores ``ef_search`` candidates.

Every approximate index measures its recall at build time against the exact search on a
sample of held-out queries (rows not used to train the quantiser; the query row itself is
excluded from both result lists):

    recall@k = mean over queries q of |ANN_k(q) ∩ Exact_k(q)| / k

(the "k-recall@k" of ANN-Benchmarks, Aumüller et al., Information Systems 2020), and
``target_recall`` tunes ``nprobe`` / ``rerank`` / ``ef_search`` to the cheapest setting that
reaches it (cost: the bytes a query scans).

The float32 vectors are always kept beside the faiss structure: they are the source of truth
for exact recall measurement, re-ranking, removal (HNSW graphs cannot delete: the graph is
rebuilt) and save/load.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.apps.index_files import item_ids, load_index, save_index
from dmlkit.distances import get_distance
from dmlkit.exceptions import (
    ConfigError,
    DataError,
    DependencyError,
    ShapeError,
    require,
)
from dmlkit.validation import check_embeddings

__all__ = ["INDEX_KINDS", "EmbeddingIndex", "SearchResult", "item_ids", "recall_at_k"]

INDEX_KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw")
_RERANK_FACTORS = (1, 2, 4, 8, 16)
_SMALL_EXACT = 2**22  # exact search of Q x M <= this many scores: one matmul, no tiling
_EF_VALUES = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048)


@dataclass(frozen=True)
class SearchResult:
    """Neighbours of each query, closest first: ``(Q, k)`` arrays.

    ``indices`` are row positions in the index (``-1`` where an approximate search found fewer
    than ``k`` neighbours), ``ids`` the items' identifiers, ``labels`` their labels (or
    ``None``), ``metadata`` their metadata dicts (or ``None``).
    """

    indices: np.ndarray
    scores: np.ndarray
    labels: np.ndarray | None
    ids: np.ndarray | None
    higher_is_closer: bool
    metadata: list[list[dict[str, Any] | None]] | None = None

    def to_records(self) -> list[list[dict[str, Any]]]:
        """One list per query of ``{"rank", "index", "score", "label", "id", "metadata"}``."""
        out = []
        for q in range(self.indices.shape[0]):
            row = []
            for r, (i, s) in enumerate(zip(self.indices[q], self.scores[q])):
                if i < 0:
                    continue
                rec: dict[str, Any] = {"rank": r + 1, "index": int(i), "score": float(s)}
                if self.labels is not None:
                    rec["label"] = int(self.labels[q, r])
                if self.ids is not None:
                    rec["id"] = str(self.ids[q, r])
                if self.metadata is not None and self.metadata[q][r] is not None:
                    rec["metadata"] = self.metadata[q][r]
                row.append(rec)
            out.append(row)
        return out


def recall_at_k(approx: np.ndarray, exact: np.ndarray, k: int) -> float:
    """``mean_q |approx[q, :k] ∩ exact[q, :k]| / k`` (ANN-Benchmarks' k-recall@k).

    Entries ``< 0`` in ``approx`` (not found) never match.
    """
    if approx.shape[0] != exact.shape[0]:
        raise ShapeError(f"{approx.shape[0]} approximate rows but {exact.shape[0]} exact rows")
    if approx.shape[0] == 0:
        return float("nan")
    hits = 0
    for a, e in zip(approx[:, :k], exact[:, :k]):
        hits += len(np.intersect1d(a[a >= 0], e))
    return hits / (approx.shape[0] * k)


def _to_numpy_embeddings(x: Any, name: str) -> np.ndarray:
    """``x`` as a float32 ``(N, D)`` array, validated by :func:`dmlkit.validation.check_embeddings`.

    Fast path (the per-query hot path of a service): a float32 numpy array whose values are all
    finite and well inside float32's range is used as is; anything else goes through the shared
    validation, which raises its one-line error or converts.
    """
    if hasattr(x, "ndim") and x.ndim == 1:
        raise ShapeError(f"{name} must be a non-empty (M, D) array, got shape {tuple(x.shape)}: "
                         "reshape a single vector with x[None]")
    if (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 2 and x.size
            and x.flags.c_contiguous and bool(np.all(np.abs(x) < 1e15))):  # NaN fails the comparison
        return x
    return np.ascontiguousarray(check_embeddings(x, name).detach().cpu().numpy(), dtype=np.float32)


def _normalize_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalised rows; the norms accumulate in float64, so neither huge (up to float32's
    maximum) nor tiny values overflow or underflow; zero rows stay zero."""
    n = np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64))
    n[n == 0] = 1
    return (x / n[:, None]).astype(np.float32, copy=False)


def _faiss():
    return require("faiss", "faiss")


def _default_nlist(n: int) -> int:
    """``4 sqrt(N)`` cells (faiss's guideline), at most ``N / 39`` so each cell trains on 39+ points."""
    return max(1, min(int(round(4 * math.sqrt(n))), n // 39))


def _default_pq_m(d: int) -> int:
    """The largest divisor of ``d`` that is at most ``d / 4`` (4-dimensional sub-vectors)."""
    best = 1
    for m in range(1, max(1, d // 4) + 1):
        if d % m == 0:
            best = m
    return best


class EmbeddingIndex:
    """Reference embeddings with ids, labels and metadata, searchable exactly or approximately.

    Args:
        embeddings: ``(M, D)`` reference embeddings (numpy or torch); ``None`` with ``dim``
            for an empty index that is filled with :meth:`add`.
        labels: optional ``(M,)`` integer labels (for :meth:`classify` and the results).
        ids: optional ``(M,)`` unique string identifiers (file paths, product ids, ...);
            default: the running row number as a string.
        distance: ``cosine`` (default), ``euclidean`` or ``dot``.
        kind: one of :data:`INDEX_KINDS`.
        metadata: optional list of ``M`` JSON-serialisable dicts (or ``None`` entries).
        nlist, pq_m, pq_nbits: IVF cells and PQ code layout (defaults: ``4 sqrt(M)`` cells,
            ``D/4`` sub-quantisers of 8 bits).
        hnsw_m, ef_construction: HNSW graph degree and build beam (faiss defaults 32 / 40).
        nprobe, rerank, ef_search: search-time settings (tuned by ``target_recall``).
        target_recall: tune the search settings to the cheapest that reaches this recall@k.
        recall_k, recall_queries: ``k`` and the number of held-out queries of the recall
            measurement done at build time for approximate kinds.
        gpu: put IVF indexes on the GPU (needs a faiss build with GPU support).
        seed: seed of the k-means training and of the recall sample.
        info: free-form JSON-serialisable facts stored with the index (e.g. ``data_root``).
        normalize: L2-normalise embeddings before ``euclidean``/``dot`` (the default of
            :mod:`dmlkit.distances`, so the index agrees with the metrics: then ``dot`` ranks
            like ``cosine`` and ``euclidean`` is ``sqrt(2 - 2 cos)``); ``False`` for raw vectors.
    """

    def __init__(
        self,
        embeddings: Any = None,
        labels: Any = None,
        ids: Any = None,
        distance: str = "cosine",
        *,
        kind: str = "flat",
        metadata: Sequence[dict[str, Any] | None] | None = None,
        dim: int | None = None,
        nlist: int | None = None,
        pq_m: int | None = None,
        pq_nbits: int = 8,
        hnsw_m: int = 32,
        ef_construction: int = 40,
        nprobe: int | None = None,
        rerank: int = 4,
        ef_search: int = 64,
        target_recall: float | None = None,
        recall_k: int = 10,
        recall_queries: int = 1000,
        gpu: bool = False,
        seed: int = 0,
        info: dict[str, Any] | None = None,
        normalize: bool = True,
    ) -> None:
        get_distance(distance)  # validates the name
        if distance not in ("cosine", "euclidean", "dot"):
            raise ConfigError(f"index distance must be cosine, euclidean or dot, got {distance!r}")
        if kind not in INDEX_KINDS:
            raise ConfigError(f"unknown index kind {kind!r}: choose one of {', '.join(INDEX_KINDS)}")
        if target_recall is not None and not 0 < target_recall <= 1:
            raise ConfigError(f"target_recall must be in (0, 1], got {target_recall}")
        if gpu and kind not in ("ivf_flat", "ivf_pq"):
            raise ConfigError(f"gpu=True needs an IVF index (faiss has no GPU {kind}); use ivf_flat or ivf_pq")
        for name, value in (("pq_nbits", pq_nbits), ("hnsw_m", hnsw_m), ("ef_construction", ef_construction),
                            ("rerank", rerank), ("ef_search", ef_search), ("recall_k", recall_k),
                            ("recall_queries", recall_queries)):
            if int(value) < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        self.distance = distance
        self.kind = kind
        self.normalize = bool(normalize)
        self._recall_reserve = int(recall_queries)
        self._unit = distance == "cosine" or self.normalize
        self.params: dict[str, Any] = {
            "nlist": nlist, "pq_m": pq_m, "pq_nbits": int(pq_nbits), "hnsw_m": int(hnsw_m),
            "ef_construction": int(ef_construction), "nprobe": nprobe, "rerank": int(rerank),
            "ef_search": int(ef_search), "gpu": bool(gpu), "seed": int(seed),
        }
        self.recall: dict[str, Any] | None = None
        self.info: dict[str, Any] = dict(info or {})
        self.embeddings = np.empty((0, int(dim or 0)), dtype=np.float32)
        self.labels: np.ndarray | None = None
        self.ids = np.empty((0,), dtype=str)
        self.metadata: list[dict[str, Any] | None] | None = None
        self._keys = np.empty((0,), dtype=np.int64)
        self._next_key = 0
        self._faiss_index: Any = None
        self._trained_keys = np.empty((0,), dtype=np.int64)
        self._id_pos: dict[str, int] | None = None
        self._norm_cache: tuple[np.ndarray, np.ndarray] | None = None
        self._has_user_labels = labels is not None
        if embeddings is None:
            if dim is None:
                raise ShapeError("pass embeddings, or dim= for an empty index")
            return
        self.add(embeddings, labels, ids, metadata)
        if kind != "flat":
            if target_recall is not None:
                self.tune(target_recall, k=recall_k, num_queries=recall_queries)
            else:
                self.measure_recall(k=recall_k, num_queries=recall_queries)

    # -- basic facts ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.embeddings.shape[0])

    def __repr__(self) -> str:
        recall = "" if not self.recall else f", recall@{self.recall['k']}={self.recall['recall']:.3f}"
        return f"EmbeddingIndex(kind={self.kind!r}, n={len(self)}, dim={self.dim}, distance={self.distance!r}{recall})"

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    @property
    def higher_is_closer(self) -> bool:
        return self.distance != "euclidean"

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable summary: kind, size, distance, settings and measured recall."""
        params = {k: v for k, v in self.params.items() if v is not None}
        return {"kind": self.kind, "count": len(self), "dim": self.dim, "distance": self.distance,
                "normalize": self.normalize,
                "labels": self.labels is not None, "metadata": self.metadata is not None,
                "params": params, "recall": self.recall, "info": self.info}

    # -- adding and removing -------------------------------------------------------------------
    def add(self, embeddings: Any, labels: Any = None, ids: Any = None,
            metadata: Sequence[dict[str, Any] | None] | None = None) -> np.ndarray:
        """Append references; returns their ids.

        Labels and metadata must be given for all items or none of them; ids default to the
        running row number. IVF indexes are trained on the first batch added; later batches
        are encoded with that training (re-build to re-train after large distribution shifts).
        """
        emb = _to_numpy_embeddings(embeddings, "embeddings")
        n = emb.shape[0]
        if self.dim and emb.shape[1] != self.dim:
            raise ShapeError(f"the index holds {self.dim}-d embeddings, got {emb.shape[1]}-d")
        first = len(self) == 0
        if labels is not None:
            lab = np.asarray(labels.detach().cpu() if hasattr(labels, "detach") else labels)
            if lab.shape != (n,):
                raise ShapeError(f"labels must be ({n},), got {lab.shape}")
            if lab.dtype.kind not in "iu":
                if lab.dtype.kind == "f" and np.all(lab == np.round(lab)):
                    lab = lab.astype(np.int64)
                else:
                    raise ShapeError(f"labels must be integers, got dtype {lab.dtype}")
            lab = lab.astype(np.int64)
            if self.labels is None and not first:
                raise DataError("the index was built without labels; cannot add them now")
        else:
            lab = None
            if self.labels is not None:
                raise DataError("the index has labels; pass labels for the new embeddings too")
        keys = np.arange(self._next_key, self._next_key + n, dtype=np.int64)
        if ids is None:
            new_ids = keys.astype(str)
        else:
            new_ids = np.asarray(ids).astype(str)
            if new_ids.shape != (n,):
                raise ShapeError(f"ids must be ({n},), got {new_ids.shape}")
        if len(np.unique(new_ids)) != n:
            raise DataError("ids must be unique; the new ids repeat some values")
        table = self._positions() if len(self) else {}
        clash = [i for i in new_ids.tolist() if i in table]
        if clash:
            raise DataError(f"{len(clash)} id(s) are already in the index, e.g. {clash[0]!r}: remove them first")
        if metadata is not None:
            meta = list(metadata)
            if len(meta) != n:
                raise ShapeError(f"metadata must have {n} entries, got {len(meta)}")
            if self.metadata is None and not first:
                raise DataError("the index was built without metadata; cannot add it now")
            for m in meta:
                if m is not None and not isinstance(m, dict):
                    raise DataError(f"each metadata entry must be a dict or None, got {type(m).__name__}")
        else:
            meta = None
            if self.metadata is not None:
                meta = [None] * n

        if self.kind != "flat":
            if self._faiss_index is None:
                self._faiss_index = self._new_faiss_index(emb, keys)
            self._faiss_index.add_with_ids(self._prepare(emb), keys)
        self.embeddings = emb if first else np.concatenate([self.embeddings, emb])
        self._keys = keys if first else np.concatenate([self._keys, keys])
        self.ids = new_ids if first else np.concatenate([self.ids, new_ids])
        if lab is not None:
            self.labels = lab if self.labels is None else np.concatenate([self.labels, lab])
        if meta is not None:
            self.metadata = meta if self.metadata is None else self.metadata + meta
        self._next_key += n
        self._id_pos = None
        self._norm_cache = None
        if self.recall is not None:
            self.recall["stale"] = True
        return new_ids

    def remove(self, ids: Sequence[str] | np.ndarray) -> int:
        """Remove the items with these ids; returns how many were removed.

        Unknown ids raise :class:`DataError`. IVF indexes delete in place; an HNSW graph
        cannot delete, so it is rebuilt from the remaining vectors.
        """
        wanted = np.asarray(ids).astype(str).reshape(-1)
        pos = self.positions(wanted)
        keep = np.ones(len(self), dtype=bool)
        keep[pos] = False
        removed_keys = self._keys[pos]
        self.embeddings = self.embeddings[keep]
        self._keys = self._keys[keep]
        self.ids = self.ids[keep]
        if self.labels is not None:
            self.labels = self.labels[keep]
        if self.metadata is not None:
            self.metadata = [m for m, k in zip(self.metadata, keep) if k]
        self._id_pos = None
        self._norm_cache = None
        if self.kind in ("ivf_flat", "ivf_pq"):
            faiss = _faiss()
            index = self._faiss_index
            if self.params["gpu"]:
                index = faiss.index_gpu_to_cpu(index)
            index.remove_ids(faiss.IDSelectorBatch(removed_keys))
            self._faiss_index = self._maybe_gpu(index)
        elif self.kind == "hnsw":
            self._faiss_index = self._new_faiss_index(self.embeddings, self._keys) if len(self) else None
            if len(self):
                self._faiss_index.add_with_ids(self._prepare(self.embeddings), self._keys)
        if self.recall is not None:
            self.recall["stale"] = True
        return int(pos.size)

    def _positions(self) -> dict[str, int]:
        if self._id_pos is None:
            self._id_pos = {s: i for i, s in enumerate(self.ids.tolist())}
        return self._id_pos

    def positions(self, ids: Sequence[str] | np.ndarray) -> np.ndarray:
        """Row positions of these ids; unknown ids raise :class:`DataError`."""
        table = self._positions()
        out = np.empty(len(ids), dtype=np.int64)
        for j, s in enumerate(np.asarray(ids).astype(str).tolist()):
            p = table.get(s)
            if p is None:
                raise DataError(f"id {s!r} is not in the index ({len(self)} items); check the id or rebuild the index")
            out[j] = p
        return out

    def get(self, ids: Sequence[str] | np.ndarray) -> np.ndarray:
        """The stored embeddings of these ids, ``(len(ids), D)``."""
        return self.embeddings[self.positions(ids)]

    # -- faiss plumbing ------------------------------------------------------------------------
    def _prepare(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._unit:
            x = _normalize_rows(x)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _metric(self) -> int:
        faiss = _faiss()
        return faiss.METRIC_L2 if self.distance == "euclidean" else faiss.METRIC_INNER_PRODUCT

    def _maybe_gpu(self, index: Any) -> Any:
        if not self.params["gpu"]:
            return index
        faiss = _faiss()
        if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
            raise DependencyError("gpu=True needs faiss with GPU support and a visible GPU: "
                                  "install faiss-gpu (conda) or build without --gpu")
        if not hasattr(self, "_gpu_res"):
            self._gpu_res = faiss.StandardGpuResources()
        return faiss.index_cpu_to_gpu(self._gpu_res, 0, index)

    def _new_faiss_index(self, emb: np.ndarray, keys: np.ndarray) -> Any:
        """A trained, empty faiss index for this kind (IVF kinds train on a sample of ``emb``)."""
        faiss = _faiss()
        d, n = emb.shape[1], emb.shape[0]
        p = self.params
        if self.kind == "hnsw":
            inner = faiss.IndexHNSWFlat(d, p["hnsw_m"], self._metric())
            inner.hnsw.efConstruction = p["ef_construction"]
            index = faiss.IndexIDMap2(inner)  # faiss's wrapper keeps `inner` referenced
            self._trained_keys = np.empty((0,), dtype=np.int64)
            return index
        # keep up to recall_queries rows (at most 10 %) out of the training: the recall sample
        reserve = min(self._recall_reserve, n // 10)
        if p["nlist"] and p["nlist"] * 39 > n - reserve:
            reserve = 0
        nlist = p["nlist"] or _default_nlist(n - reserve)
        if nlist > n:
            raise ConfigError(f"nlist={nlist} is larger than the {n} vectors to train on: use nlist <= {n}")
        p["nlist"] = int(nlist)
        quantizer = faiss.IndexFlatL2(d) if self.distance == "euclidean" else faiss.IndexFlatIP(d)
        if self.kind == "ivf_flat":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, self._metric())
            min_train = nlist * 256
        else:
            m = p["pq_m"] or _default_pq_m(d)
            if d % m:
                raise ConfigError(f"pq_m={m} must divide the embedding size {d}")
            nbits = min(p["pq_nbits"], max(1, int(math.log2(max(2, (n - reserve) // 39)))))
            p["pq_m"], p["pq_nbits"] = int(m), int(nbits)
            index = faiss.IndexIVFPQ(quantizer, d, nlist, m, nbits, self._metric())
            min_train = max(nlist * 256, 2**nbits * 256)
            index.pq.cp.seed = p["seed"]
        index.cp.seed = p["seed"]
        rng = np.random.default_rng(p["seed"])
        pool = rng.permutation(n)[reserve:]
        rows = np.sort(pool[:min(len(pool), min_train)])
        index.train(self._prepare(emb[rows]))
        self._trained_keys = keys[rows]
        if p["nprobe"] is None:
            p["nprobe"] = min(nlist, 8)
        return self._maybe_gpu(index)

    def _search_params(self, setting: dict[str, Any]) -> Any:
        key = tuple(sorted(setting.items()))
        cached = self.__dict__.setdefault("_params_cache", {})
        if key not in cached:
            cached[key] = self._new_search_params(setting)
        return cached[key]

    def _new_search_params(self, setting: dict[str, Any]) -> Any:
        faiss = _faiss()
        if self.kind == "hnsw":
            return faiss.SearchParametersHNSW(efSearch=int(setting["ef_search"]))
        return faiss.SearchParametersIVF(nprobe=int(setting["nprobe"]))

    def _setting(self) -> dict[str, Any]:
        p = self.params
        if self.kind == "hnsw":
            return {"ef_search": p["ef_search"]}
        if self.kind == "ivf_flat":
            return {"nprobe": p["nprobe"]}
        if self.kind == "ivf_pq":
            return {"nprobe": p["nprobe"], "rerank": p["rerank"]}
        return {}

    def _row_factors(self) -> tuple[np.ndarray, np.ndarray]:
        """Cached ``(|x|^2 float64, factor float32)`` per row: ``1/|x|`` for unit distances, else ``|x|^2/2``."""
        if self._norm_cache is None:
            x = self.embeddings
            sq64 = np.einsum("ij,ij->i", x, x, dtype=np.float64)
            if self._unit:
                factor = (1 / np.sqrt(np.maximum(sq64, 1e-300))).astype(np.float32)
            else:
                factor = (sq64 / 2).astype(np.float32)
            self._norm_cache = (sq64, factor)
        return self._norm_cache

    def _exact_scores(self, q: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Exact scores of queries ``q (Q, D)`` against rows ``pos (Q, C)`` (``-1`` ignored)."""
        safe = np.maximum(pos, 0)
        cand = self.embeddings[safe]  # (Q, C, D)
        sq, factor = self._row_factors()
        if self._unit:
            cos = np.matmul(cand, _normalize_rows(q)[:, :, None])[..., 0] * factor[safe]
            s = np.sqrt(np.maximum(2 - 2 * cos, 0)) if self.distance == "euclidean" else cos
        elif self.distance == "euclidean":
            dots = np.matmul(cand, q[:, :, None])[..., 0]
            s = np.sqrt(np.maximum(sq[safe] - 2 * dots + (q.astype(np.float64) ** 2).sum(1)[:, None], 0))
        else:
            s = np.matmul(cand, q[:, :, None])[..., 0]
        s = s.astype(np.float32)
        s[pos < 0] = np.inf if self.distance == "euclidean" else -np.inf
        return s

    def _ann(self, q: np.ndarray, k: int, setting: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Approximate ``(positions, scores)`` of the ``k`` nearest, ``-1`` where none."""
        k_search = k * int(setting.get("rerank", 1)) if self.kind == "ivf_pq" else k
        k_search = min(k_search, len(self))
        dist, keys = self._faiss_index.search(self._prepare(q), k_search, params=self._search_params(setting))
        found = keys >= 0
        pos = np.where(found, np.searchsorted(self._keys, np.where(found, keys, 0)), -1)
        if self.kind == "ivf_pq":  # exact re-ranking of the candidates on the stored vectors
            scores = self._exact_scores(q, pos)
            order = np.argsort(-scores if self.higher_is_closer else scores, axis=1, kind="stable")[:, :k]
            pos = np.take_along_axis(pos, order, axis=1)
            scores = np.take_along_axis(scores, order, axis=1)
        elif self.distance == "euclidean":
            scores = np.sqrt(np.maximum(dist, 0.0))
        else:
            scores = dist
        bad = pos < 0
        if bad.any():
            scores = scores.astype(np.float32, copy=True)
            scores[bad] = np.nan
        if pos.shape[1] < k:  # fewer references than k
            pad = k - pos.shape[1]
            pos = np.pad(pos, ((0, 0), (0, pad)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=np.nan)
        return pos.astype(np.int64), scores.astype(np.float32)

    def _exact(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact ``(positions, scores)``: one matmul for small query batches, else the blockwise kNN."""
        if q.shape[0] * len(self) <= _SMALL_EXACT:
            return self._exact_small(q, min(k, len(self)))
        from dmlkit.metrics import knn  # lazy: numba kernels load only when an exact search runs

        dist = get_distance(self.distance, normalize_embeddings=self._unit)
        res = knn(q, self.embeddings, k=min(k, len(self)), distance=dist, exclude_self=False)
        return res.indices.numpy().astype(np.int64), res.values.numpy().astype(np.float32)

    def _exact_small(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k of a few queries: float32 scores pick ``2k + 16`` candidates, float64
        scores order them, ties by row (as :func:`dmlkit.metrics.knn`)."""
        x = self.embeddings
        sq, factor = self._row_factors()
        s = q @ x.T
        if self._unit:  # <q, x / |x|> orders like cosine and like -|q/|q| - x/|x||
            s *= factor
        elif self.distance == "euclidean":
            s -= factor  # <q, x> - |x|^2 / 2 orders like -|q - x|^2
        m = x.shape[0]
        c = min(m, 2 * k + 16)
        cand = np.argpartition(s, m - c, axis=1)[:, m - c:] if c < m else np.tile(np.arange(m), (q.shape[0], 1))
        xv = x[cand].astype(np.float64)  # (Q, c, D)
        q64 = q.astype(np.float64)[:, None, :]
        if self._unit:
            xv /= np.sqrt(np.maximum(sq[cand], 1e-300))[..., None]
            q64 /= np.sqrt(np.maximum((q64**2).sum(-1, keepdims=True), 1e-300))
        if self.distance == "euclidean":
            score = -np.sqrt(((xv - q64) ** 2).sum(-1))
        else:
            score = (xv * q64).sum(-1)
        order = np.lexsort((cand, -score), axis=1)[:, :k]
        pos = np.take_along_axis(cand, order, axis=1).astype(np.int64)
        val = np.take_along_axis(score, order, axis=1)
        return pos, (-val if self.distance == "euclidean" else val).astype(np.float32)

    # -- search --------------------------------------------------------------------------------
    def search(self, queries: Any, k: int = 10, *, exclude_ids: Sequence[str] | None = None,
               exact: bool = False) -> SearchResult:
        """The ``k`` nearest references of each query, closest first.

        Args:
            queries: ``(Q, D)`` or ``(D,)`` embeddings.
            k: neighbours per query (capped at the index size).
            exclude_ids: one id per query whose item is dropped from that query's results
                (query-by-example on indexed items: ``exclude_ids=ids`` skips the item itself).
            exact: force exact search on an approximate index.
        """
        q = _to_numpy_embeddings(queries[None] if getattr(queries, "ndim", 2) == 1 else queries, "queries")
        if q.shape[1] != self.dim:
            raise ShapeError(f"queries must be (Q, {self.dim}), got shape {q.shape}")
        if not isinstance(k, int | np.integer) or k < 1:
            raise ConfigError(f"k must be a positive integer, got {k!r}")
        if len(self) == 0:
            raise DataError("the index is empty: add embeddings first")
        extra = 0
        if exclude_ids is not None:
            exclude = np.asarray(exclude_ids).astype(str)
            if exclude.shape != (q.shape[0],):
                raise ShapeError(f"exclude_ids must hold one id per query ({q.shape[0]}), got {exclude.shape}")
            extra = 1
        k_eff = min(k + extra, len(self))
        if self.kind == "flat" or exact:
            pos, scores = self._exact(q, k_eff)
        else:
            pos, scores = self._ann(q, k_eff, self._setting())
        if exclude_ids is not None:
            k_out = min(k, len(self) - 1) if len(self) > 1 else 1
            drop = np.zeros(pos.shape, dtype=bool)
            valid = pos >= 0
            drop[valid] = self.ids[pos[valid]] == np.broadcast_to(exclude[:, None], pos.shape)[valid]
            # keep the first k_out entries that are not dropped (stable)
            order = np.argsort(drop, axis=1, kind="stable")[:, :k_out]
            pos = np.take_along_axis(pos, order, axis=1)
            scores = np.take_along_axis(scores, order, axis=1)
            dropped_kept = np.take_along_axis(drop, order, axis=1)
            pos = np.where(dropped_kept, -1, pos)
        else:
            pos, scores = pos[:, :k], scores[:, :k]
        safe = np.maximum(pos, 0)
        labels = None if self.labels is None else np.where(pos >= 0, self.labels[safe], -1)
        ids = np.where(pos >= 0, self.ids[safe], "")
        meta = None
        if self.metadata is not None:
            meta = [[self.metadata[i] if i >= 0 else None for i in row] for row in pos.tolist()]
        return SearchResult(indices=pos, scores=scores, labels=labels, ids=ids,
                            higher_is_closer=self.higher_is_closer, metadata=meta)

    def classify(self, queries: Any, k: int = 1) -> np.ndarray:
        """kNN classification: the majority label of the ``k`` nearest (ties: the nearest's)."""
        if self.labels is None:
            raise DataError("this index has no labels: build it with labels to classify")
        res = self.search(queries, k)
        out = np.empty(res.labels.shape[0], dtype=np.int64)
        for q, row in enumerate(res.labels):
            row = row[row >= 0] if (row >= 0).any() else row
            values, counts = np.unique(row, return_counts=True)
            best = values[counts == counts.max()]
            out[q] = next(lab for lab in row if lab in best)  # nearest among the tied majority
        return out

    # -- recall --------------------------------------------------------------------------------
    def _recall_sample(self, num_queries: int, seed: int) -> np.ndarray:
        """Rows for the recall measurement, preferring rows the quantiser was not trained on."""
        rng = np.random.default_rng(seed + 1)
        held = np.flatnonzero(~np.isin(self._keys, self._trained_keys)) if self._trained_keys.size else np.arange(len(self))
        pool = held if held.size >= min(num_queries, len(self)) else np.arange(len(self))
        take = min(num_queries, pool.size)
        return np.sort(rng.choice(pool, size=take, replace=False))

    def _recall_setup(self, k: int, queries: Any, num_queries: int):
        if self.kind == "flat":
            raise ConfigError("a flat index is exact (recall 1.0): measure or tune an approximate kind")
        if len(self) < 2:
            raise DataError("need at least two indexed items to measure recall")
        if queries is None:
            rows = self._recall_sample(num_queries, self.params["seed"])
            q = self.embeddings[rows]
            k = min(k, len(self) - 1)
            exact, _ = self._exact(q, k + 1)
            exact = _drop_self(exact, rows, k)
            self._held_out = not bool(np.isin(self._keys[rows], self._trained_keys).any())
            return q, exact, rows, k
        self._held_out = True
        q = _to_numpy_embeddings(queries, "queries")
        k = min(k, len(self))
        exact, _ = self._exact(q, k)
        return q, exact, None, k

    def _recall_of(self, q: np.ndarray, exact: np.ndarray, rows: np.ndarray | None, k: int,
                   setting: dict[str, Any]) -> tuple[float, float]:
        t0 = time.perf_counter()
        approx, _ = self._ann(q, k + (rows is not None), setting)
        seconds = time.perf_counter() - t0
        if rows is not None:
            approx = _drop_self(approx, rows, k)
        return recall_at_k(approx, exact, k), seconds / max(1, q.shape[0])

    def measure_recall(self, k: int = 10, queries: Any = None, num_queries: int = 1000) -> dict[str, Any]:
        """Measure recall@k of the current settings against exact search and store it.

        ``queries=None`` samples ``num_queries`` indexed rows (held out from the quantiser's
        training where possible) and excludes each query's own row from both result lists.
        """
        q, exact, rows, k = self._recall_setup(k, queries, num_queries)
        setting = self._setting()
        recall, per_query = self._recall_of(q, exact, rows, k, setting)
        self.recall = {"k": k, "recall": recall, "num_queries": int(q.shape[0]), "held_out": self._held_out,
                       "setting": setting,
                       "seconds_per_query": per_query, "target": None, "met": None, "stale": False}
        return self.recall

    def _candidates(self, k: int) -> list[tuple[float, dict[str, Any]]]:
        """Search settings with their cost (bytes scanned per query), cheapest first."""
        n, d = max(1, len(self)), self.dim
        if self.kind == "hnsw":
            out = [(float(ef), {"ef_search": ef}) for ef in _EF_VALUES if ef >= k + 1]
            if not out or out[-1][1]["ef_search"] < n:
                out.append((float(max(n, k + 1)), {"ef_search": max(n, k + 1)}))
            return out
        nlist = int(self.params["nlist"])
        probes = sorted({min(nlist, 2**i) for i in range(int(math.log2(nlist)) + 2)})
        out = []
        for nprobe in probes:
            cell = nprobe * n / nlist
            if self.kind == "ivf_flat":
                out.append((cell * d * 4, {"nprobe": nprobe}))
            else:
                for r in _RERANK_FACTORS:
                    out.append((cell * self.params["pq_m"] * self.params["pq_nbits"] / 8 + r * k * d * 4,
                                {"nprobe": nprobe, "rerank": r}))
        return sorted(out, key=lambda t: t[0])

    def tune(self, target_recall: float = 0.95, k: int = 10, queries: Any = None,
             num_queries: int = 1000) -> dict[str, Any]:
        """Set the cheapest search setting whose measured recall@k reaches ``target_recall``.

        Settings are tried in order of cost (bytes scanned per query: ``nprobe`` cells of codes
        or vectors plus ``rerank * k`` re-scored vectors; ``ef_search`` for HNSW). When none
        reaches the target the most accurate one is kept and ``recall["met"]`` is ``False``.
        """
        if not 0 < target_recall <= 1:
            raise ConfigError(f"target_recall must be in (0, 1], got {target_recall}")
        q, exact, rows, k = self._recall_setup(k, queries, num_queries)
        tried = []
        chosen = None
        for cost, setting in self._candidates(k):
            recall, per_query = self._recall_of(q, exact, rows, k, setting)
            tried.append({"setting": setting, "recall": recall, "cost": cost, "seconds_per_query": per_query})
            if recall >= target_recall:
                chosen = tried[-1]
                break
        met = chosen is not None
        if chosen is None:
            chosen = max(tried, key=lambda t: (t["recall"], -t["cost"]))
        self.params.update(chosen["setting"])
        self.recall = {"k": k, "recall": chosen["recall"], "num_queries": int(q.shape[0]), "held_out": self._held_out,
                       "setting": chosen["setting"], "seconds_per_query": chosen["seconds_per_query"],
                       "target": target_recall, "met": met, "tried": tried, "stale": False}
        return self.recall

    # -- persistence (apps/index_files.py) -------------------------------------------------------
    def _faiss_bytes(self) -> np.ndarray | None:
        if self._faiss_index is None:
            return None
        faiss = _faiss()
        index = faiss.index_gpu_to_cpu(self._faiss_index) if self.params["gpu"] else self._faiss_index
        return faiss.serialize_index(index)

    def index_bytes(self) -> int:
        """Bytes of the faiss structure (0 for ``flat``); the float32 vectors are ``len * dim * 4`` more."""
        blob = self._faiss_bytes()
        return 0 if blob is None else int(blob.nbytes)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the index (a directory, or one ``.npz``): :func:`dmlkit.apps.index_files.save_index`."""
        return save_index(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, mmap: bool = False) -> EmbeddingIndex:
        """Read an index written by :meth:`save`: :func:`dmlkit.apps.index_files.load_index`."""
        return load_index(cls, path, mmap=mmap)


def _drop_self(found: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Drop each query's own row from its neighbour list and keep ``k`` entries."""
    is_self = found == rows[:, None]
    order = np.argsort(is_self, axis=1, kind="stable")[:, :k]
    out = np.take_along_axis(found, order, axis=1)
    return np.where(np.take_along_axis(is_self, order, axis=1), -1, out)
