"""Shared internals of the pair- and triplet-based losses (label masks, miner indices, LSE).

Everything here works on ``(B, R)`` structures: ``B`` anchors (rows of ``embeddings``) against
``R`` references (``ref_emb`` if given, else ``embeddings`` itself), so no helper ever builds a
``B x B x B`` tensor.

Public (stable) API, used by every pair/triplet loss module:

* :func:`label_masks` - ``(pos_mask, neg_mask)`` from labels; the diagonal is excluded from
  the positives when the reference set is the batch itself (``ref_labels is None``).
* :func:`check_indices` / :func:`indices_kind` - validate a miner's output, ``"pair"`` or
  ``"triplet"``.
* :func:`to_pair_indices` - pairs ``(a1, p, a2, n)`` from pairs or triplets; a triplet
  ``(a, p, n)`` gives the positive pair ``(a, p)`` and the negative pair ``(a, n)``, duplicates
  kept (the same convention as pytorch-metric-learning's ``convert_to_pairs``).
* :func:`indices_to_masks` - dense, de-duplicated ``(pos_mask, neg_mask)`` from pairs or triplets.
* :func:`pair_masks` - the masks a loss should use: from ``indices`` when given, else from labels.
* :func:`masked_logsumexp` - ``log sum_{j: mask} exp(x_j)`` (optionally ``log(1 + ...)``) along
  a dim; rows with no selected entry give ``empty`` (default 0) with a finite (zero) gradient.
* :func:`class_columns` - each anchor's same-class reference columns, padded, from labels alone
  (no ``B x R`` mask), with the class ids and counts.
* :func:`compact_mask` - the column indices of the ``True`` entries of each row, padded to the
  largest row count, with a validity mask (e.g. the positives of each anchor).
* :func:`compute_dtype` / :func:`upcast` - losses compute in float32 when given half precision
  (bfloat16/float16) so that sums, cumulative sums and ``acos`` stay accurate;
  :func:`upcast_pair` - a batch and its reference set in that dtype, promoted to one.
* :func:`block_elements` - how many elements a blocked (checkpointed) computation puts in one
  block on a device: small on a CPU (cache), large on a GPU (kernel launches).
* :func:`as_distance` - a "larger is farther" view of a distance/similarity matrix.
* :func:`safe_norm` / :func:`safe_normalize` - L2 norm and normalisation that neither overflow
  nor underflow anywhere in the float32 range (direct where the norms are moderate, else
  rescaled; ``safe_normalize`` then defers to :func:`dmlkit.validation.safe_normalize`, the
  one the distances use); :func:`pair_matrix` - the distance matrix a loss uses.
"""

from __future__ import annotations

import torch

from dmlkit import validation
from dmlkit.distances import BaseDistance
from dmlkit.exceptions import ShapeError

__all__ = [
    "as_distance",
    "block_elements",
    "check_indices",
    "class_columns",
    "compact_mask",
    "compute_dtype",
    "indices_kind",
    "indices_to_masks",
    "label_masks",
    "masked_logsumexp",
    "pair_masks",
    "pair_matrix",
    "safe_norm",
    "safe_normalize",
    "to_pair_indices",
    "upcast",
    "upcast_pair",
]

Indices = tuple[torch.Tensor, ...]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision dtypes (bfloat16, float16), the dtype itself otherwise."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`compute_dtype` (a no-op for float32/float64)."""
    return x.to(compute_dtype(x.dtype))


def upcast_pair(x: torch.Tensor, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` and ``y`` (when given) in the one dtype a loss or miner computes in: each
    :func:`upcast`, then both in the wider of the two (:func:`dmlkit.validation.common_float`),
    so a float32 batch with a float64 or bfloat16 reference set works as either alone does."""
    x = upcast(x)
    if y is None:
        return x, None
    return validation.common_float(x, upcast(y))


#: Norms in ``[2^-60, 2^60]`` are computed directly (their squares cannot overflow or lose
#: precision to underflow in float32); anything else takes the rescaled path.
_DIRECT_NORM_RANGE = (2.0**-60, 2.0**60)

#: Elements per block of the blocked all-triplet computations on a CPU (``(pairs, R)`` or
#: ``(anchors, K, R)`` float32 blocks of 16 MB: they stay in cache).
CPU_BLOCK_ELEMENTS = 1 << 22
#: On a GPU a block costs a fixed number of kernel launches, so blocks are as large as a small
#: share of the device's memory allows: ``total memory / 512`` elements (a few float32
#: temporaries of a block then take 3-6 % of it), between 2^22 and 2^27. Angular loss at
#: B = 4096 on an H200 (one 50M-element block instead of 12): 5.2 ms a step instead of 43 ms.
GPU_BYTES_PER_BLOCK_ELEMENT = 512


def block_elements(device: torch.device) -> int:
    """Elements per block of a blocked loss or miner computation on ``device``."""
    if device.type != "cuda":
        return CPU_BLOCK_ELEMENTS
    total = torch.cuda.get_device_properties(device).total_memory
    return int(min(1 << 27, max(CPU_BLOCK_ELEMENTS, total // GPU_BYTES_PER_BLOCK_ELEMENT)))


def _row_scale(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``max_j |x_j|`` along ``dim`` (kept), detached, with 1 where it is 0 or not finite."""
    scale = x.detach().abs().amax(dim=dim, keepdim=True)
    return torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def _direct_ok(norm: torch.Tensor) -> bool:
    low, high = _DIRECT_NORM_RANGE
    return bool(((norm >= low) & (norm <= high)).all())


def safe_norm(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """``||x||_2`` along ``dim`` without overflow or underflow.

    ``torch.linalg.vector_norm`` squares the entries, so it returns ``inf`` for float32 rows of
    magnitude ``1e19`` and loses all precision below ``1e-19``. When every norm lies in
    ``[2^-60, 2^60]`` the direct norm is exact and is returned (one extra check, no extra
    pass); otherwise ``c ||x / c||`` with ``c = max |x_j|`` (detached): the norm is
    1-homogeneous, so value and gradient are those of the norm.
    """
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True)
    if x.numel() and not _direct_ok(norm.detach()):
        scale = _row_scale(x, dim)
        norm = torch.linalg.vector_norm(x / scale, dim=dim, keepdim=True) * scale
    return norm if keepdim else norm.squeeze(dim)


def safe_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x / ||x||_2`` along ``dim``, exact across the whole float32 range.

    When every norm lies in ``[2^-60, 2^60]`` this is ``x / ||x||`` computed directly (the cost
    of ``F.normalize`` plus one check); otherwise it is
    :func:`dmlkit.validation.safe_normalize` (rows divided by a power of two at their largest
    entry first, the function the distances use), so ``1e-20`` and ``1e19`` embeddings give the
    directions of unit-sized ones. All-zero rows give 0, as with ``F.normalize``.
    """
    if x.numel() == 0:
        return x
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True)
    if _direct_ok(norm.detach()):
        return x / norm
    return validation.safe_normalize(x, dim=dim)


def pair_matrix(
    distance: BaseDistance, embeddings: torch.Tensor, ref_emb: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``(B, R)`` matrix ``distance(embeddings, ref_emb)`` in :func:`compute_dtype`.

    Distances normalise scale-safely (:func:`dmlkit.validation.safe_normalize`), so a loss on a
    normalising distance is scale-invariant over the float32 range; a non-normalising one
    raises :class:`~dmlkit.exceptions.NonFiniteError` where its products would overflow.
    """
    return distance(upcast(embeddings), None if ref_emb is None else upcast(ref_emb))


def as_distance(mat: torch.Tensor, distance: BaseDistance) -> torch.Tensor:
    """``mat`` if ``distance`` is a distance (smaller = closer), ``-mat`` if it is a similarity."""
    return -mat if distance.higher_is_closer else mat


def label_masks(
    labels: torch.Tensor,
    ref_labels: torch.Tensor | None = None,
    *,
    exclude_self: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean ``(pos_mask, neg_mask)`` of shape ``(B, R)``; the one label-mask helper of the
    losses and miners.

    ``pos_mask[i, j]`` is True when ``labels[i] == ref_labels[j]`` and ``neg_mask`` when they
    differ. With ``ref_labels=None`` the reference set is the batch, and ``i == j`` is *not* a
    positive pair. With a separate reference set nothing is excluded, unless
    ``exclude_self=True``: reference column ``i`` is then batch row ``i`` for every row (the batch
    itself, or a reference set that starts with it, as a cross-batch memory's does).
    """
    if exclude_self is None:
        exclude_self = ref_labels is None
    ref = labels if ref_labels is None else ref_labels
    same = labels.unsqueeze(1) == ref.unsqueeze(0)
    neg = ~same
    if exclude_self:
        if same.shape[1] < same.shape[0]:
            raise ShapeError("exclude_self needs the batch as the first rows of the reference set, "
                             f"got {same.shape[1]} references for {same.shape[0]} rows")
        same[:, : same.shape[0]].fill_diagonal_(False)
    return same, neg


def indices_kind(indices: Indices) -> str:
    """``"pair"`` for ``(a1, p, a2, n)``, ``"triplet"`` for ``(a, p, n)``; else ShapeError."""
    if not isinstance(indices, tuple | list) or len(indices) not in (3, 4):
        raise ShapeError(
            "indices must be a miner's output: a tuple (anchor, positive, negative) of triplets "
            f"or (anchor1, positive, anchor2, negative) of pairs; got {type(indices).__name__}"
            + (f" of length {len(indices)}" if isinstance(indices, tuple | list) else "")
        )
    return "pair" if len(indices) == 4 else "triplet"


#: Index dtypes torch indexes with (uint8 and bool index as masks; int8 and int16 not at all).
_INDEX_DTYPES = (torch.int64, torch.int32)


def check_indices(indices: Indices, num_anchors: int, num_refs: int) -> str:
    """Validate a miner's output against ``num_anchors`` rows and ``num_refs`` references.

    Returns its kind (see :func:`indices_kind`). Raises ShapeError for tensors other than 1-D
    int64/int32, mismatched lengths, or indices out of range.
    """
    kind = indices_kind(indices)
    for t in indices:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in _INDEX_DTYPES:
            found = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError("each index tensor of a miner's output must be a 1-D int64 (or int32) tensor, "
                             f"got {found}: convert with .long() (torch reads uint8 and bool tensors as masks)")
    groups = [(indices[0], indices[1], indices[2])] if kind == "triplet" else [
        (indices[0], indices[1]),
        (indices[2], indices[3]),
    ]
    for group in groups:
        if len({int(t.numel()) for t in group}) != 1:
            raise ShapeError(
                "miner indices of one pair/triplet set must have equal lengths, got "
                f"{[int(t.numel()) for t in group]}"
            )
    bounds = (num_anchors, num_refs, num_refs) if kind == "triplet" else (
        num_anchors, num_refs, num_anchors, num_refs
    )
    for t, bound in zip(indices, bounds):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= bound):
            raise ShapeError(
                f"miner index out of range [0, {bound}): anchors index embeddings, positives and "
                "negatives index ref_emb (or embeddings when ref_emb is not given)"
            )
    return kind


def to_pair_indices(indices: Indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a1, p, a2, n)`` from pairs (returned as is) or triplets ``(a, p, n) -> (a, p, a, n)``."""
    if indices_kind(indices) == "pair":
        a1, p, a2, n = indices
        return a1, p, a2, n
    a, p, n = indices
    return a, p, a, n


def indices_to_masks(
    indices: Indices, num_anchors: int, num_refs: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense boolean ``(pos_mask, neg_mask)`` ``(num_anchors, num_refs)`` from pairs or triplets.

    Duplicated pairs collapse to one entry. A pair marked both positive and negative (an
    inconsistent miner output) raises ShapeError.
    """
    a1, p, a2, n = to_pair_indices(indices)
    device = device if device is not None else a1.device
    pos = torch.zeros(num_anchors, num_refs, dtype=torch.bool, device=device)
    neg = torch.zeros_like(pos)
    pos[a1.to(device), p.to(device)] = True
    neg[a2.to(device), n.to(device)] = True
    if (pos & neg).any():
        raise ShapeError("a pair cannot be both positive and negative in a miner's output")
    return pos, neg


def pair_masks(
    labels: torch.Tensor,
    indices: Indices | None = None,
    ref_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(B, R)`` positive/negative masks a loss uses: from ``indices`` if given, else labels."""
    if indices is None:
        return label_masks(labels, ref_labels)
    num_refs = labels.shape[0] if ref_labels is None else ref_labels.shape[0]
    check_indices(indices, labels.shape[0], num_refs)
    return indices_to_masks(indices, labels.shape[0], num_refs, device=labels.device)


def masked_logsumexp(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int = -1,
    add_one: bool = False,
    keepdim: bool = False,
    empty: float = 0.0,
) -> torch.Tensor:
    """``log(sum_{j: mask_j} exp(x_j))`` along ``dim`` (``log(1 + sum ...)`` with ``add_one``).

    The one masked log-sum-exp of the losses and miners. Stable (the selected maximum, detached,
    is subtracted before ``exp``), and safe for slices where ``mask`` selects nothing: those
    give ``empty`` (or ``0 = log 1`` with ``add_one``) with an exactly zero gradient, never NaN.
    Masked-out entries get zero gradient. ``exp`` is never evaluated on filler values: the
    shifted masked-out entries are set to 0 before ``exp`` and zeroed after it, which avoids
    the slow underflow path of vectorised ``exp`` (3-10x faster on CPU than ``logsumexp`` over
    ``finfo.min`` fillers for half-empty masks) and can never produce ``inf * 0``.
    ``x`` and ``mask`` must broadcast to the same shape.
    """
    x, mask = torch.broadcast_tensors(x, mask)
    off = ~mask
    m = x.detach().masked_fill(off, float("-inf")).amax(dim, keepdim=True)
    nonempty = m > float("-inf")
    m = m.clamp_min(0) if add_one else torch.where(nonempty, m, torch.zeros_like(m))
    s = torch.exp((x - m).masked_fill(off, 0)).masked_fill(off, 0).sum(dim, keepdim=True)
    if add_one:
        s = s + torch.exp(-m)
    else:
        s = torch.where(nonempty, s, torch.ones_like(s))
    out = torch.log(s) + m
    if not add_one and empty != 0.0:
        out = out.masked_fill(~nonempty, empty)
    return out if keepdim else out.squeeze(dim)


def class_codes(labels: torch.Tensor, ref_labels: torch.Tensor
                ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(K, cls_q, cls_r, counts)``: anchors' and references' labels coded ``0..K-1`` over the
    classes either side holds, and the number of references of each class."""
    classes, inverse = torch.unique(torch.cat([labels, ref_labels]), return_inverse=True)
    cls_q, cls_r = inverse[: len(labels)], inverse[len(labels) :]
    return len(classes), cls_q, cls_r, torch.bincount(cls_r, minlength=len(classes))


def anchor_positives(labels: torch.Tensor, ref_labels: torch.Tensor | None
                     ) -> tuple[bool, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(same_set, K, cls_q, cls_r, num_pos)``: :func:`class_codes` of ``labels`` against
    ``ref_labels`` (``None``: the batch itself, ``same_set``) and each anchor's number of
    positives (its class's references, less itself on the same set)."""
    same_set = ref_labels is None
    num_classes, cls_q, cls_r, counts = class_codes(labels, labels if same_set else ref_labels)
    return same_set, num_classes, cls_q, cls_r, counts[cls_q] - int(same_set)


def class_columns(
    labels: torch.Tensor, ref_labels: torch.Tensor, same_set: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each anchor, the reference columns of its class, padded: ``(cols, valid)`` of shape
    ``(B, max class size)``, plus the class ids of anchors/references and the class counts.

    ``O(B x max class size)`` memory; the anchor's own column is invalid when ``same_set``.
    """
    _, cls_q, cls_r, counts = class_codes(labels, ref_labels)
    if len(cls_r) == 0:  # no reference (an empty batch): no column is valid
        cols = torch.zeros(len(labels), 1, dtype=torch.long, device=labels.device)
        return cols, torch.zeros_like(cols, dtype=torch.bool), cls_q, cls_r, counts
    order = torch.argsort(cls_r, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    width = max(int(counts.max()), 1)
    slot = torch.arange(width, device=labels.device)
    table = order[(starts.unsqueeze(1) + slot).clamp_max(len(cls_r) - 1)]  # (K, width)
    table_valid = slot < counts.unsqueeze(1)
    cols, valid = table[cls_q], table_valid[cls_q]
    if same_set:
        valid &= cols != torch.arange(len(labels), device=labels.device).unsqueeze(1)
    return cols, valid, cls_q, cls_r, counts


def compact_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices of the ``True`` entries of each row of a ``(B, R)`` mask.

    Returns ``(cols, valid)``, both ``(B, K)`` with ``K`` the largest row count: row ``i`` lists
    its ``True`` columns in increasing order, padded (with column 0) where ``valid`` is False.
    Memory ``O(B R)``; used to walk e.g. the positives of each anchor without a ``B x B`` loop.
    """
    counts = mask.sum(dim=1)
    k = int(counts.max()) if mask.numel() else 0
    order = torch.sort(mask.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k]
    valid = torch.arange(k, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    return order.masked_fill(~valid, 0), valid
