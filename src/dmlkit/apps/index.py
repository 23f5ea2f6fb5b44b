"""An embedding index: exact or approximate nearest-neighbour search with measured recall.

Kinds (``EmbeddingIndex(kind=...)``):

* ``flat``: exact search (:func:`dmlkit.apps.index_exact.exact_search`: faiss's brute-force
  scan picks candidates, float64 scores order them, ties by reference order), so the index
  returns the same neighbours as :func:`dmlkit.metrics.knn`.
* ``ivf_flat``: faiss ``IndexIVFFlat``, an inverted file over k-means cells (Jegou et al.,
  "Product quantization for nearest neighbor search", TPAMI 2011, sec. IV); a query scans the
  ``nprobe`` nearest cells exactly.
* ``ivf_pq``: faiss ``IndexIVFPQ``, the same inverted file with product-quantised residual codes
  (Jegou et al. 2011); the ``rerank * k`` best candidates are re-scored exactly against the
  stored float32 vectors ("re-ranking with source coding", Jegou et al., ICASSP 2011).
* ``hnsw``: faiss ``IndexHNSWFlat``, a hierarchical navigable small-world graph (Malkov and
  Yashunin, TPAMI 2020); a query explores ``ef_search`` candidates.

Every approximate index measures its recall@k at build time against the exact search on a
sample of held-out queries, and ``target_recall`` tunes ``nprobe`` / ``rerank`` / ``ef_search``
to the cheapest setting that reaches it (:mod:`dmlkit.apps.index_tuning`). Exact scoring on the
stored vectors (the flat search, IVF-PQ's re-ranking) is :mod:`dmlkit.apps.index_exact`, the
faiss structures :mod:`dmlkit.apps.index_faiss`, the files :mod:`dmlkit.apps.index_files`.

The float32 vectors are always kept beside the faiss structure: they are the source of truth
for exact recall measurement, re-ranking, removal (HNSW graphs cannot delete: the graph is
rebuilt) and save/load.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.apps import index_tuning
from dmlkit.apps.index_exact import (
    InverseNorms,
    RowNorms,
    candidate_scores,
    exact_search,
    first_kept,
    row_norms,
)
from dmlkit.apps.index_exact import to_numpy_embeddings as _to_numpy_embeddings
from dmlkit.apps.index_faiss import (
    add_to_structure,
    flush_graph_reserve,
    new_faiss_index,
    refuse_unused_settings,
    rows_of_keys,
    search_params,
    to_gpu,
)
from dmlkit.apps.index_faiss import faiss_module as _faiss
from dmlkit.apps.index_files import item_ids, load_index, save_index
from dmlkit.apps.index_labels import SearchResult, encode_labels
from dmlkit.apps.index_tuning import recall_at_k
from dmlkit.distances import get_distance
from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.validation import check_integer, check_seed, normalize_rows

__all__ = ["INDEX_KINDS", "EmbeddingIndex", "SearchResult", "item_ids", "recall_at_k"]

INDEX_KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw")


@dataclass(frozen=True)
class _Block:
    """A checked, encoded block of :meth:`EmbeddingIndex.add`, not yet in the stored arrays."""

    embeddings: np.ndarray
    keys: np.ndarray
    ids: np.ndarray
    labels: np.ndarray | None
    metadata: list[dict[str, Any] | None] | None
    class_names: np.ndarray | None  # the index's class names once this block is in


class EmbeddingIndex:
    """Reference embeddings with ids, labels and metadata, searchable exactly or approximately.

    Args:
        embeddings: ``(M, D)`` reference embeddings (numpy or torch); ``None`` with ``dim``
            for an empty index that is filled with :meth:`add`.
        labels: optional ``(M,)`` integer labels or class-name strings (for :meth:`classify`
            and the results); names are stored as codes into ``class_names``
            (:mod:`dmlkit.apps.index_labels`), and results and :meth:`classify` report names.
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
        seed: seed of the k-means training and of the recall sample, 0 to 2**31 - 1 (faiss keeps
            it in a C int).
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
        if target_recall is not None:
            index_tuning.check_target_recall(target_recall)
            if kind == "flat":  # exact: the target was silently ignored (the CLI refuses it alike)
                raise ConfigError("target_recall does not apply to flat indexes (exact search, recall 1.0): "
                                  "leave it out, or pick an approximate kind (ivf_flat, ivf_pq, hnsw)")
        # whole numbers (nprobe=1.7 was reported while faiss scanned 1 cell, hnsw_m=2.9 built M = 2)
        pq_nbits, hnsw_m, ef_construction, rerank, ef_search = (
            check_integer(value, name) for name, value in (
                ("pq_nbits", pq_nbits), ("hnsw_m", hnsw_m), ("ef_construction", ef_construction),
                ("rerank", rerank), ("ef_search", ef_search)))
        nlist, pq_m, nprobe = (None if value is None else check_integer(value, name)  # None: the default
                               for name, value in (("nlist", nlist), ("pq_m", pq_m), ("nprobe", nprobe)))
        recall_k, recall_queries = index_tuning.check_recall_settings(recall_k, recall_queries)
        self.distance = distance
        self.kind = kind
        self.normalize = bool(normalize)
        self._recall_reserve = recall_queries
        self._unit = distance == "cosine" or self.normalize
        self.params: dict[str, Any] = {
            "nlist": nlist, "pq_m": pq_m, "pq_nbits": pq_nbits, "hnsw_m": hnsw_m,
            "ef_construction": ef_construction, "nprobe": nprobe, "rerank": rerank,
            "ef_search": ef_search, "gpu": bool(gpu),
            "seed": check_seed(seed, "seed", bits=31),  # faiss keeps it in a C int
        }
        refuse_unused_settings(kind, self.params)
        self.recall: dict[str, Any] | None = None
        self.info: dict[str, Any] = dict(info or {})
        self.embeddings = np.empty((0, 0 if dim is None else check_integer(dim, "dim")), dtype=np.float32)
        self.labels: np.ndarray | None = None
        self.class_names: np.ndarray | None = None  # names of the label codes (string labels)
        self.ids = np.empty((0,), dtype=str)
        self.metadata: list[dict[str, Any] | None] | None = None
        self._keys = np.empty((0,), dtype=np.int64)
        self._next_key = 0
        self._faiss_index: Any = None
        self._trained_keys = np.empty((0,), dtype=np.int64)
        self._graph_reserve = np.empty((0,), dtype=np.int64)  # HNSW rows kept out of the graph
        self._graph_lock = threading.Lock()  # held while a search inserts them (index_faiss)
        self._planned_rows = 0  # rows add_blocks is adding: an IVF trained on its first block sizes its cells for all
        self._id_pos: dict[str, int] | None = None
        self._norm_cache: RowNorms | None = None
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
        block = self._encode_block(embeddings, labels, ids, metadata, [], set())
        self._commit([block])
        return block.ids

    def add_blocks(self, source: Any, labels: Any = None, ids: Any = None, rows: int = 65536) -> int:
        """:meth:`add` an ``(N, D)`` source read ``rows`` at a time (a shard directory's
        :class:`~dmlkit.embedding_shards.ShardedEmbeddings`, an ``np.memmap``), so it is never
        copied whole; labels and ids default to the source's own. Returns N.

        Each block is checked and encoded into the faiss structure as it is read (an IVF has cells
        for all N); the stored arrays grow once at the end (one :meth:`add` per block copied them
        per block, O(N^2 / rows)). Blocks read before a bad one stay added, as with :meth:`add`."""
        labels = getattr(source, "labels", None) if labels is None else labels
        ids = getattr(source, "ids", None) if ids is None else ids
        step = max(1, int(rows))
        pending: list[_Block] = []
        pending_ids: set[str] = set()
        self._planned_rows = len(self) + len(source)
        try:
            for a0 in range(0, len(source), step):
                a1 = min(len(source), a0 + step)
                block = self._encode_block(source[a0:a1], None if labels is None else labels[a0:a1],
                                           None if ids is None else ids[a0:a1], None, pending, pending_ids)
                pending.append(block)
                if ids is not None:
                    pending_ids.update(block.ids.tolist())
        finally:
            self._planned_rows = 0
            if pending:
                self._commit(pending)
        return len(source)

    def _encode_block(self, embeddings: Any, labels: Any, ids: Any,
                      metadata: Sequence[dict[str, Any] | None] | None,
                      pending: list[_Block], pending_ids: set[str]) -> _Block:
        """Check one block against the index (and the ``pending`` blocks not yet committed),
        give it keys and ids, and add it to the faiss structure (training an IVF on the first)."""
        emb = _to_numpy_embeddings(embeddings, "embeddings")
        n = emb.shape[0]
        dim = pending[0].embeddings.shape[1] if pending else self.dim
        if dim and emb.shape[1] != dim:
            raise ShapeError(f"the index holds {dim}-d embeddings, got {emb.shape[1]}-d")
        first = len(self) == 0 and not pending
        has_labels = pending[0].labels is not None if pending else self.labels is not None
        names = pending[-1].class_names if pending else self.class_names
        lab, names = encode_labels(labels, n, names, has_labels, first)
        next_key = self._next_key + sum(b.keys.size for b in pending)
        keys = np.arange(next_key, next_key + n, dtype=np.int64)
        if ids is None:
            new_ids = keys.astype(str)
        else:
            new_ids = np.asarray(ids).astype(str)
            if new_ids.shape != (n,):
                raise ShapeError(f"ids must be ({n},), got {new_ids.shape}")
            if len(np.unique(new_ids)) != n:  # default ids (running keys) are unique by construction
                raise DataError("ids must be unique; the new ids repeat some values")
        table = self._positions() if len(self) else {}
        clash = [i for i in new_ids.tolist() if i in table or i in pending_ids] if table or pending_ids else []
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
            add_to_structure(self, emb, keys)
        return _Block(emb, keys, new_ids, lab, meta, names)

    def _commit(self, blocks: list[_Block]) -> None:
        """Append encoded blocks to the stored arrays, one concatenation each."""
        first = len(self) == 0
        parts = lambda name: [getattr(b, name) for b in blocks]  # noqa: E731
        self.embeddings = np.concatenate(([] if first else [self.embeddings]) + parts("embeddings"))
        self._keys = np.concatenate(([] if first else [self._keys]) + parts("keys"))
        self.ids = np.concatenate(([] if first else [self.ids]) + parts("ids"))
        if blocks[0].labels is not None:
            self.labels = np.concatenate(([] if self.labels is None else [self.labels]) + parts("labels"))
            self.class_names = blocks[-1].class_names
        if blocks[0].metadata is not None:
            self.metadata = (self.metadata or []) + [m for b in blocks for m in b.metadata]
        self._next_key += sum(b.keys.size for b in blocks)
        self._id_pos, self._norm_cache = None, None
        if self.recall is not None:
            self.recall["stale"] = True

    def remove(self, ids: Sequence[str] | np.ndarray) -> int:
        """Remove the items with these ids; returns how many were removed.

        Unknown ids raise :class:`DataError`. IVF indexes delete in place; an HNSW graph
        cannot delete, so it is rebuilt from the remaining vectors.
        """
        wanted = np.asarray(ids).astype(str).reshape(-1)
        pos = np.unique(self.positions(wanted))  # an id given twice is one item removed
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
        self._id_pos, self._norm_cache = None, None
        if self.kind in ("ivf_flat", "ivf_pq"):
            faiss = _faiss()
            index = self._faiss_index
            if self.params["gpu"]:
                index = faiss.index_gpu_to_cpu(index)
            index.remove_ids(faiss.IDSelectorBatch(removed_keys))
            self._faiss_index = to_gpu(self, index)
        elif self.kind == "hnsw":
            self._graph_reserve = np.empty((0,), dtype=np.int64)  # the rebuilt graph holds every row
            self._faiss_index = new_faiss_index(self, self.embeddings, self._keys) if len(self) else None
            if len(self):
                self._faiss_index.add_with_ids(self._prepare(self.embeddings), self._keys)
        if self.recall is not None:
            self.recall["stale"] = True
        return int(pos.size)

    def _positions(self) -> dict[str, int]:
        """``{id: row}``, built once; ids that repeat (a damaged or hand-edited saved index: the
        table kept the last row, and an id found another item's neighbours) are a DataError."""
        if self._id_pos is None:
            table = {s: i for i, s in enumerate(self.ids.tolist())}
            if len(table) != len(self.ids):
                seen: set[str] = set()
                repeated = next(s for s in self.ids.tolist() if s in seen or seen.add(s))
                raise DataError(f"the index is corrupt: {len(self.ids) - len(table)} ids name more than one "
                                f"item (e.g. {repeated!r}): rebuild it")
            self._id_pos = table
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
        return normalize_rows(x) if self._unit else x

    def _search_params(self, setting: dict[str, Any]) -> Any:
        key = tuple(sorted(setting.items()))
        cached = self.__dict__.setdefault("_params_cache", {})
        if key not in cached:
            cached[key] = search_params(self.kind, setting)
        return cached[key]

    def _setting(self) -> dict[str, Any]:
        p = self.params
        if self.kind == "hnsw":
            return {"ef_search": p["ef_search"]}
        if self.kind == "ivf_flat":
            return {"nprobe": p["nprobe"]}
        if self.kind == "ivf_pq":
            return {"nprobe": p["nprobe"], "rerank": p["rerank"]}
        return {}

    def _inverse_norms(self) -> InverseNorms | None:
        """``1/|x|`` of the stored rows, filled as re-ranking asks (unit distances only)."""
        if not self._unit:
            return None
        cache = self.__dict__.get("_inverse_cache")
        if cache is None or cache.x is not self.embeddings:
            cache = self.__dict__["_inverse_cache"] = InverseNorms(self.embeddings)
        return cache

    def _row_norms(self) -> RowNorms:
        """Cached :class:`~dmlkit.apps.index_exact.RowNorms` of the stored vectors."""
        if self._norm_cache is None:
            self._norm_cache = row_norms(self.embeddings, self._unit)
        return self._norm_cache

    def _rows_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """Row positions of faiss keys, ``-1`` for none (:func:`~dmlkit.apps.index_faiss.rows_of_keys`)."""
        return rows_of_keys(self._keys, keys)

    def _ann(self, q: np.ndarray, k: int, setting: dict[str, Any], exclude: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """Approximate ``(positions, scores)`` of the ``k`` nearest, ``-1`` where none.

        ``exclude``: one row position per query (``-1``: none) searched as if it were not
        indexed (the recall measurement's held-in queries and their own rows): faiss is asked
        for one candidate more and the excluded row dropped, so each query keeps the same
        candidates an outside query gets (IVF-PQ: the ``rerank * k`` best codes besides it).
        """
        n = self.embeddings.shape[0]
        rerank = self.kind == "ivf_pq"
        width = k * int(setting["rerank"]) if rerank else k
        k_search = min(width + (exclude is not None), n)
        qp = self._prepare(q)
        dist, keys = self._faiss_index.search(qp, k_search, params=self._search_params(setting))
        pos = self._rows_of_keys(keys)
        if exclude is not None:  # the first `width` candidates that are not the excluded row
            order, gone = first_kept((pos == np.asarray(exclude)[:, None]) & (pos >= 0), min(width, k_search))
            pos = np.where(gone, -1, np.take_along_axis(pos, order, axis=1))
            dist = np.take_along_axis(dist, order, axis=1)
        if rerank:  # exact re-ranking of the candidates on the stored vectors
            scores = candidate_scores(self.embeddings, q, pos, self.distance, self._unit, self._inverse_norms(),
                                      q_unit=qp if self._unit else None)
        else:
            scores = np.sqrt(np.maximum(dist, 0.0)) if self.distance == "euclidean" else dist
        # by (score, row) as the flat search and the metrics order ties (faiss's own order put an
        # exact duplicate's later row first); rows not found last
        key = np.where(pos < 0, np.inf, -scores if self.higher_is_closer else scores)
        order = np.lexsort((pos, key), axis=1)[:, :k]
        pos, scores = np.take_along_axis(pos, order, axis=1), np.take_along_axis(scores, order, axis=1)
        if pos.min() < 0:  # faiss found fewer than k: NaN scores there
            scores = np.where(pos < 0, np.float32(np.nan), scores.astype(np.float32))
        if pos.shape[1] < k:  # fewer references than k
            pad = ((0, 0), (0, k - pos.shape[1]))
            pos, scores = np.pad(pos, pad, constant_values=-1), np.pad(scores, pad, constant_values=np.nan)
        return pos.astype(np.int64, copy=False), scores.astype(np.float32, copy=False)

    def _exact(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact ``(positions, scores)``: :func:`dmlkit.apps.index_exact.exact_search`."""
        return exact_search(self.embeddings, q, k, self.distance, self._unit, self._row_norms())

    # -- search --------------------------------------------------------------------------------
    def refuse_zero_queries(self, q: np.ndarray) -> None:
        """A :class:`DataError` naming the first all-zero query row when the index compares
        directions (cosine, or normalised embeddings): a zero vector has none, every item is as
        close as any other. :meth:`search`, :meth:`measure_recall` and :meth:`tune` check with it."""
        if self._unit and (zero := np.flatnonzero(~q.any(axis=1))).size:
            raise DataError(f"query row {zero[0]} is all zeros ({zero.size} such row(s)): a {self.distance} "
                            f"index{' of normalised embeddings' if self.normalize and self.distance != 'cosine' else ''} "
                            "compares directions, and a zero vector has none; send the query's embedding")

    def search(self, queries: Any, k: int = 10, *, exclude_ids: Sequence[str] | None = None,
               exact: bool = False) -> SearchResult:
        """The ``k`` nearest references of each query, closest first.

        Args:
            queries: ``(Q, D)`` or ``(D,)`` embeddings.
            k: neighbours per query (capped at the index size).
            exclude_ids: one id per query whose item is dropped from that query's results
                (query-by-example on indexed items: ``exclude_ids=ids`` skips the item itself);
                with ``k`` at least the index size, a query that dropped its item pads its last
                place with ``-1`` when another query's id is not indexed (that one keeps all).
            exact: force exact search on an approximate index.
        """
        q = _to_numpy_embeddings(queries[None] if getattr(queries, "ndim", 2) == 1 else queries, "queries")
        if q.shape[1] != self.dim:
            raise ShapeError(f"queries must be (Q, {self.dim}), got shape {q.shape}")
        k = check_integer(k, "k")  # an int: faiss's SWIG wrappers take Python ints only
        if len(self) == 0:
            raise DataError("the index is empty: add embeddings first")
        self.refuse_zero_queries(q)
        if exclude_ids is not None:
            exclude = np.asarray(exclude_ids).astype(str)
            if exclude.shape != (q.shape[0],):
                raise ShapeError(f"exclude_ids must hold one id per query ({q.shape[0]}), got {exclude.shape}")
        k_eff = min(k + (exclude_ids is not None), len(self))  # one more when the query's item drops out
        if self.kind == "flat" or exact:
            pos, scores = self._exact(q, k_eff)
        else:
            flush_graph_reserve(self)
            pos, scores = self._ann(q, k_eff, self._setting())
            short = (pos < 0).any(axis=1)  # fewer than k found (HNSW walk, small IVF cells): exact
            if short.any():
                pos[short], scores[short] = self._exact(q[short], k_eff)
        if exclude_ids is not None:
            # one fewer column only when every query drops an item (a query whose id is not
            # indexed keeps min(k, size) neighbours; the others pad with -1)
            k_out = k
            if k >= len(self):
                table = self._positions()
                every = all(e in table for e in exclude.tolist())
                k_out = max(1, len(self) - 1) if every else len(self)
            drop = np.zeros(pos.shape, dtype=bool)
            valid = pos >= 0
            drop[valid] = self.ids[pos[valid]] == np.broadcast_to(exclude[:, None], pos.shape)[valid]
            order, gone = first_kept(drop, k_out)  # the first k_out entries not dropped
            pos = np.where(gone, -1, np.take_along_axis(pos, order, axis=1))
            scores = np.where(gone, np.float32(np.nan), np.take_along_axis(scores, order, axis=1))
        else:
            pos, scores = pos[:, :k], scores[:, :k]
        if pos.size and pos.min() >= 0:  # the common case: every neighbour found
            labels = None if self.labels is None else self.labels[pos]
            ids = self.ids[pos]
        else:
            safe = np.maximum(pos, 0)
            labels = None if self.labels is None else np.where(pos >= 0, self.labels[safe], -1)
            ids = np.where(pos >= 0, self.ids[safe], "")
        meta = None
        if self.metadata is not None:
            meta = [[self.metadata[i] if i >= 0 else None for i in row] for row in pos.tolist()]
        return SearchResult(indices=pos, scores=scores, labels=labels, ids=ids,
                            higher_is_closer=self.higher_is_closer, metadata=meta, class_names=self.class_names)

    def classify(self, queries: Any, k: int = 1) -> np.ndarray:
        """kNN classification: the majority label of the ``k`` nearest (ties: the nearest's);
        class names for an index of class names."""
        if self.labels is None:
            raise DataError("this index has no labels: build it with labels to classify")
        res = self.search(queries, k)
        out = np.empty(res.labels.shape[0], dtype=np.int64)
        for q, (row, found) in enumerate(zip(res.labels, res.indices >= 0)):
            row = row[found] if found.any() else row  # found neighbours, whatever their labels (-1 too)
            values, counts = np.unique(row, return_counts=True)
            best = values[counts == counts.max()]
            out[q] = next(lab for lab in row if lab in best)  # nearest among the tied majority
        return out if self.class_names is None else self.class_names[out]

    # -- recall (apps/index_tuning.py) -----------------------------------------------------------
    def measure_recall(self, k: int = 10, queries: Any = None, num_queries: int = 1000) -> dict[str, Any]:
        """Measure recall@k of the current settings against exact search and store it.

        ``queries=None`` samples ``num_queries`` indexed rows the structure has not seen where
        possible (outside the quantiser's training, or held out of the HNSW graph until now)
        and drops each query's own row (:func:`dmlkit.apps.index_tuning.measure_recall`).
        """
        return index_tuning.measure_recall(self, k, queries, num_queries)

    def tune(self, target_recall: float = 0.95, k: int = 10, queries: Any = None,
             num_queries: int = 1000) -> dict[str, Any]:
        """Set the cheapest search setting whose measured recall@k reaches ``target_recall``.

        Settings are tried in order of cost (bytes scanned per query: ``nprobe`` cells of codes
        or vectors plus ``rerank * k`` re-scored vectors; ``ef_search`` for HNSW). When none
        reaches the target the most accurate one is kept and ``recall["met"]`` is ``False``
        (:func:`dmlkit.apps.index_tuning.tune`).
        """
        return index_tuning.tune(self, target_recall, k, queries, num_queries)

    # -- persistence (apps/index_files.py) -------------------------------------------------------
    def _faiss_bytes(self) -> np.ndarray | None:
        if self._faiss_index is None:
            return None
        flush_graph_reserve(self)
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

