"""An embedding index: store reference embeddings, query the nearest ones, classify by kNN.

Search is exact (:func:`dmlkit.metrics.knn`: blockwise matmul + top-k in bounded memory, ties by
reference order; faiss when installed), so the index returns the same neighbours as the metrics.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.exceptions import DataError, DataNotFoundError, ShapeError
from dmlkit.utils import atomic_write_bytes

__all__ = ["EmbeddingIndex", "SearchResult"]

_FORMAT = "dmlkit-index-v1"


@dataclass(frozen=True)
class SearchResult:
    """Neighbours of each query, closest first: ``(Q, k)`` arrays."""

    indices: np.ndarray
    scores: np.ndarray
    labels: np.ndarray | None
    ids: np.ndarray | None
    higher_is_closer: bool

    def to_records(self) -> list[list[dict[str, Any]]]:
        """One list per query of ``{"rank", "index", "score", "label", "id"}``."""
        out = []
        for q in range(self.indices.shape[0]):
            row = []
            for r, (i, s) in enumerate(zip(self.indices[q], self.scores[q])):
                rec: dict[str, Any] = {"rank": r + 1, "index": int(i), "score": float(s)}
                if self.labels is not None:
                    rec["label"] = int(self.labels[q, r])
                if self.ids is not None:
                    rec["id"] = str(self.ids[q, r])
                row.append(rec)
            out.append(row)
        return out


class EmbeddingIndex:
    """Reference embeddings (+ optional labels and string ids) that can be searched.

    Args:
        embeddings: ``(M, D)`` reference embeddings.
        labels: optional ``(M,)`` integer labels (for :meth:`classify`).
        ids: optional ``(M,)`` identifiers (file paths, product ids, ...).
        distance: ``cosine`` (default), ``euclidean`` or ``dot``.
    """

    def __init__(self, embeddings: Any, labels: Any = None, ids: Any = None, distance: str = "cosine") -> None:
        from dmlkit.distances import get_distance

        get_distance(distance)  # validates the name
        self.distance = distance
        self.embeddings = np.empty((0, 0), dtype=np.float32)
        self.labels: np.ndarray | None = None
        self.ids: np.ndarray | None = None
        self.add(embeddings, labels, ids)

    def __len__(self) -> int:
        return int(self.embeddings.shape[0])

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def add(self, embeddings: Any, labels: Any = None, ids: Any = None) -> None:
        """Append references; labels/ids must be given for all or none of them."""
        emb = np.asarray(embeddings.detach().cpu() if hasattr(embeddings, "detach") else embeddings, dtype=np.float32)
        if emb.ndim != 2 or emb.shape[0] == 0:
            raise ShapeError(f"embeddings must be a non-empty (M, D) array, got shape {emb.shape}")
        if not np.isfinite(emb).all():
            raise DataError("embeddings contain NaN or infinity")
        if len(self) and emb.shape[1] != self.dim:
            raise ShapeError(f"the index holds {self.dim}-d embeddings, got {emb.shape[1]}-d")
        first = len(self) == 0
        for name, value in (("labels", labels), ("ids", ids)):
            current = getattr(self, name)
            if value is None:
                if current is not None:
                    raise DataError(f"the index has {name}; pass {name} for the new embeddings too")
                continue
            arr = np.asarray(value)
            if arr.shape != (emb.shape[0],):
                raise ShapeError(f"{name} must be ({emb.shape[0]},), got {arr.shape}")
            if current is None and not first:
                raise DataError(f"the index was built without {name}; cannot add them now")
            if name == "labels":
                arr = arr.astype(np.int64)
            else:
                arr = arr.astype(str)
            setattr(self, name, arr if current is None else np.concatenate([current, arr]))
        self.embeddings = emb if first else np.concatenate([self.embeddings, emb])

    def search(self, queries: Any, k: int = 10) -> SearchResult:
        """The ``k`` nearest references of each query (exact)."""
        from dmlkit.metrics import knn

        q = np.asarray(queries.detach().cpu() if hasattr(queries, "detach") else queries, dtype=np.float32)
        if q.ndim == 1:
            q = q[None]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ShapeError(f"queries must be (Q, {self.dim}), got shape {q.shape}")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        res = knn(q, self.embeddings, k=min(k, len(self)), distance=self.distance, exclude_self=False)
        idx = res.indices.numpy()
        return SearchResult(
            indices=idx, scores=res.values.numpy(),
            labels=None if self.labels is None else self.labels[idx],
            ids=None if self.ids is None else self.ids[idx],
            higher_is_closer=res.higher_is_closer,
        )

    def classify(self, queries: Any, k: int = 1) -> np.ndarray:
        """kNN classification: the majority label of the ``k`` nearest (ties: the nearest's)."""
        if self.labels is None:
            raise DataError("this index has no labels: build it with labels to classify")
        res = self.search(queries, k)
        out = np.empty(res.labels.shape[0], dtype=np.int64)
        for q, row in enumerate(res.labels):
            values, counts = np.unique(row, return_counts=True)
            best = values[counts == counts.max()]
            out[q] = next(lab for lab in row if lab in best)  # nearest among the tied majority
        return out

    # -- persistence ---------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the index to one ``.npz`` file (atomically)."""
        arrays: dict[str, Any] = {"embeddings": self.embeddings,
                                  "meta": np.array(json.dumps({"format": _FORMAT, "distance": self.distance}))}
        if self.labels is not None:
            arrays["labels"] = self.labels
        if self.ids is not None:
            arrays["ids"] = self.ids
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return atomic_write_bytes(path, buffer.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike) -> EmbeddingIndex:
        """Read an index written by :meth:`save`."""
        path = Path(path)
        if not path.exists():
            raise DataNotFoundError(f"index file not found: {path}")
        with np.load(path, allow_pickle=False) as data:
            if "meta" not in data:
                raise DataError(f"{path} is not a dmlkit index (build one with `dmlkit index`)")
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != _FORMAT:
                raise DataError(f"{path}: unknown index format {meta.get('format')!r}")
            return cls(data["embeddings"], data["labels"] if "labels" in data else None,
                       data["ids"] if "ids" in data else None, distance=meta["distance"])
