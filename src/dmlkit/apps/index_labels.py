"""Labels of an :class:`~dmlkit.apps.index.EmbeddingIndex`: integer ids or class names, and
the :class:`SearchResult` that reports them.

An index holds integer labels. Class-name labels (strings) are stored as codes into the index's
``class_names`` (the sorted names of the first labelled batch; names new to a later batch are
appended), so the same name keeps the same code across batches, files and save/load, and
results report the names. A batch of names is refused on an index of integer ids and the other
way round: a number and a name never mean the same class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlkit.exceptions import DataError
from dmlkit.validation import check_labels

__all__ = ["SearchResult", "encode_labels"]


@dataclass(frozen=True)
class SearchResult:
    """Neighbours of each query, closest first: ``(Q, k)`` arrays.

    ``indices`` are row positions in the index (``-1`` where an approximate search found fewer
    than ``k`` neighbours), ``ids`` the items' identifiers, ``labels`` their labels (or
    ``None``; codes into ``class_names`` when the index holds class names), ``metadata`` their
    metadata dicts (or ``None``).
    """

    indices: np.ndarray
    scores: np.ndarray
    labels: np.ndarray | None
    ids: np.ndarray | None
    higher_is_closer: bool
    metadata: list[list[dict[str, Any] | None]] | None = None
    class_names: np.ndarray | None = None

    def to_records(self) -> list[list[dict[str, Any]]]:
        """One list per query of ``{"rank", "index", "score", "label", "id", "metadata"}``;
        ``label`` is the class name when the index holds names, else the integer label."""
        out = []
        for q in range(self.indices.shape[0]):
            row = []
            for r, (i, s) in enumerate(zip(self.indices[q], self.scores[q])):
                if i < 0:
                    continue
                rec: dict[str, Any] = {"rank": r + 1, "index": int(i), "score": float(s)}
                if self.labels is not None:
                    code = int(self.labels[q, r])
                    rec["label"] = code if self.class_names is None else str(self.class_names[code])
                if self.ids is not None:
                    rec["id"] = str(self.ids[q, r])
                if self.metadata is not None and self.metadata[q][r] is not None:
                    rec["metadata"] = self.metadata[q][r]
                row.append(rec)
            out.append(row)
        return out


def encode_labels(labels: Any, n: int, class_names: np.ndarray | None, has_labels: bool, first: bool
                  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(int64 codes or None, class names after this batch or None)`` of a batch of ``n`` labels.

    ``class_names``: the index's names so far (``None``: integer labels, or none yet);
    ``has_labels``: whether the index holds labels; ``first``: whether the batch is the index's
    first. Integer labels stay as they are; class names are encoded against ``class_names``
    (new names appended). A batch without labels on a labelled index, labels on an unlabelled
    one, or names on an index of integer ids (and the other way round) raise
    :class:`~dmlkit.exceptions.DataError`; bad values :class:`~dmlkit.exceptions.ShapeError`.
    """
    if labels is None:
        if has_labels:
            raise DataError("the index has labels; pass labels for the new embeddings too")
        return None, None
    if not has_labels and not first:
        raise DataError("the index was built without labels; cannot add them now")
    codes, names = check_labels(labels, n, "labels")
    if names is None:  # integer ids
        if class_names is not None and not first:
            raise DataError(f"these labels are integer ids but the index's labels are class names "
                            f"(e.g. {str(class_names[0])!r}): add class-name labels, or build a new index")
        return codes, None
    if class_names is None:
        if not first:
            raise DataError(f"these labels are class names (e.g. {names[0]!r}) but the index's labels are "
                            "integer ids: add integer labels, or build a new index")
        return codes, np.asarray(names, dtype=str)
    codes, names = check_labels(labels, n, "labels", class_names=[str(c) for c in class_names.tolist()])
    return codes, np.asarray(names, dtype=str)
