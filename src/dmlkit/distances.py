"""Pairwise distances and similarities between two sets of embeddings.

Every distance maps ``query (N, D)`` and ``reference (M, D)`` to an ``(N, M)`` matrix and says,
through :attr:`BaseDistance.higher_is_closer`, whether a larger value means *more similar*
(cosine, dot product) or *less similar* (Lp, SNR). Losses and miners only ever ask the
distance object, so they work unchanged with any of them.

Available:

* :class:`CosineSimilarity` - ``s(x, y) = <x, y> / (||x|| ||y||)``.
* :class:`DotProductSimilarity` - ``s(x, y) = <x, y>`` (optionally after L2 normalisation).
* :class:`LpDistance` - ``d(x, y) = ||x - y||_p``; ``p = 2`` is Euclidean, optionally squared.
* :class:`SNRDistance` - ``d(x, y) = Var(y - x) / Var(x)``, the signal-to-noise-ratio distance
  of Yuan et al., "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric Learning",
  CVPR 2019.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.validation import (
    check_finite,
    check_float_matrix,
    check_product_range,
    common_float,
    normalize_rows,
    safe_normalize,
)

__all__ = [
    "BaseDistance",
    "CosineSimilarity",
    "DotProductSimilarity",
    "LpDistance",
    "OFFSET_RATIO",
    "SNRDistance",
    "dominant_offset",
    "get_distance",
    "inputs_checked",
    "rounding_bound",
]


#: True inside :func:`inputs_checked`.
_INPUTS_CHECKED: ContextVar[bool] = ContextVar("dmlkit_distance_inputs_checked", default=False)


@contextmanager
def inputs_checked() -> Iterator[None]:
    """Within the block, a normalising distance skips its NaN/infinity check of its inputs
    (:meth:`BaseDistance.prepare`): the caller has checked them already
    (:class:`~dmlkit.miners.base.BaseMiner`), or checks them with its result in one read from
    the device (:class:`~dmlkit.losses.base.BaseLoss`). Each read makes a GPU's host wait, and
    a training step pays for every one."""
    token = _INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        _INPUTS_CHECKED.reset(token)


class BaseDistance:
    """A pairwise distance or similarity.

    Args:
        normalize_embeddings: L2-normalise both inputs before comparing them (scale-safe:
            :func:`dmlkit.validation.safe_normalize`, so any finite float32 scale gives the
            same result).

    Call the object as ``distance(query, reference=None)``; ``reference=None`` compares the
    query set with itself. Inputs holding NaN or infinity, and (without normalisation) inputs
    whose squared norms overflow (or underflow) the floating type raise
    :class:`~dmlkit.exceptions.NonFiniteError` instead of returning infinite, NaN or
    meaningless values (:meth:`prepare`).
    """

    higher_is_closer: bool = False
    name: str = "base"

    def __init__(self, normalize_embeddings: bool = True) -> None:
        self.normalize_embeddings = normalize_embeddings

    # -- public API -------------------------------------------------------------------------
    def __call__(self, query: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        return self.pairwise(query, reference)

    def pairwise(self, query: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(N, M)`` matrix between every query row and every reference row."""
        query, reference = self._prepare(query, reference)
        return self._pairwise(query, reference)

    def paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The ``(N,)`` values between matched rows ``x[i]`` and ``y[i]``."""
        if x.shape != y.shape:
            raise ShapeError(f"paired() needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
        x, y = self._prepare(x, y)
        return self._paired(x, y)

    def closeness(self, values: torch.Tensor) -> torch.Tensor:
        """Map values so that larger always means closer (identity for similarities)."""
        return values if self.higher_is_closer else -values

    def margin(self, closer: torch.Tensor, farther: torch.Tensor) -> torch.Tensor:
        """How much farther ``farther`` is than ``closer``: ``d(far) - d(close)`` or ``s(close) - s(far)``."""
        return closer - farther if self.higher_is_closer else farther - closer

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x / ||x||_2`` per row if ``normalize_embeddings`` (overflow/underflow-safe), else ``x``.

        Outside autograd (evaluation, indexes, applications) a float32 ``x`` is normalised in
        float64 and rounded once, so the rows are the same whatever the device or BLAS: a
        float32 norm's summation order moves a row by an ulp, which reorders references whose
        closeness differs by less than that (a GPU and a CPU then disagree on the metrics).
        Under autograd (losses) the float32 computation is kept.
        """
        if not self.normalize_embeddings:
            return x
        if x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled()):
            return normalize_rows(x)
        return safe_normalize(x, dim=-1)

    def prepare(self, x: torch.Tensor, name: str = "embeddings") -> torch.Tensor:
        """``x`` checked and :meth:`normalize`-d. Every distance refuses NaN or infinity
        (:class:`~dmlkit.exceptions.NonFiniteError`): with normalisation
        (:func:`dmlkit.validation.check_finite`: such a row normalised to NaN values, silently;
        skipped within :func:`inputs_checked`), without it as part of the check that the
        products this distance forms stay representable
        (:func:`dmlkit.validation.check_product_range`)."""
        if self.normalize_embeddings:
            if not _INPUTS_CHECKED.get():
                check_finite(x, name)
            return self.normalize(x)
        check_product_range(x, name, f"the {self.name} distance without normalisation")
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}(normalize_embeddings={self.normalize_embeddings})"

    # -- to implement -------------------------------------------------------------------------
    def _pairwise(self, query: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------------
    def _prepare(
        self, query: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both inputs checked (2-D floating-point tensors of one width), in one dtype
        (:func:`~dmlkit.validation.common_float`), then :meth:`prepare`-d."""
        if reference is None:
            check_float_matrix(query)
            query = self.prepare(query)
            return query, query
        check_float_matrix(query, "query embeddings")
        check_float_matrix(reference, "reference embeddings")
        if reference.shape[1] != query.shape[1]:
            raise ShapeError(
                f"query {tuple(query.shape)} and reference {tuple(reference.shape)} must both be "
                "(N, D) with the same D"
            )
        query, reference = common_float(query, reference)
        return self.prepare(query, "query embeddings"), self.prepare(reference, "reference embeddings")


class DotProductSimilarity(BaseDistance):
    """``s(x, y) = <x, y>``; larger is closer."""

    higher_is_closer = True
    name = "dot"

    def _pairwise(self, query, reference):
        return query @ reference.T

    def _paired(self, x, y):
        return (x * y).sum(-1)


class CosineSimilarity(DotProductSimilarity):
    """``s(x, y) = <x, y> / (||x|| ||y||)``; larger is closer. Always normalises."""

    name = "cosine"

    def __init__(self, normalize_embeddings: bool = True) -> None:
        if not normalize_embeddings:
            raise ConfigError("CosineSimilarity always normalises; use DotProductSimilarity instead")
        super().__init__(normalize_embeddings=True)

    def __repr__(self) -> str:
        return "CosineSimilarity()"


def rounding_bound(kind: str, d: int, q_max_norm: float, r_max_norm: float,
                   unit_roundoff: float = 2.0**-24) -> float:
    """Worst-case absolute error of a pairwise value summed in floating point in any order, for
    rows of norm at most ``q_max_norm`` and ``r_max_norm``.

    ``kind`` ``"ip"``: ``<x, y>`` is within ``gamma_d sum |x_t y_t| <= (d + 1) u |x| |y|``;
    ``"l2"`` (the expanded form ``|x|^2 + |y|^2 - 2<x, y>``): within ``(d + 4) u (|x| + |y|)^2``
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1; ``u`` the unit
    roundoff, ``2^-24`` in float32); ``"centred_l2"`` (that form less ``D (mean y - mean x)^2``,
    at most ``(|x| + |y|)^2``): four ``u`` more. Three extra ``u`` and 1 % cover the final
    roundings.
    """
    u = unit_roundoff
    scale = q_max_norm * r_max_norm if kind == "ip" else (q_max_norm + r_max_norm) ** 2
    extra = 8 if kind == "centred_l2" else 4
    return 1.01 * (d + extra) * u * scale + 1e-300


class _ZeroSafeSqrt(torch.autograd.Function):
    """``sqrt(max(x, 0))``: exactly 0 where ``x <= 0``, so a loss that counts its non-zero terms
    (``mean_nonzero``) does not count a pair of identical embeddings. Its gradient is the exact
    ``1 / (2 sqrt(x))`` wherever the root is positive, however small (no floor: a floor of
    ``1e-6`` scaled the gradient of a pair closer than ``1e-6`` by ``d / 1e-6``), and 0 where it
    is 0 (the plain square root's is infinite there; a zero distance comes from identical rows,
    whose difference has a zero gradient anyway, or from an expanded form that rounded to or
    below 0, whose value carries no information). A positive root is at least ``sqrt`` of the
    smallest subnormal, so ``1 / (2 root)`` is finite; near pairs reach here recomputed from
    their differences (:func:`_recompute_near_pairs`), whose gradient ``(x - y) / d`` is bounded.
    """

    @staticmethod
    def forward(ctx, squared: torch.Tensor) -> torch.Tensor:
        root = squared.clamp_min(0).sqrt_()
        ctx.save_for_backward(root)
        return root

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (root,) = ctx.saved_tensors
        # the clamp only keeps the masked-out zeros from dividing by 0 (inf * 0 = NaN otherwise)
        out = grad / root.mul(2).clamp_min_(torch.finfo(root.dtype).tiny)
        return out.masked_fill_(root == 0, 0)


def _safe_sqrt(squared: torch.Tensor) -> torch.Tensor:
    """The Euclidean distance from its square (:class:`_ZeroSafeSqrt`)."""
    return _ZeroSafeSqrt.apply(squared)


#: Rows are moved by their mean before the expanded Euclidean form where ``|mean|^2`` exceeds
#: this many times their spread ``E|x - mean|^2``: below it centring would gain at most 4 of
#: float32's 24 bits and would round rows that are exact as given (small integers, whose tied
#: distances then stay tied). :func:`dominant_offset`.
OFFSET_RATIO = 15


def dominant_offset(rows: torch.Tensor, block: int = 8192) -> torch.Tensor:
    """The rows' mean where it dominates their spread (``|mean|^2 > OFFSET_RATIO E|x -
    mean|^2``, :data:`OFFSET_RATIO`), else zeros; in ``rows``' dtype, without gradient. The mean
    is rounded to a multiple of ``q = 2^floor(log2 s)``, ``s^2 = E|x - mean|^2 / D`` the spread
    of one coordinate (of ``2^-23`` times its largest coordinate where the rows are all equal).

    A translation changes no Euclidean distance, but the expanded form ``|x|^2 + |y|^2 - 2<x,
    y>`` rounds with the rows' norms: subtracting this offset from both sides leaves the
    distances and makes that rounding follow the rows' spread. Rounded to ``q``, the offset
    leaves rows that are multiples of ``q`` (integers, quantised features) multiples of it, so
    the subtraction and the expanded form stay exact for them and their tied distances stay
    tied (the unrounded mean, a fraction, turned ties of integer rows into rounding noise that
    the tie rule never saw); what is left of the mean, at most ``q/2`` a coordinate, is below
    the spread. Sums in float64, ``block`` rows at a time (galleries of any size), tensor
    operations only (no host synchronisation on a GPU). Used by :class:`LpDistance` and the
    re-id evaluation."""
    rows = rows.detach()
    n = rows.shape[0]
    total = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
    square = torch.zeros((), dtype=torch.float64, device=rows.device)
    for chunk in rows.split(block):  # float64 accumulation, no float64 copy (12x faster at 1024 x 128)
        total += chunk.sum(0, dtype=torch.float64)
        square += chunk.pow(2).sum(dtype=torch.float64)
    mean = total / max(n, 1)
    offset = mean @ mean
    spread = (square / max(n, 1) - offset).clamp(min=0.0)
    per_coordinate = (spread / max(rows.shape[1], 1)).sqrt()
    step = torch.where(per_coordinate > 0, per_coordinate, mean.abs().max() * 2.0**-23)
    quantum = torch.exp2(torch.floor(torch.log2(step.clamp(min=torch.finfo(torch.float64).tiny))))
    mean = torch.round(mean / quantum) * quantum
    return (mean * (offset > OFFSET_RATIO * spread)).to(rows.dtype)


def _centred(query: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``query - c`` and ``reference - c``, ``c`` the references' :func:`dominant_offset`: the
    same distances, rounded with the rows' spread, not their offset. Rows sharing an offset
    (ReLU features, raw pixels; 64-d rows of 100 + N(0, 1)) had distances of about 11 off by up
    to 0.027 (the rounding of ``|x|^2``: too large for the near-zero recomputation, too small
    to be seen); now 1.3e-6. A self-comparison stays one tensor."""
    shift = dominant_offset(reference)
    moved = query - shift
    return moved, (moved if reference is query else reference - shift)


#: Elements (pairs x features) of one block of :func:`_recompute_near_pairs`.
_NEAR_PAIR_BLOCK = 1 << 22


def _recompute_near_pairs(expanded: torch.Tensor, query: torch.Tensor, reference: torch.Tensor,
                          query_sq_norms: torch.Tensor, reference_sq_norms: torch.Tensor,
                          direct, kind: str = "l2") -> torch.Tensor:
    """``expanded`` with every entry within the rounding bound of zero replaced by
    ``direct(query_rows, reference_rows)``, computed from the differences; on a self-comparison
    (``reference is query``) the diagonal is set to 0.

    The expanded form ``|x|^2 + |y|^2 - 2<x, y>`` cancels catastrophically for near pairs: two
    identical float32 rows of norm 1 and ``D = 128`` read about ``1e-5`` instead of 0 (distance
    ``3e-3``), and a loss that counts its non-zero terms counts them. Entries at or below
    :func:`rounding_bound` (``kind``, the inputs' unit roundoff, the rows' largest norms from
    their squared norms ``*_sq_norms``) are the only ones whose value rounding can hide; only they
    are recomputed, in blocks of at most ``2^22`` elements. ``expanded`` is changed in place
    (it must not be needed by its own backward) and keeps the autograd graph of both forms.
    Costs two host syncs on a GPU (the largest norms; whether any pair is near).
    """
    if expanded.numel() == 0:
        return expanded
    same = reference is query
    if same:  # the diagonal of a self-comparison is exactly 0
        expanded.diagonal().fill_(0)
    with torch.no_grad():
        unit_roundoff = max(torch.finfo(expanded.dtype).eps, torch.finfo(query.dtype).eps) / 2
        if same:
            q_max = r_max = float(query_sq_norms.max())
        else:
            q_max, r_max = torch.stack([query_sq_norms.max(), reference_sq_norms.max()]).tolist()
        bound = rounding_bound(kind, query.shape[1], math.sqrt(q_max), math.sqrt(r_max),
                               unit_roundoff)
        near_mask = expanded <= bound
        # more than the diagonal's zeros (a count: cheaper than clearing the mask's diagonal)
        if int(near_mask.sum()) <= (expanded.shape[0] if same else 0):
            return expanded
    near = near_mask.nonzero()
    if same:
        near = near[near[:, 0] != near[:, 1]]
    step = max(1, _NEAR_PAIR_BLOCK // max(1, query.shape[1]))
    values = torch.cat([
        direct(query[near[k : k + step, 0]], reference[near[k : k + step, 1]])
        for k in range(0, near.shape[0], step)
    ])
    return expanded.index_put_((near[:, 0], near[:, 1]), values.to(expanded.dtype))


class LpDistance(BaseDistance):
    """``d(x, y) = ||x - y||_p``; smaller is closer.

    Args:
        p: the norm's order (2 = Euclidean).
        power: 1 for the distance, 2 for the squared Euclidean distance (``p = 2`` only).
        normalize_embeddings: L2-normalise inputs first (default True, as in the Reality Check).
    """

    higher_is_closer = False
    name = "lp"

    def __init__(self, p: float = 2.0, power: int = 1, normalize_embeddings: bool = True) -> None:
        super().__init__(normalize_embeddings)
        if not p > 0:
            raise ConfigError(f"p must be positive, got {p}")
        if power not in (1, 2):
            raise ConfigError(f"power must be 1 or 2, got {power}")
        if power == 2 and p != 2:
            raise ConfigError("power=2 (squared distance) is only defined here for p=2")
        self.p = float(p)
        self.power = power

    def _pairwise(self, query, reference):
        if self.p == 2:
            # |x|^2 + |y|^2 - 2<x, y> in one fused matmul-add (measured 2-3x faster than
            # separate ops, and unlike torch.cdist it supports bfloat16); raw rows moved by the
            # references' mean (:func:`_centred`: unit rows' |x|^2 = 1 cannot dominate their
            # distances, and the check cost 5 % of contrastive's step at B = 256)
            if not self.normalize_embeddings:
                query, reference = _centred(query, reference)
            q_sq = query.pow(2).sum(1)
            r_sq = q_sq if reference is query else reference.pow(2).sum(1)
            sq = torch.addmm(q_sq.unsqueeze(1) + r_sq.unsqueeze(0), query, reference.T, alpha=-2)
            sq = _recompute_near_pairs(sq, query, reference, q_sq, r_sq, _squared_difference)
            return sq.clamp_min(0) if self.power == 2 else _safe_sqrt(sq)
        if query.dtype in (torch.float16, torch.bfloat16):  # torch's CPU cdist has no such kernel
            wide = torch.cdist(query.float(), reference.float(), p=self.p)
            return _finite(wide.to(query.dtype), self)
        return _finite(torch.cdist(query, reference, p=self.p), self)

    def _paired(self, x, y):
        diff = x - y
        if self.p == 2:
            sq = diff.pow(2).sum(-1)
            return sq if self.power == 2 else _safe_sqrt(sq)
        # torch's norm: a zero gradient at identical rows (the power form's was NaN there) and no
        # underflow of small differences raised to p
        return _finite(torch.linalg.vector_norm(diff, ord=self.p, dim=-1), self)

    def __repr__(self) -> str:
        return (
            f"LpDistance(p={self.p}, power={self.power}, "
            f"normalize_embeddings={self.normalize_embeddings})"
        )


class SNRDistance(BaseDistance):
    """``d(a, b) = Var(b - a) / Var(a)`` (unbiased variances over the D features); smaller is closer.

    Yuan, Chen, Zhang, Xu, "Signal-To-Noise Ratio: A Robust Distance Metric for Deep Metric
    Learning", CVPR 2019. Not symmetric: the anchor's variance is the signal.
    Computed without forming ``N x M x D`` differences: with ``z = b - a``,
    ``sum z^2 = |a|^2 + |b|^2 - 2<a, b>`` and ``mean z = mean b - mean a``, on rows moved by
    their shared offset (:func:`_snr_spread`); ``Var(a)`` from the rows as given.
    """

    higher_is_closer = False
    name = "snr"

    def __init__(self, normalize_embeddings: bool = False) -> None:
        super().__init__(normalize_embeddings)

    def _pairwise(self, query, reference):
        d = query.shape[1]
        if d < 2:
            raise ShapeError("SNRDistance needs at least 2 embedding dimensions")
        # the anchor's variance is not translation-invariant: it stays on the raw rows
        signal = _anchor_variance(query)
        query, reference = _centred(query, reference)
        return (_snr_spread(query, reference) / (d - 1)).clamp_min(0) / signal

    def _paired(self, x, y):
        if x.shape[1] < 2:
            raise ShapeError("SNRDistance needs at least 2 embedding dimensions")
        return torch.var(y - x, dim=1) / _anchor_variance(x).squeeze(1)


def _snr_spread(query: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``(D - 1) Var(b - a)`` for every query row ``a`` and reference row ``b``, without
    forming ``N x M x D`` differences: ``sum z^2 - D (mean z)^2`` with ``z = b - a``.

    ``b - a`` does not change when both rows move by one vector, so callers pass rows centred
    by :func:`_centred` (as :class:`LpDistance` does): the expanded form then rounds with the
    rows' spread, not their shared offset (64-d float32 rows of ``250 + N(0, 1)`` were off by
    1.3e-2 relative and reordered neighbours; now about 1e-7). Near-zero entries (``a == b``,
    or ``b`` a shifted copy of ``a``) are recomputed from the differences: the two
    subtractions cancel and would leave rounding noise."""
    d = query.shape[1]
    q_sq = query.pow(2).sum(1)
    r_sq = q_sq if reference is query else reference.pow(2).sum(1)
    sum_sq = q_sq.unsqueeze(1) + r_sq.unsqueeze(0) - 2 * (query @ reference.T)
    mean_diff = reference.mean(1).unsqueeze(0) - query.mean(1, keepdim=True)
    return _recompute_near_pairs(sum_sq - d * mean_diff.pow(2), query, reference, q_sq, r_sq,
                                 _centred_squared_difference, "centred_l2")


def _squared_difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|y - x|^2`` per row pair."""
    return (y - x).pow(2).sum(1)


def _centred_squared_difference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_t (z_t - mean z)^2`` per row pair, ``z = y - x``: ``(D - 1) Var(y - x)``."""
    z = y - x
    return (z - z.mean(1, keepdim=True)).pow(2).sum(1)


def _anchor_variance(x: torch.Tensor) -> torch.Tensor:
    """``Var(x)`` per row (the SNR's signal), refusing constant rows (the SNR is undefined)."""
    var = x.var(dim=1, keepdim=True)
    if not bool((var > 0).all()):
        raise NonFiniteError(
            "SNRDistance is undefined for an anchor whose features are all equal (zero variance) "
            "or not finite: check the embeddings, or use another distance"
        )
    return var


def _finite(values: torch.Tensor, dist: BaseDistance) -> torch.Tensor:
    """``values`` if all finite, else a clear error (an Lp sum of powers overflowed)."""
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError(
            f"{dist!r} gave NaN or infinity (NaN inputs, or a sum of |x - y|^p beyond the "
            "floating range): check the embeddings, rescale or normalise them, or use a smaller p"
        )
    return values


_REGISTRY: dict[str, type[BaseDistance]] = {
    "cosine": CosineSimilarity,
    "dot": DotProductSimilarity,
    "lp": LpDistance,
    "euclidean": LpDistance,
    "snr": SNRDistance,
}


def get_distance(name: str | BaseDistance, **kwargs) -> BaseDistance:
    """A distance by name (``cosine``, ``dot``, ``euclidean``/``lp``, ``snr``) or pass-through."""
    if isinstance(name, BaseDistance):
        return name
    try:
        cls = _REGISTRY[name.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"unknown distance {name!r}; choose one of {sorted(_REGISTRY)}"
        ) from None
    return cls(**kwargs)
