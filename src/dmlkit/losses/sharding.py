"""Sharded loss computation: each rank computes only the terms of its own anchors, exactly.

In a data-parallel job every rank holds the gathered global batch ``E`` (``B`` rows, rank ``r``
owning rows ``[r b, (r + 1) b)``, :func:`dmlkit.distributed.all_gather_with_grad`). By default
(``training.distributed_loss: replicated``) every rank computes the whole loss ``L(E)``: exact,
but ``W`` times the same ``B x B`` work. The losses supported here are, given the global batch,
a sum of per-normaliser means of anchor-local terms::

    L = sum_k  S_k / max(N_k, 1),      S_k = sum_{anchors i} s_k(i),   N_k = sum_i n_k(i)

(``s_k(i)`` depends on anchor ``i``'s row of the ``B x B`` matrix and its mined pairs/triplets
only; ``N_k`` is a count that does not depend on the gradient: pairs, non-zero terms, anchors).
Rank ``r`` computes ``S_k^r`` (its anchors' rows against the whole gathered batch, a
``b x B`` matrix) and ``N_k^r``; the counts are all-reduced (summed over ranks) and the rank's
part is ``L_r = sum_k S_k^r / max(N_k, 1)``, so ``sum_r L_r = L`` exactly and
``dL/dE = sum_r dL_r/dE``.

Gradient bookkeeping (the trainer does this, :meth:`dmlkit.training.Trainer.train_step`): the
backward pass of :func:`~dmlkit.distributed.all_gather_with_grad` sums every rank's gradient of
its slice, so rank ``r``'s own embeddings receive ``sum_q dL_q/dx_r = dL/dx_r``, once (not
``W`` times as when every rank computes ``L``). ``DistributedDataParallel`` then averages the
parameter gradients over the ``W`` ranks, so each rank back-propagates ``W * L_r``: the update
is exactly the one-process gradient of ``L``. The logged loss is ``sum_r L_r`` (all-reduced).

Supported (exact, the formulas of the loss classes themselves):

* ``contrastive`` (:class:`~dmlkit.losses.ContrastiveLoss`): ``S_pos/N_pos + S_neg/N_neg``,
  ``N`` = number of pairs (``mean``) or of non-zero terms (``mean_nonzero``), or
  ``(S_pos + S_neg) / (N_pos + N_neg)`` (``pooled``);
* ``triplet`` (:class:`~dmlkit.losses.TripletMarginLoss`), every reduction, hard/soft margin,
  difference or ratio form, swap, all triplets or a miner's triplets/pairs: ``N`` = triplets (``batch_all``), non-zero
  triplets (``batch_all_nonzero``), or anchors with a positive and a negative (``batch_hard``);
* ``multi_similarity`` (:class:`~dmlkit.losses.MultiSimilarityLoss`): ``N = B`` anchors.

The miner is not sharded: it runs on the whole gathered batch on every rank (as in replicated
mode, so miners that compare an anchor with every reference or normalise over the batch stay
exact), and each rank keeps the pairs/triplets whose anchor is one of its rows. Every other
loss is refused (:func:`check_shardable`): proxy/classification losses own parameters whose
gradient would need its own reduction, and list-wise or set-wise losses (FastAP, lifted
structure, N-pairs, NT-Xent/SupCon, NCA, ...) have not been decomposed and verified here;
wrappers (cross-batch memory, combined losses) likewise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dmlkit.distances import inputs_checked
from dmlkit.distributed import all_reduce_sum, shard_bounds
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses._pairs import (
    check_indices,
    class_columns,
    indices_kind,
    indices_to_masks,
    masked_logsumexp,
    pair_matrix,
    to_pair_indices,
    upcast,
)
from dmlkit.losses.base import BaseLoss, check_inputs, full_precision
from dmlkit.losses.pair_losses import ContrastiveLoss
from dmlkit.losses.pair_weighting_losses import MultiSimilarityLoss
from dmlkit.losses.triplet_losses import (
    SORT_ABOVE_POSITIVES,
    TripletMarginLoss,
    blocked_triplet_sums,
    hinge_triplet_sums,
)

__all__ = [
    "SHARDABLE_LOSSES",
    "LossShare",
    "check_shardable",
    "local_indices",
    "local_share",
    "sharded_loss",
]

Indices = tuple[torch.Tensor, ...]


@dataclass
class LossShare:
    """One rank's share of a loss: differentiable partial sums ``S_k^r`` and counts ``N_k^r``.

    The loss is ``sum_k S_k / max(N_k, 1)`` with ``S_k``/``N_k`` summed over the shares.
    """

    sums: list[torch.Tensor]
    counts: torch.Tensor  # (k,) float64, no gradient

    def finish(self, total_counts: torch.Tensor) -> torch.Tensor:
        """This share's part of the loss, given the counts summed over every share."""
        denom = total_counts.clamp_min(1)
        parts = [s / denom[k].to(s.dtype) for k, s in enumerate(self.sums)]
        return torch.stack(parts).sum()


def _counts(*values: torch.Tensor | int) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def local_indices(indices: Indices, start: int, stop: int) -> Indices:
    """The pairs/triplets of a miner's output whose anchor is in rows ``[start, stop)``, with
    anchors renumbered from 0 (references keep their global index)."""
    if indices_kind(indices) == "triplet":
        a, p, n = indices
        keep = (a >= start) & (a < stop)
        return a[keep] - start, p[keep], n[keep]
    a1, p, a2, n = indices
    k1, k2 = (a1 >= start) & (a1 < stop), (a2 >= start) & (a2 < stop)
    return a1[k1] - start, p[k1], a2[k2] - start, n[k2]


def _own_columns(b: int, start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.arange(b, device=device)
    return rows, rows + start


def _label_masks(labels_l: torch.Tensor, ref_labels: torch.Tensor, start: int):
    """``(pos, neg)`` of local anchors against the global batch; the anchor's own column
    (``start + i``) is not a positive."""
    pos = labels_l.unsqueeze(1) == ref_labels.unsqueeze(0)
    neg = ~pos
    rows, cols = _own_columns(labels_l.shape[0], start, labels_l.device)
    pos[rows, cols] = False
    return pos, neg


def _own_class_columns(labels_l: torch.Tensor, ref_labels: torch.Tensor, start: int):
    cols, valid, cls_q, cls_r, counts = class_columns(labels_l, ref_labels, same_set=False)
    _, own = _own_columns(labels_l.shape[0], start, labels_l.device)
    return cols, valid & (cols != own.unsqueeze(1)), cls_q, cls_r, counts


def _contrastive(loss: ContrastiveLoss, x, ref, labels_l, ref_labels, idx, start) -> LossShare:
    mat = pair_matrix(loss.distance, x, ref)
    if idx is not None:
        a1, p, a2, n = to_pair_indices(idx)
        pos_terms, neg_terms = loss._terms(mat[a1, p], True), loss._terms(mat[a2, n], False)
        n_pos, n_neg = a1.numel(), a2.numel()
    else:
        cols, valid, cls_q, cls_r, counts = _own_class_columns(labels_l, ref_labels, start)
        pos_terms = torch.where(valid, loss._terms(mat.gather(1, cols), True), 0.0)
        neg_terms = loss._dense_negative_terms(mat, cls_q.unsqueeze(1) == cls_r.unsqueeze(0))
        n_pos, n_neg = int(valid.sum()), int((ref_labels.shape[0] - counts[cls_q]).sum())
    if loss.reduction == "pooled":  # one mean over all pairs
        return LossShare([pos_terms.sum() + neg_terms.sum()], _counts(n_pos + n_neg))
    if loss.reduction == "mean_nonzero":  # terms are hinges (>= 0)
        n_pos, n_neg = int(torch.count_nonzero(pos_terms)), int(torch.count_nonzero(neg_terms))
    return LossShare([pos_terms.sum(), neg_terms.sum()], _counts(n_pos, n_neg))


def _triplet(loss: TripletMarginLoss, x, ref, labels_l, ref_labels, idx, start) -> LossShare:
    dist = loss._dist(pair_matrix(loss.distance, x, ref))
    ratio = loss.form == "ratio"
    if idx is not None and indices_kind(idx) == "triplet":
        a, p, n = idx
        d_an = dist[a, n]
        if loss.swap:
            d_pn = loss.distance.paired(upcast(ref[p]), upcast(ref[n]))
            d_an = torch.minimum(d_an, loss._dist(d_pn))
        terms = loss._triplet_term(dist[a, p], d_an)
        if loss.reduction == "batch_all":
            return LossShare([terms.sum()], _counts(a.numel()))
        if loss.reduction == "batch_all_nonzero":
            return LossShare([terms.sum()], _counts(int((terms > 0).sum())))
        hardest = torch.zeros(dist.shape[0], dtype=terms.dtype, device=terms.device)
        hardest = hardest.scatter_reduce(0, a, terms, reduce="amax", include_self=False)
        present = torch.bincount(a, minlength=dist.shape[0]) > 0
        return LossShare([hardest[present].sum()], _counts(int(present.sum())))
    if idx is not None:
        pos_mask, neg_mask = indices_to_masks(idx, dist.shape[0], dist.shape[1], device=dist.device)
    else:
        pos_mask, neg_mask = _label_masks(labels_l, ref_labels, start)
    valid = pos_mask.any(1) & neg_mask.any(1)
    if loss.reduction == "batch_hard":
        hardest_pos, p_idx = dist.masked_fill(~pos_mask, float("-inf")).max(1)
        hardest_neg, n_idx = dist.masked_fill(~neg_mask, float("inf")).min(1)
        if loss.swap:
            d_pn = loss._dist(loss.distance.paired(upcast(ref[p_idx]), upcast(ref[n_idx])))
            hardest_neg = torch.minimum(hardest_neg, d_pn)
        hardest_pos = torch.where(valid, hardest_pos, 0.0)  # no inf / inf in the ratio form
        hardest_neg = torch.where(valid, hardest_neg, 0.0)
        terms = loss._triplet_term(hardest_pos, hardest_neg)
        return LossShare([torch.where(valid, terms, 0.0).sum()], _counts(int(valid.sum())))
    if not valid.any():
        return LossShare([dist.sum() * 0], _counts(0))
    max_pos = int(torch.count_nonzero(pos_mask, dim=1).max())
    if loss.swap or loss.soft_margin or max_pos <= SORT_ABOVE_POSITIVES:
        swap_dist = loss._dist(pair_matrix(loss.distance, ref)) if loss.swap else None
        sums, counts = blocked_triplet_sums(dist, pos_mask, neg_mask, loss.margin,
                                            soft=loss.soft_margin, swap_dist=swap_dist, ratio=ratio)
    else:
        sums, counts = hinge_triplet_sums(dist, pos_mask, neg_mask, loss.margin, ratio=ratio)
    if loss.reduction == "batch_all":
        n = int((torch.count_nonzero(pos_mask, dim=1) * torch.count_nonzero(neg_mask, dim=1)).sum())
        return LossShare([sums.sum()], _counts(n))
    return LossShare([sums.sum()], _counts(int(counts.sum())))


def _multi_similarity(loss: MultiSimilarityLoss, x, ref, labels_l, ref_labels, idx, start) -> LossShare:
    mat = pair_matrix(loss.distance, x, ref)
    if idx is not None:
        pos, neg = indices_to_masks(idx, mat.shape[0], mat.shape[1], device=mat.device)
        pos_lse = masked_logsumexp(-loss.alpha * loss.distance.margin(mat, loss.base), pos, add_one=True)
        neg_lse = masked_logsumexp(-loss.beta * loss.distance.margin(loss.base, mat), neg, add_one=True)
    else:
        cols, valid, cls_q, cls_r, counts = _own_class_columns(labels_l, ref_labels, start)
        pos_vals = mat.gather(1, cols)
        pos_lse = masked_logsumexp(-loss.alpha * loss.distance.margin(pos_vals, loss.base), valid,
                                   add_one=True)
        same = cls_q.unsqueeze(1) == cls_r.unsqueeze(0)  # includes the anchor's own column
        has_neg = counts[cls_q] < ref_labels.shape[0]
        if not bool(has_neg.all()):
            same &= has_neg.unsqueeze(1)
        neg_exp = (-loss.beta * loss.distance.margin(loss.base, mat)).masked_fill(same, float("-inf"))
        neg_lse = torch.where(has_neg, torch.nn.functional.softplus(torch.logsumexp(neg_exp, 1)), 0.0)
    terms = pos_lse / loss.alpha + neg_lse / loss.beta
    return LossShare([terms.sum()], _counts(x.shape[0]))


_Share = Callable[..., LossShare]
#: Loss class -> its share function; exact classes only (a subclass may change the formula).
_SHARES: dict[type[BaseLoss], _Share] = {
    ContrastiveLoss: _contrastive,
    TripletMarginLoss: _triplet,
    MultiSimilarityLoss: _multi_similarity,
}
#: Config names of the losses ``training.distributed_loss: local_anchors`` supports.
SHARDABLE_LOSSES = ("contrastive", "multi_similarity", "triplet")


def check_shardable(loss_fn: object, name: str | None = None) -> None:
    """Raise :class:`~dmlkit.exceptions.ConfigError` unless ``loss_fn`` can be sharded exactly."""
    if type(loss_fn) in _SHARES:
        return
    label = name or type(loss_fn).__name__
    raise ConfigError(
        f"training.distributed_loss=local_anchors does not support the loss {label!r} "
        f"({type(loss_fn).__name__}): only {', '.join(SHARDABLE_LOSSES)} are split exactly by "
        "anchor (without cross-batch memory); use training.distributed_loss=replicated"
    )


def local_share(loss_fn: BaseLoss, embeddings: torch.Tensor, labels: torch.Tensor,
                indices: Indices | None, start: int, stop: int) -> LossShare:
    """The share of ``loss_fn(embeddings, labels, indices)`` whose anchors are rows
    ``[start, stop)``: those rows against every row as reference, and the miner's pairs or
    triplets whose anchor is one of them. Pure (no collective): summing the shares of a
    partition of the rows and calling :meth:`LossShare.finish` gives the whole loss."""
    check_shardable(loss_fn)
    check_inputs(embeddings, labels)
    n = embeddings.shape[0]
    if not 0 <= start <= stop <= n:
        raise ShapeError(f"anchor rows [{start}, {stop}) are not inside the batch of {n} rows")
    if indices is not None:
        check_indices(indices, n, n)
        indices = local_indices(indices, start, stop)
    with full_precision(embeddings), inputs_checked():  # finite: check_inputs above
        ref = upcast(embeddings)
        return _SHARES[type(loss_fn)](loss_fn, ref[start:stop], ref, labels[start:stop], labels,
                                      indices, start)


def sharded_loss(loss_fn: BaseLoss, embeddings: torch.Tensor, labels: torch.Tensor,
                 indices: Indices | None = None) -> torch.Tensor:
    """This rank's part ``L_r`` of ``loss_fn`` on the gathered global batch (rows owned by the
    rank: :func:`~dmlkit.distributed.shard_bounds`), normalisers all-reduced, so that
    ``sum_r L_r`` is the loss of the global batch. One process: the whole loss."""
    start, stop = shard_bounds(embeddings.shape[0])
    share = local_share(loss_fn, embeddings, labels, indices, start, stop)
    return share.finish(all_reduce_sum(share.counts.to(embeddings.device)))  # NCCL: on the GPU
