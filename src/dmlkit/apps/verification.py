"""Verification: are two samples the same identity? Thresholds chosen by k-fold cross-validation.

The protocol of face verification benchmarks such as LFW (Huang et al., "Labeled Faces in the
Wild", UMass TR 07-49, 2007), as described in seed 003: pairs are split into ``k`` folds; for
each fold the similarity threshold that maximises accuracy on the other ``k - 1`` folds is
applied to it, so the threshold never sees the pairs it is scored on. The reported accuracy is
the mean over folds with the standard deviation over folds (``ddof=0``, as the common
face-recognition evaluation code, e.g. FaceNet's and InsightFace's, reports "mean +- std") and
the standard error of the mean that LFW's own protocol asks for
(``S_E = sigma / sqrt(k)`` with ``sigma`` the ``ddof=1`` standard deviation). Also reported, over all pairs
at once: ROC AUC, the equal error rate (EER: the ROC point where the false accept rate equals
the false reject rate; the mean of the two at the closest point) and the true accept rate at
fixed false accept rates (TAR@FAR: the highest TPR whose FPR does not exceed the target).

Pairs come from three places:

* :func:`verify` draws balanced random pairs from class labels (:func:`make_pairs`);
* :func:`verify_pair_list` scores a fixed list (LFW ``pairs.txt`` or a CSV, read by
  :func:`dmlkit.data.pairs.load_pair_list`) on the list's own folds;
* :func:`verify_scores` evaluates any pair scores with given or generated folds.

Distances (``distance=``, :data:`VERIFY_DISTANCES`): a pair's score is the similarity, or the
negated distance, of its two embeddings. ``cosine`` (the default); ``euclidean`` and ``dot``
compare **L2-normalised** embeddings, as :mod:`dmlkit.distances` builds them by default and
``dmlkit evaluate``, ``dmlkit index`` and ``dmlkit serve`` use them (``euclidean`` is then
``sqrt(2 - 2 cos)`` and ``dot`` is ``cos``: both give cosine's accuracy, AUC and EER, on
another threshold scale); ``raw-euclidean`` and ``raw-dot`` compare the embeddings as they are
(the Euclidean distance ``dmlkit fewshot --distance euclidean`` and ``dmlkit reid --metric
euclidean`` rank by, squared there, which ranks alike); ``snr`` (raw, Yuan et al. 2019). A
result records its distance under that name, so a saved threshold is judged on the distance
it was chosen on (``dmlkit serve --verification`` scores pairs with :func:`pair_scores`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit.data import get_transforms
from dmlkit.data.base import ImageFileDataset
from dmlkit.data.pairs import _refuse_repeated_pairs
from dmlkit.distances import get_distance
from dmlkit.embeddings import resolve_device
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.training import embed_split, find_checkpoint, load_checkpoint
from dmlkit.validation import check_embeddings, check_integer, check_labels, check_seed

if TYPE_CHECKING:
    import torch

    from dmlkit.data.pairs import PairList

__all__ = [
    "ARRAYS_SOURCE", "VERIFY_DISTANCES", "VerificationResult", "check_pair_list_folds",
    "embed_image_files", "kfold_threshold_accuracy", "make_pairs", "pair_scores",
    "stratified_folds", "verify", "verify_pair_list", "verify_scores"
]

DEFAULT_FAR_TARGETS = (1e-3, 1e-2, 1e-1)

#: The distances of :func:`pair_scores` (module docstring): ``euclidean`` and ``dot`` on
#: L2-normalised embeddings, ``raw-euclidean`` and ``raw-dot`` on the embeddings as they are.
VERIFY_DISTANCES = ("cosine", "euclidean", "dot", "snr", "raw-euclidean", "raw-dot")

#: The raw distances: their name without ``raw-``, built without normalisation.
_RAW_DISTANCES = {"raw-euclidean": "euclidean", "raw-dot": "dot"}


def make_pairs(labels: Any, num_pairs: int = 6000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Balanced pairs ``(i, j, same)``: ``num_pairs / 2`` positive and as many negative pairs
    (``num_pairs``: an even number, at least 2, else :class:`ConfigError`: 41 drew 40 silently).

    Positives are drawn uniformly without replacement among all ``P = sum_c C(n_c, 2)``
    same-class pairs ``i < j``: ``rng.choice(P, num_pairs / 2, replace=False)`` picks positions
    in their list (classes sorted, a class's pairs in row-major order), each decoded to its pair
    (:func:`_same_class_pairs`) without building the list: memory ``O(N + num_pairs)`` (listing
    took 36 bytes a pair, 1.1 GiB for 4 classes of 4,000; a seed draws the pairs it drew then).
    Negatives are drawn uniformly without replacement among the distinct unordered
    different-class pairs ``i < j`` (:func:`_negative_pairs`), as many as positives: no pair is
    scored twice, in either order. Where the labels hold fewer same-class or fewer
    different-class pairs than ``num_pairs // 2``, all of the scarcer kind are used, as many of
    the other, with a warning (a class of 100 and a class of 1 give 100 different-class pairs:
    200 pairs, not an error). One class is refused first (no negative pair). Labels are
    validated by :func:`dmlkit.validation.check_labels` (integer ids or class-name strings; NaN
    or fractional labels are refused: a NaN label never equals another, so its rows made only
    "different" pairs, even with each other), and ``seed`` by :func:`dmlkit.validation.check_seed`
    (``None`` drew different pairs on every call).
    """
    y, _ = check_labels(labels)
    if len(y) < 2:
        raise ShapeError(f"labels must be (N,) with N >= 2, got {len(y)} label(s)")
    if int(num_pairs) < 2:
        raise ConfigError(f"the number of pairs must be at least 2 (one positive, one negative), got {num_pairs}")
    if int(num_pairs) % 2:  # half matched, half mismatched: an odd count silently lost a pair
        raise ConfigError(f"the number of pairs (--pairs / num_pairs) must be even, half matched and half "
                          f"mismatched, got {num_pairs}: use {int(num_pairs) - 1} or {int(num_pairs) + 1}")
    rng = np.random.default_rng(check_seed(seed))
    _, _, sizes = _class_groups(y)
    n_same = int((sizes * (sizes - 1) // 2).sum())
    if n_same == 0:
        raise DataError("no class has two samples: verification needs positive pairs")
    if len(sizes) < 2:
        raise DataError("all samples share one class: verification needs negative pairs")
    n_neg = _negative_pair_count(y)
    n_pos = min(num_pairs // 2, n_same, n_neg)
    if n_pos < num_pairs // 2:  # asked for more than the labels hold: say so, never silently fewer
        scarce = f"{n_same} same-class" if n_same <= n_neg else f"{n_neg} different-class"
        warnings.warn(f"{num_pairs} pairs asked for, but the labels give only {scarce} pairs: "
                      f"using {2 * n_pos} ({n_pos} same, {n_pos} different)", stacklevel=2)
    # numpy draws in O(n_pos) memory (Floyd's algorithm), or shuffles an arange(n_same) where
    # n_pos > n_same / 50: O(num_pairs) either way
    pi, pj = _same_class_pairs(y, rng.choice(n_same, size=n_pos, replace=False))
    ni_a, nj_a = _negative_pairs(y, n_pos, rng)
    i = np.concatenate([pi, ni_a])
    j = np.concatenate([pj, nj_a])
    same = np.concatenate([np.ones(n_pos, bool), np.zeros(len(ni_a), bool)])
    order = rng.permutation(len(i))
    return i[order], j[order], same[order]


#: Label sets with at most this many unordered pairs have their negative pairs drawn by
#: position among all of them (:func:`_different_class_pairs`), not by rejection.
_ENUMERATE_PAIRS = 2_000_000


def _class_groups(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, starts, sizes)``: class ``c``'s rows (``np.unique`` order) ascending are
    ``order[starts[c]:starts[c] + sizes[c]]``."""
    order = np.argsort(y, kind="stable")
    _, starts, sizes = np.unique(y[order], return_index=True, return_counts=True)
    return order, starts.astype(np.int64), sizes.astype(np.int64)


def _row_start(a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Pairs before row ``a`` of the row-major upper triangle of ``m`` items: ``a (2m - a - 1) / 2``."""
    return a * (2 * m - a - 1) // 2


def _same_class_pairs(y: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same-class pairs ``(i, j)``, ``i < j``, at positions ``picks`` of their list (classes
    in ``np.unique`` order, a class's pairs as ``np.triu_indices`` orders its rows) without
    building it: ``O(N + len(picks))`` memory. A position's class comes from the cumulative
    counts ``C(n_c, 2)``; its offset ``r`` in the class's ``m``-item triangle lies in row ``a``,
    the largest with ``a (2m - a - 1) / 2 <= r`` (the smaller root of that quadratic, corrected
    in integers), column ``b = a + 1 + r - a (2m - a - 1) / 2``."""
    order, starts, sizes = _class_groups(y)
    per = sizes * (sizes - 1) // 2
    ends = np.cumsum(per)
    picks = np.asarray(picks, dtype=np.int64)
    c = np.searchsorted(ends, picks, side="right")
    r, m = picks - (ends[c] - per[c]), sizes[c]
    root = ((2 * m - 1) - np.sqrt(np.maximum((2.0 * m - 1) ** 2 - 8.0 * r, 0.0))) / 2
    a = np.clip(np.floor(root).astype(np.int64), 0, np.maximum(m - 2, 0))
    while True:  # float rounding may leave the row off by one (or two) for a large class
        down = _row_start(a, m) > r
        up = (a + 1 <= m - 2) & (_row_start(a + 1, m) <= r)
        if not (down.any() or up.any()):
            break
        a += up.astype(np.int64) - down.astype(np.int64)
    b = a + 1 + r - _row_start(a, m)
    return order[starts[c] + a], order[starts[c] + b]


def _different_class_pairs(y: np.ndarray, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The different-class pairs ``(a, j)``, ``a < j``, at positions ``picks`` of their list in
    row-major order (``np.triu_indices(N, 1)`` less the same-class pairs) without building it:
    ``O(N + len(picks))`` memory (``triu_indices`` of a class of 20,000 and one other sample
    took 3.2 GB). Row ``a`` holds ``N - 1 - a`` pairs less the ``n_c - 1 - t`` rows of its class
    after it (``t``: ``a``'s rank in its class ``c``); a position's row comes from the cumulative
    row counts, and its offset ``o`` in the row gives ``j = a + 1 + o + s``, ``s`` the rows of
    class ``c`` passed over: the largest ``s >= 0`` with ``M[t + s] - (t + s) <= o + a - t``
    (``M``: the class's rows ascending, so ``M[u] - u`` never decreases)."""
    n = len(y)
    order, starts, sizes = _class_groups(y)
    cls = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)  # class of order[k]
    rank_sorted = np.arange(n, dtype=np.int64) - starts[cls]
    rank, row_class = np.empty(n, np.int64), np.empty(n, np.int64)
    rank[order], row_class[order] = rank_sorted, cls
    count = (n - 1 - np.arange(n, dtype=np.int64)) - (sizes[row_class] - 1 - rank)
    ends = np.cumsum(count)
    picks = np.asarray(picks, dtype=np.int64)
    a = np.searchsorted(ends, picks, side="right")
    o = picks - (ends[a] - count[a])
    c, t = row_class[a], rank[a]
    key = cls * n + (order - rank_sorted)  # per class M[u] - u (in [0, n)), classes apart
    s = np.searchsorted(key, c * n + o + a - t, side="right") - 1 - (starts[c] + t)
    return a, a + 1 + o + s


def _negative_pair_count(y: np.ndarray) -> int:
    """The distinct unordered different-class pairs of labels ``y``: all pairs less each
    class's own, ``(N (N - 1) - sum_c n_c (n_c - 1)) / 2``."""
    n, sizes = len(y), _class_groups(y)[2]
    return (n * (n - 1) - int((sizes * (sizes - 1)).sum())) // 2


def _negative_pairs(y: np.ndarray, need: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``need`` distinct unordered different-class pairs ``(i, j)``, ``i < j``, drawn uniformly
    without replacement: by position among all of them (sorted, decoded by
    :func:`_different_class_pairs`, never listed) when there are few, ``need`` is most of them,
    or under 1 random pair in 4 is one (rejection crawled: 31 s for 3,000 beside a class of
    20,000), else random draws keyed on ``(min, max)``, repeats rejected. Memory ``O(N + need)``."""
    n = len(y)
    available = _negative_pair_count(y)
    if need > available:
        raise ConfigError(
            f"{2 * need} pairs need {need} distinct negative (different-class) pairs but the labels "
            f"have only {available}: ask for at most {2 * available} pairs (--pairs / num_pairs)"
        )
    if n * (n - 1) // 2 <= _ENUMERATE_PAIRS or 2 * need >= available or 8 * available < n * n:
        return _different_class_pairs(y, np.sort(rng.choice(available, size=need, replace=False)))
    keys = np.empty((0,), dtype=np.int64)  # min * n + max of the pairs taken, in draw order
    while keys.size < need:
        draw = 2 * (need - keys.size)
        a = rng.integers(0, n, size=draw)
        b = rng.integers(0, n, size=draw)
        ok = y[a] != y[b]
        new = np.minimum(a, b)[ok].astype(np.int64) * n + np.maximum(a, b)[ok]
        _, first = np.unique(new, return_index=True)
        new = new[np.sort(first)]  # the first draw of each pair, in draw order
        new = new[~np.isin(new, keys)]
        keys = np.concatenate([keys, new[: need - keys.size]])
    return keys // n, keys % n


def _distance_name(distance: str) -> str:
    """``distance``'s name as a result records it: stripped, lower case, ``raw_`` spelt ``raw-``;
    an unknown name is one :class:`ConfigError` line listing :data:`VERIFY_DISTANCES`."""
    name = distance.strip().lower() if isinstance(distance, str) else None
    if name is not None and name.startswith("raw_"):
        name = "raw-" + name[4:]
    if name == "lp":  # dmlkit.distances' other name of euclidean: recorded as euclidean
        name = "euclidean"
    if name not in VERIFY_DISTANCES:
        raise ConfigError(f"unknown distance {distance!r}; choose one of {list(VERIFY_DISTANCES)} (euclidean and "
                          "dot compare L2-normalised embeddings, raw-euclidean and raw-dot the embeddings as they are)")
    return name


def _check_distance(distance: str):
    """The :class:`~dmlkit.distances.BaseDistance` of a :data:`VERIFY_DISTANCES` name: the
    library's default build (``euclidean``/``dot`` normalise), or for ``raw-*`` the same
    distance without normalisation."""
    name = _distance_name(distance)
    if name in _RAW_DISTANCES:
        return get_distance(_RAW_DISTANCES[name], normalize_embeddings=False)
    return get_distance(name)


def _finite_embeddings(embeddings: Any) -> np.ndarray:
    """``(N, D)`` finite float32, else :class:`NonFiniteError` (:func:`dmlkit.validation.check_embeddings`)."""
    return check_embeddings(embeddings).cpu().numpy()


def _pair_rows(rows: Any, n: int, name: str) -> np.ndarray:
    """``rows`` as int64 row numbers in ``[0, n)``, else :class:`ShapeError` (a negative row
    would silently index from the end)."""
    r = np.asarray(rows)
    if r.ndim != 1 or (r.size and r.dtype.kind not in "iu"):
        raise ShapeError(f"pair rows {name} must be a 1-D integer array, got shape {r.shape} dtype {r.dtype}")
    r = r.astype(np.int64)
    bad = (r < 0) | (r >= n)
    if bad.any():
        raise ShapeError(f"{int(bad.sum())} pair rows in {name} lie outside the {n} embedding rows "
                         f"[0, {n - 1}], first {int(r[bad][0])}")
    return r


def pair_scores(embeddings: Any, i: np.ndarray, j: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """Scores of pairs ``(i[p], j[p])`` of embedding rows, larger = more likely the same
    (distances are negated); ``distance`` one of :data:`VERIFY_DISTANCES` (``euclidean`` and
    ``dot`` on L2-normalised rows, ``raw-euclidean`` / ``raw-dot`` on the rows as they are).
    Rows outside ``[0, N)`` are refused (:class:`ShapeError`)."""
    import torch

    dist = _check_distance(distance)
    x = torch.as_tensor(_finite_embeddings(embeddings))
    i, j = _pair_rows(i, len(x), "i"), _pair_rows(j, len(x), "j")
    if i.shape != j.shape:
        raise ShapeError(f"pair rows i and j must have equal lengths, got {len(i)} and {len(j)}")
    with torch.no_grad():
        values = dist.paired(x[torch.as_tensor(i)], x[torch.as_tensor(j)])
    return dist.closeness(values).numpy().astype(np.float64)


def _best_threshold(scores: np.ndarray, same: np.ndarray) -> tuple[float, float]:
    """The threshold ``t`` (predict same when ``score >= t``) with the highest accuracy."""
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], same[order]
    # predicting the top-n as "same": correct = positives among top-n + negatives below
    tp = np.concatenate([[0], np.cumsum(y)])
    tn_below = (~y).sum() - np.concatenate([[0], np.cumsum(~y)])
    acc = (tp + tn_below) / len(y)
    # only cut between distinct scores
    valid = np.ones(len(y) + 1, bool)
    valid[1:-1] = s[:-1] != s[1:]
    n = int(np.flatnonzero(valid)[np.argmax(acc[valid])])
    if n == 0:  # accept nothing: above the top score at any scale (1e12 + 1e-6 == 1e12)
        t = max(s[0] + 1e-6, np.nextafter(s[0], np.inf))
    elif n == len(y):  # accept everything
        t = min(s[-1] - 1e-6, np.nextafter(s[-1], -np.inf))
    else:  # the midpoint of the cut, unless it rounds onto the lower score (adjacent doubles)
        t = s[n] / 2 + s[n - 1] / 2
        if not s[n] < t <= s[n - 1]:
            t = s[n - 1]
    return float(t), float(acc[n])


def _fold_count(folds: Any, pairs: int | None = None) -> int:
    """``folds`` as an integer number of folds, at least 2 (the threshold is fitted on the other
    folds) and at most ``pairs``; :class:`ConfigError` otherwise (2.5 was truncated to 2, or
    dealt as fractional fold ids)."""
    k = check_integer(folds, "folds", least=2, hint=" (the threshold is fitted on the other folds)")
    if pairs is not None and k > pairs:
        raise ConfigError(f"folds must be in [2, {pairs}] (the number of pairs), got {k}")
    return k


def stratified_folds(same: Any, folds: int) -> np.ndarray:
    """Fold ids dealing positives and negatives round-robin in order: the ``r``-th positive goes
    to fold ``r mod folds``, so every fold keeps the ratio; the negatives carry on where the
    positives stopped (the ``r``-th to fold ``(P + r) mod folds`` for ``P`` positives), so fold
    sizes differ by at most one pair (both dealt from fold 0 left the first folds up to two
    pairs larger)."""
    y = np.asarray(same, dtype=bool)
    folds = _fold_count(folds, len(y))
    ids = np.empty(len(y), dtype=np.int64)
    n_pos = int(y.sum())
    ids[y] = np.arange(n_pos) % folds
    ids[~y] = (n_pos % folds + np.arange(len(y) - n_pos)) % folds
    return ids


def _scores_and_same(scores: Any, same: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(scores float64, same bool)``: equal ``(P,)`` arrays, every score finite
    (:class:`NonFiniteError`: a NaN sorted last and counted as "different"), ``same`` booleans
    or 0/1 (:class:`ShapeError`: a cast to bool read ``2``, ``0.5`` or -1/+1 labels as matched)."""
    s = np.asarray(scores, dtype=np.float64)
    raw = np.asarray(same)
    if s.ndim != 1 or s.shape != raw.shape:
        raise ShapeError(f"scores and same must be equal (P,) arrays, got {s.shape} and {raw.shape}")
    if raw.dtype != bool and (raw.dtype.kind not in "iuf" or not np.isin(raw, (0, 1)).all()):
        shown = np.unique(raw[~np.isin(raw, (0, 1))])[:5] if raw.dtype.kind in "iuf" else raw.dtype
        raise ShapeError(f"same must be booleans or 0/1 (1 = matched pair), got {shown}")
    if not np.all(np.isfinite(s)):
        raise NonFiniteError(f"{int((~np.isfinite(s)).sum())} pair score(s) are NaN or infinite: "
                             "check the embeddings")
    return s, raw.astype(bool)


def kfold_threshold_accuracy(scores: Any, same: Any, folds: int | Sequence[int] | np.ndarray = 10) -> dict[str, Any]:
    """Accuracy with thresholds chosen on the other folds (LFW protocol).

    ``folds``: an int ``k`` splits the pairs into ``k`` contiguous blocks (for pairs in random
    order, as :func:`make_pairs` returns them); an array gives each pair's fold id (a pair
    list's own folds, or :func:`stratified_folds`), integers.
    """
    s, y = _scores_and_same(scores, same)
    if np.ndim(folds) == 0:
        k = _fold_count(folds, len(s))
        fold_ids = np.repeat(np.arange(k), [len(p) for p in np.array_split(np.arange(len(s)), k)])
    else:
        given = np.asarray(folds)
        if given.shape != s.shape:
            raise ShapeError(f"fold ids must have one entry per pair ({len(s)}), got {given.shape}")
        if given.dtype.kind not in "iu" and not (given.dtype.kind == "f" and np.all(np.mod(given, 1) == 0)):
            raise ShapeError(f"fold ids must be integers, got {given.dtype} values such as {given[:3].tolist()}")
        fold_ids = given.astype(np.int64)
    names = np.unique(fold_ids)
    if len(names) < 2:
        raise ConfigError("the k-fold protocol needs at least 2 folds; the pairs have one")
    accs, thresholds = [], []
    for f in names:
        test = fold_ids == f
        t, _ = _best_threshold(s[~test], y[~test])
        thresholds.append(t)
        accs.append(float(((s[test] >= t) == y[test]).mean()))
    return {"accuracy": float(np.mean(accs)), "accuracy_std": float(np.std(accs)),
            "accuracy_sem": float(np.std(accs, ddof=1) / np.sqrt(len(accs))),
            "threshold": float(np.mean(thresholds)), "fold_accuracies": accs, "fold_thresholds": thresholds}


#: ``source`` of a result of arrays without a file: ``serve --verification`` says it cannot check it.
ARRAYS_SOURCE = {"embeddings": "arrays given to the Python API (no file recorded)"}


@dataclass
class VerificationResult:
    """Verification scores of one embedding set (fractions in [0, 1]).

    ``accuracy`` is the mean of the fold accuracies, ``accuracy_std`` their standard deviation
    (``ddof=0``), ``accuracy_sem`` LFW's standard error of the mean; ``threshold`` is the mean
    of the fold thresholds (on the score, larger = same). ``fold_source``: ``"list"`` (the pair
    list's own folds), ``"stratified"`` or ``"contiguous"`` (generated, see
    :func:`kfold_threshold_accuracy`), ``"given"`` (fold ids passed to :func:`verify_scores`).
    """

    accuracy: float
    accuracy_std: float
    threshold: float
    roc_auc: float
    eer: float
    tar_at_far: dict[str, float]
    num_pairs: int
    folds: int
    fold_accuracies: list[float] = field(default_factory=list)
    fold_thresholds: list[float] = field(default_factory=list)
    num_positive: int = 0
    num_negative: int = 0
    fold_source: str = "contiguous"
    accuracy_sem: float = 0.0
    #: the distance the scores (and so ``threshold``) are on; ``None`` for bare scores
    distance: str | None = None
    #: the file the embeddings came from (:func:`~dmlkit.apps.index_sources.verification_source`)
    source: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields; ``source`` ``None`` as :data:`ARRAYS_SOURCE` (serve said "an older dmlkit")."""
        return {**asdict(self), "source": self.source or dict(ARRAYS_SOURCE)}


def _warn_unresolved_far(far_targets: Sequence[float], n_neg: int) -> None:
    """Warn where ``n_neg`` mismatched pairs admit no false accept at a FAR target (``far n_neg <
    1``): TAR@FAR is then the TAR at no false accept, whatever the target, and rests on the few
    highest-scoring mismatched pairs."""
    unresolved = [far for far in far_targets if far * n_neg < 1]
    if unresolved:
        names = ", ".join(f"{100 * far:g} %" for far in unresolved)
        these, them = ("these are", "them") if len(unresolved) > 1 else ("it is", "it")
        warnings.warn(f"TAR at FAR {names}: {n_neg} mismatched pairs resolve false accept rates "
                      f"in steps of {100 / n_neg:.2g} %, so {these} the TAR with no false accept; "
                      f"score at least {int(np.ceil(1 / min(unresolved)))} mismatched pairs for {them}",
                      stacklevel=3)


def verify_scores(scores: Any, same: Any, folds: int | Sequence[int] | np.ndarray = 10, *,
                  far_targets: Sequence[float] = DEFAULT_FAR_TARGETS,
                  fold_source: str | None = None) -> VerificationResult:
    """k-fold threshold accuracy, ROC AUC, EER and TAR@FAR of pair ``scores`` (larger = same).

    ``folds`` as in :func:`kfold_threshold_accuracy`. ``same``: booleans or 0/1 (1 = matched);
    both classes must occur. NaN/infinite scores are refused (:class:`NonFiniteError`).
    """
    from sklearn.metrics import roc_auc_score, roc_curve

    s, y = _scores_and_same(scores, same)
    n_pos = int(y.sum())
    if n_pos == 0 or n_pos == len(y):
        raise DataError(f"verification needs both matched and mismatched pairs; got {n_pos} matched "
                        f"of {len(y)}")
    for far in far_targets:
        if not 0 < far <= 1:
            raise ConfigError(f"FAR targets must be in (0, 1], got {far}")
    kfold = kfold_threshold_accuracy(s, y, folds=folds)
    fpr, tpr, _ = roc_curve(y, s, drop_intermediate=False)
    fnr = 1 - tpr
    e = int(np.argmin(np.abs(fnr - fpr)))
    eer = float((fpr[e] + fnr[e]) / 2)
    tar = {f"{far:g}": float(tpr[np.searchsorted(fpr, far, side="right") - 1]) for far in far_targets}
    _warn_unresolved_far(far_targets, len(y) - n_pos)
    return VerificationResult(
        accuracy=kfold["accuracy"], accuracy_std=kfold["accuracy_std"], threshold=kfold["threshold"],
        roc_auc=float(roc_auc_score(y, s)), eer=eer, tar_at_far=tar, num_pairs=len(s),
        folds=len(kfold["fold_accuracies"]), fold_accuracies=kfold["fold_accuracies"],
        fold_thresholds=kfold["fold_thresholds"], num_positive=n_pos, num_negative=len(y) - n_pos,
        fold_source=fold_source or ("contiguous" if np.ndim(folds) == 0 else "given"),
        accuracy_sem=kfold["accuracy_sem"],
    )


def verify(embeddings: Any, labels: Any, *, num_pairs: int = 6000, folds: int = 10,
           distance: str = "cosine", far_targets: Sequence[float] = DEFAULT_FAR_TARGETS,
           seed: int = 0) -> VerificationResult:
    """Balanced random pairs from ``labels``, k-fold threshold accuracy, ROC AUC, EER, TAR@FAR.

    ``distance``: one of :data:`VERIFY_DISTANCES` (``euclidean`` and ``dot`` on L2-normalised
    embeddings; ``raw-euclidean`` for the raw Euclidean distance). ``num_pairs``: even.
    ``folds`` must lie in ``[2, number of pairs]``; NaN/infinite embeddings are refused
    (:class:`~dmlkit.exceptions.NonFiniteError`)."""
    x = _finite_embeddings(embeddings)
    y = np.asarray(labels)
    if y.ndim != 1 or len(y) != len(x):
        raise ShapeError(f"labels must be (N,) with N = {len(x)}, got shape {y.shape}")
    _check_distance(distance)
    _fold_count(folds)
    i, j, same = make_pairs(y, num_pairs, seed)
    if int(folds) > len(same):
        raise ConfigError(f"folds ({folds}) exceeds the number of pairs ({len(same)}): lower --folds")
    scores = pair_scores(x, i, j, distance)
    result = verify_scores(scores, same, int(folds), far_targets=far_targets, fold_source="contiguous")
    return replace(result, distance=_distance_name(distance))


def _match_rows(pair_list: PairList, paths: Sequence[str], x: np.ndarray) -> np.ndarray:
    """Row of ``paths`` holding each image of ``pair_list.paths`` (same file, any spelling).

    An image of the list named by two rows of different embeddings is a :class:`DataError`:
    which row is its embedding would be decided by the row order (the last row won, and
    moving it changed the accuracy); rows that repeat one embedding are one answer."""
    def key(p: str) -> str:
        return os.path.normcase(os.path.realpath(os.fspath(p)))

    row: dict[str, int] = {}
    other: dict[str, int] = {}  # an image's first row of another embedding
    for r, p in enumerate(paths):
        k = key(p)
        first = row.setdefault(k, r)
        if first != r and k not in other and not np.array_equal(x[first], x[r]):
            other[k] = r
    clashes = sorted({key(p) for p in pair_list.paths} & other.keys())
    if clashes:
        k = clashes[0]
        raise DataError(f"{len(clashes)} image(s) of the pair list have two different embeddings in the "
                        f"file, e.g. {k} in rows {row[k]} and {other[k]}: keep one row per image (which "
                        "one is the image's embedding would be decided by the row order)")
    missing = [p for p in pair_list.paths if key(p) not in row]
    if missing:
        shown = "; ".join(missing[:20])
        more = f"; ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise DataError(
            f"{len(missing)} image(s) of the pair list have no embedding (dmlkit verify "
            f"--checkpoint RUN_DIR embeds the list's images itself): {shown}{more}"
        )
    return np.fromiter((row[key(p)] for p in pair_list.paths), np.int64, len(pair_list.paths))


def check_pair_list_folds(pair_list: PairList, folds: int | None = None, option: str = "folds") -> None:
    """:class:`ConfigError` for a pair list whose own folds are one (a CSV ``fold`` column of one
    value: not cross-validated; dealing its pairs anew ignored the column), or ``folds`` (``option``)
    given for a list with its own folds (the protocol's: it went unused). No folds passes."""
    if folds is not None and pair_list.num_folds >= 2:
        raise ConfigError(f"{option} does not apply here ({Path(pair_list.source).name} has its own "
                          f"{pair_list.num_folds} folds, which the protocol uses): drop it")
    if pair_list.num_folds == 1:
        raise ConfigError(f"{pair_list.source}: every pair is in the same fold, and a single given fold "
                          "cannot be cross-validated (each threshold is chosen on the other folds): give "
                          "the pairs 2 or more fold ids, or drop the 'fold' column to deal them into "
                          "stratified folds (dmlkit verify --folds, default 10)")


def verify_pair_list(embeddings: Any, pair_list: PairList, paths: Sequence[str] | None = None, *,
                     distance: str = "cosine", folds: int | None = None,
                     far_targets: Sequence[float] = DEFAULT_FAR_TARGETS) -> VerificationResult:
    """Verification on a fixed pair list, on the list's own folds.

    ``embeddings``: one row per image; row ``r`` is the image ``paths[r]`` (default: the list's
    own ``pair_list.paths``, e.g. from :func:`embed_image_files`). A list with two or more folds
    (LFW ``pairs.txt``: 10 folds of 300 + 300 pairs) is scored on those folds; a list without
    folds (a CSV without a ``fold`` column, LFW's one-fold development lists) on ``folds``
    (``None``: 10) :func:`stratified_folds` dealt in file order; ``folds`` given with a list that
    has its own folds is a :class:`ConfigError`, as ``dmlkit verify --folds``. A CSV ``fold`` column that holds one value is
    :class:`ConfigError`: one given fold cannot be cross-validated, and dealing its pairs into
    other folds would silently ignore the column. A pair of one image (one embedding row) with
    itself, or a pair listed again in either order, is a :class:`DataError` naming their 0-based
    positions: both inflate the accuracy."""
    x = _finite_embeddings(embeddings)
    _check_distance(distance)
    check_pair_list_folds(pair_list, folds)  # before the folds' own check, as dmlkit verify
    folds = 10 if folds is None else _fold_count(folds)
    if paths is None:
        if len(x) != len(pair_list.paths):
            raise ShapeError(f"{len(x)} embeddings for a pair list of {len(pair_list.paths)} images: "
                             "pass paths= naming the image of each row")
        rows = np.arange(len(x))
    else:
        if len(paths) != len(x):
            raise ShapeError(f"{len(paths)} paths for {len(x)} embeddings")
        rows = _match_rows(pair_list, paths, x)
    _refuse_repeated_pairs(rows[pair_list.left], rows[pair_list.right], pair_list.source)
    scores = pair_scores(x, rows[pair_list.left], rows[pair_list.right], distance)
    if pair_list.num_folds >= 2:
        result = verify_scores(scores, pair_list.same, pair_list.folds, far_targets=far_targets,
                               fold_source="list")
    else:
        result = verify_scores(scores, pair_list.same, stratified_folds(pair_list.same, folds),
                               far_targets=far_targets, fold_source="stratified")
    return replace(result, distance=_distance_name(distance))


def embed_image_files(checkpoint: str | os.PathLike, paths: Sequence[str | os.PathLike], *,
                      device: str | torch.device = "cpu", progress: bool = False) -> np.ndarray:
    """Embeddings ``(len(paths), D)`` of image files with a trained model (checkpoint file or
    run directory), using its config's evaluation transform and image mode. ``device``: ``cpu``,
    ``cuda``, ``cuda:N`` or ``auto`` (:func:`dmlkit.embeddings.resolve_device`: ``cuda`` without a
    GPU, or an unknown name, is one :class:`ConfigError`, not torch's traceback)."""
    device = resolve_device(device)
    model, config = load_checkpoint(find_checkpoint(Path(checkpoint)), device=device)
    mode = "L" if config.model.in_channels == 1 else "RGB"
    ds = ImageFileDataset([os.fspath(p) for p in paths], np.zeros(len(paths), dtype=np.int64), mode=mode,
                          name="pair_list")
    if config.data.transform is not None:
        ds = ds.with_transform(get_transforms(config.data.transform, train=False, image_size=config.data.image_size))
    emb, _ = embed_split(model, ds, config, device=device, progress=progress)
    return np.asarray(emb, dtype=np.float32)
