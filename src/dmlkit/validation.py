"""One validation path for embeddings and labels, shared by every metric, app and command.

Bottom layer (imports only :mod:`dmlkit.exceptions`, numpy and torch), so that ``metrics``,
``apps`` and ``commands`` all refuse the same bad input with the same one-line message
instead of returning silently wrong numbers (issue 11, points 2-4):

* :func:`check_embeddings` - ``(N, D)``, numeric, non-empty, every value finite in float32
  and every row's L2 norm representable in float32 (so a scale-safe normalisation,
  :func:`safe_normalize`, is always possible).
* :func:`check_labels` - integer class ids (integral floats accepted exactly), or strings taken
  as class *names* (kept, and encoded as codes into the sorted names); floats with a fraction,
  NaN, booleans, mixed or other objects are refused.
* :func:`safe_normalize` - ``x / ||x||_2`` computed as ``(x / max|x|) / ||x / max|x| ||``:
  the same vector, but the sum of squares can neither overflow (``|x| ~ 1e19``) nor underflow
  (``|x| ~ 1e-20``), so cosine similarity is scale-invariant across the float32 range.
* :func:`check_float_matrix` / :func:`common_float` - the tensors every loss, miner and
  distance takes: 2-D floating-point torch tensors, a query and a reference set brought to one
  dtype (``torch.promote_types``) before they are multiplied.
* :func:`check_product_range` - for distances that do *not* normalise (dot product, Euclidean,
  SNR): refuses embeddings whose squared norms overflow float32 (the products would be
  infinite or NaN) or are so small that the products lose their precision to underflow.
* :func:`check_shard_batch` / :func:`check_shard_vector` - the batches a shard writer stores
  (:class:`dmlkit.embedding_shards.ShardWriter`): a real ``(B, D)`` array and integer vectors.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dmlkit.exceptions import ConfigError, DataError, NonFiniteError, ShapeError
from dmlkit.label_text import refuse_nul

__all__ = [
    "check_finite", "check_integer", "check_number", "check_parameter_numbers",
    "SEED_LIMIT", "check_embeddings", "check_float_matrix", "check_label_pair", "check_labels",
    "check_product_range", "check_seed", "check_shard_batch", "check_shard_vector", "common_float", "concatenate_normalized", "normalize_rows", "safe_normalize",
]

#: Seeds are ``0 <= seed < SEED_LIMIT``: what numpy's legacy seeding, scikit-learn's
#: ``random_state`` and the config files' ``seed`` accept (a negative one ended in numpy's
#: ValueError traceback mid-run).
SEED_LIMIT = 2**32


def check_seed(value: Any, name: str = "seed", bits: int = 32) -> int:
    """``value`` as a seed (an integer, not a bool, in ``[0, 2**bits)``; ``SEED_LIMIT`` by
    default, 31 bits for a library that stores it in a C ``int``, such as faiss), else one
    :class:`ConfigError` line naming ``name``."""
    if (isinstance(value, bool) or not isinstance(value, int | np.integer)
            or not 0 <= value < min(SEED_LIMIT, 2**bits)):
        raise ConfigError(f"{name} must be a non-negative integer below 2**{min(bits, 32)}, got {value!r}")
    return int(value)


def check_integer(value: Any, name: str, least: int = 1, hint: str = "", most: int | None = None) -> int:
    """``value`` as an ``int`` of at least ``least`` (and at most ``most``, when given): a Python
    or numpy integer, not a bool (``True`` is no count) and not a float (``2.5`` was truncated,
    ``2.0`` hid a computed value), else one :class:`ConfigError` line naming ``name`` (``hint``,
    e.g. what the number counts, follows it). The one check of every count and size option of
    the library; ``most`` (:mod:`dmlkit.limits`) keeps a huge count from overflowing torch or
    numpy, or from running for ever."""
    if (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least
            or (most is not None and value > most)):
        what = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer of at least {least}")
        if most is not None:
            what = f"an integer from {least} to {most}"
        raise ConfigError(f"{name} must be {what}{hint}, got {value!r}")
    return int(value)


def check_number(value: Any, name: str, least: float | None = None) -> float:
    """``value`` as a finite ``float`` (of at least ``least``, when given): a Python or numpy
    real number, not a bool and not NaN or infinity, else one :class:`ConfigError` line naming
    ``name``. The check of every real-valued option of the Python API (a NaN margin mined
    nothing without a word, a NaN ratio failed at the first call with Python's ValueError)."""
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, int | float | np.integer | np.floating):
        try:
            number = float(value)
        except OverflowError:  # an int beyond float's range
            number = math.inf
    if not math.isfinite(number) or (least is not None and number < least):
        what = "a finite number" + ("" if least is None else f" of at least {least:g}")
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return number


def check_parameter_numbers(key: str, factory: Any, params: dict[str, Any]) -> None:
    """Refuse, as :class:`ConfigError` naming ``key.NAME``, a parameter given NaN or infinity,
    a boolean where ``factory``'s default is a number, or anything but a boolean where the
    default is a boolean: these sections are untyped, so ``margin: .nan`` trained NaN losses
    (blamed on the embeddings), ``margin: yes`` trained with 1.0 and ``swap: "False"`` (a
    non-empty string, so true) trained with the swap on, all without a word, where the typed
    sections refuse them."""
    try:
        defaults = {n: p.default for n, p in inspect.signature(factory).parameters.items()}
    except (TypeError, ValueError):  # no signature to read: the numbers alone are checked
        defaults = {}
    for name, value in params.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}.{name} must be a finite number, got {value}")
        default = defaults.get(name)
        number = isinstance(default, int | float) and not isinstance(default, bool)
        if isinstance(value, bool) and number:
            raise ConfigError(f"{key}.{name} is a number (default {default}), got {str(value).lower()}")
        if isinstance(default, bool) and not isinstance(value, bool | np.bool_):
            raise ConfigError(
                f"{key}.{name} is true or false (default {str(default).lower()}), got {value!r}: "
                "write the boolean unquoted"
            )


_F32 = torch.finfo(torch.float32)
#: Largest squared norm accepted by :func:`check_product_range`: ``|x|^2 + |y|^2 + 2|<x, y>|``
#: (the Euclidean expansion) is at most 4x that, still finite in float32.
MAX_SQUARED_NORM = float(_F32.max) / 8
#: Smallest *largest* squared norm accepted by :func:`check_product_range`: below it, products
#: fall into float32's subnormal range (fewer than 24 significant bits) and rankings degrade.
MIN_SQUARED_NORM = float(_F32.tiny) / float(_F32.eps)


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{type(x).__name__}" + (f" of dtype {dtype}" if dtype is not None else "")


class _WritableView:
    """A read-only array's memory through numpy's array interface with its read-only flag off
    (``data = (address, read_only)``): ``np.asarray`` of it is a writable view of the same
    memory, and it keeps the array alive."""

    def __init__(self, arr: np.ndarray) -> None:
        self.array = arr
        self.__array_interface__ = {**arr.__array_interface__, "data": (arr.ctypes.data, False)}


def _as_tensor_view(arr: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(arr)`` without a copy, quiet for a read-only array (a memory-mapped
    index or shard, ``np.frombuffer``): torch warns that writing to it is undefined, and nothing
    here writes to its inputs. The view goes through :class:`_WritableView`: silencing the
    warning with ``warnings.catch_warnings()`` swapped the process's filter list, so calls in
    other threads meanwhile could leave its filter installed or drop one the user added."""
    return torch.from_numpy(arr if arr.flags.writeable else np.asarray(_WritableView(arr)))


def check_embeddings(x: Any, name: str = "embeddings", first_row: int | None = None) -> torch.Tensor:
    """``x`` as a contiguous float32 ``(N, D)`` tensor, or a one-line error.

    ``first_row``: ``x`` is the block of a larger set that starts at that row (the streamed
    evaluation): errors name the rows of the whole set.

    Accepts numpy arrays, torch tensors (the device is kept) and nested sequences of numbers
    of any real dtype (integers are cast). Raises :class:`~dmlkit.exceptions.ShapeError` for
    non-numeric data (strings, objects, booleans, complex numbers), a shape other than
    ``(N, D)`` or an empty array, and :class:`~dmlkit.exceptions.NonFiniteError` for NaN or
    infinite values, values beyond float32's range (``|x| > 3.4e38``), rows whose L2 norm
    exceeds it, and float64 rows wholly below float32's smallest normal number that float32
    cannot hold to its precision (:func:`_refuse_underflow`). Float32 inputs are not copied.
    """
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dtype == torch.bool or t.dtype.is_complex:
            raise ShapeError(f"{name} must be real numbers, got a tensor of dtype {t.dtype}")
    else:
        try:
            arr = np.asarray(x)
        except (TypeError, ValueError) as exc:
            raise ShapeError(f"{name} must be a numeric (N, D) array, got {_describe(x)}") from exc
        if arr.dtype.kind not in "iuf":
            raise ShapeError(
                f"{name} must be real numbers (N, D), got {type(x).__name__} of dtype {arr.dtype}: "
                "pass a float array"
            )
        if arr.dtype == np.float16:
            arr = arr.astype(np.float32)
        t = _as_tensor_view(np.ascontiguousarray(arr))
    if t.dim() != 2:
        raise ShapeError(f"{name} must be 2-D (N, D), got shape {tuple(t.shape)}")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ShapeError(f"{name} is empty (shape {tuple(t.shape)}): pass at least one row and column")
    wide = t if t.dtype == torch.float64 else None
    t = t.to(torch.float32).contiguous()
    # two reductions without temporaries: NaN propagates through amax / amin, so both are
    # finite exactly when every entry is
    hi, lo = float(t.amax()), float(t.amin())
    peak = max(abs(hi), abs(lo))
    if not math.isfinite(peak):
        bad_rows = ~torch.isfinite(t).all(dim=1)
        bad = int(bad_rows.sum())
        local = int(bad_rows.nonzero()[0, 0])
        first = local + (first_row or 0)
        rows = f"{t.shape[0]}" if first_row is None else f"rows {first_row}-{first_row + t.shape[0] - 1}"
        if wide is not None and bool(torch.isfinite(wide[local]).all()):
            raise NonFiniteError(
                f"{name} hold values beyond float32's range (|x| > 3.4e38) in {bad} row(s), first "
                f"row {first}: rescale them (e.g. divide by their largest norm)"
            )
        raise NonFiniteError(
            f"{name} contain NaN or infinity in {bad} row(s) of {rows}, first row {first}: "
            "check the model output (e.g. a diverged training run) and drop or fix those rows"
        )
    if wide is not None:
        _refuse_underflow(wide, t, name, first_row)
    # |x|_2 <= sqrt(D) max|x|: only rows that large can overflow; compute their norms in float64
    limit = float(_F32.max) / math.sqrt(t.shape[1])
    if peak > limit:
        risky = t.abs().amax(dim=1) > limit
        norms = t[risky].double().norm(dim=1)
        over = int((norms > float(_F32.max)).sum())
        if over:
            raise NonFiniteError(
                f"{name} have {over} row(s) whose L2 norm exceeds float32's range (3.4e38): "
                "rescale them (e.g. divide by their largest norm)"
            )
    return t


def _refuse_underflow(wide: torch.Tensor, t: torch.Tensor, name: str, first_row: int | None) -> None:
    """Refuse float64 rows that float32 cannot hold to its precision. The rule: a row whose
    largest ``|value|`` (``peak``) is below float32's smallest normal number (1.2e-38) is
    refused when its conversion ``t`` moves an entry by more than ``2^-24 peak`` (float32's
    own rounding of the peak). Subnormal numbers are spaced 1.4e-45 apart, so such a row loses
    digits (another direction: 1e-43-scale queries changed neighbours) or becomes zero (1e-300
    was "all zeros"); one whose entries are exact in float32 (``[2^-133, 0, ...]``) passes.
    A row whose peak is normal always converts within it (a subnormal entry is off by at most
    ``2^-150 = 2^-24 tiny``), so only rows wholly below float32's range are looked at."""
    low = torch.maximum(t.amax(dim=1), -t.amin(dim=1)) < float(_F32.tiny)
    if not bool(low.any()):
        return
    rows = low.nonzero().squeeze(1)
    w = wide[rows]
    lost = (t[rows].double() - w).abs().amax(dim=1) > w.abs().amax(dim=1) * float(_F32.eps) / 2
    if bool(lost.any()):
        first = int(rows[lost][0]) + (first_row or 0)
        raise NonFiniteError(
            f"{name} hold {int(lost.sum())} float64 row(s) below float32's smallest normal number "
            f"(1.2e-38) that float32 cannot hold, first row {first}: converted they would lose digits "
            "or become zero; rescale them (one common factor, or L2-normalise the rows)"
        )


def safe_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x / ||x||_2`` along ``dim`` without overflow or underflow of the sum of squares.

    Each slice is first divided by the power of two ``2^e`` just above its largest magnitude
    (exact in floating point; a constant for autograd: the result is invariant to that factor,
    so the gradient is exactly that of ``x / ||x||``), which puts its norm in
    ``[1/2, sqrt(D)]``; all-zero slices stay zero (as with ``F.normalize``) and get a zero
    gradient (``F.normalize`` divides them by its ``eps = 1e-12``, a gradient of ``1e12`` times
    the incoming one, which an optimiser step turns into a row of ``~1e10``; ``x / ||x||`` has
    no derivative at 0, and 0 is the choice that leaves such a row where it is). Other slices
    are unaffected: their scaled norm is at least ``1/2``, far above ``eps``.
    """
    if x.numel() == 0:
        return x
    peak = x.detach().abs().amax(dim=dim, keepdim=True)
    if _plain_normalize_is_safe(x, peak):
        return torch.nn.functional.normalize(x, p=2.0, dim=dim)
    # divide by the power of two at or above the peak: exact, so inputs of ordinary scale give
    # bit-for-bit the result of F.normalize(x)
    _, exponent = torch.frexp(torch.where(peak > 0, peak, torch.ones_like(peak)))
    # in two halves: 2^-e alone overflows for subnormal peaks (e < -126)
    half = torch.div(-exponent, 2, rounding_mode="floor")
    scaled = torch.ldexp(torch.ldexp(x, half.to(x.dtype)), (-exponent - half).to(x.dtype))
    out = torch.nn.functional.normalize(scaled, p=2.0, dim=dim)
    # the forward values are unchanged (a zero slice is 0 / eps = 0); the fill cuts the gradient
    return out.masked_fill(peak == 0, 0.0)


#: Slice peaks in this range need no rescaling: ``F.normalize``'s float32 sum of squares can
#: neither overflow (``peak^2 D <= 2^40 D``) nor lose a term that matters to underflow (a square
#: below ``2^-126`` is under ``2^-86`` of the sum, ``>= peak^2 >= 2^-40``), and no slice is zero.
PLAIN_NORMALIZE_RANGE = (2.0**-20, 2.0**20)


def _plain_normalize_is_safe(x: torch.Tensor, peak: torch.Tensor) -> bool:
    """Whether :func:`safe_normalize` may call ``F.normalize(x)`` itself: a float32/float64
    tensor on the CPU (where reading two numbers costs microseconds; on a GPU it would make the
    host wait, so the rescaling, free of reads, stays) whose every slice peak lies in
    :data:`PLAIN_NORMALIZE_RANGE`, outside tracing (a traced graph must keep the safe path).
    The result and its gradient are then those of the rescaled path bit for bit (the power of two
    scales every intermediate exactly), at 10-12 fewer operations: 0.22 -> 0.14 ms forward +
    backward for 32 x 128 rows, 0.35 -> 0.22 ms for 256 (one thread), which short loss steps such as N-pair and NCA at
    B = 256 spend on each of their normalisations (benchmarks/README.md)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return False
    if torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    low, high = torch.stack(torch.aminmax(peak)).tolist()
    return PLAIN_NORMALIZE_RANGE[0] <= low and high <= PLAIN_NORMALIZE_RANGE[1]


#: Rows per block of :func:`normalize_rows` (bounds its float64 temporaries: 8 MB at d = 128).
NORMALIZE_BLOCK = 8192


def normalize_rows(x: Any) -> Any:
    """``x / ||x||_2`` per row of a float32 ``(N, D)`` array or tensor, divided in float64 and
    rounded once to float32; zero rows stay zero. Not differentiable (use
    :func:`safe_normalize` under autograd).

    The norm is summed in float64 from the float32 entries (no overflow or underflow anywhere
    in float32's range); its summation order changes it by ~1e-16, far below float32's
    rounding, so every device, BLAS and thread count gives the same rows (except where an
    entry falls within 1e-16 of a float32 rounding boundary). A float32 norm would move a row
    by an ulp between them, and reorder references whose closeness differs by less than that.
    A numpy array gives a numpy array; a tensor a tensor on its device. In blocks of
    :data:`NORMALIZE_BLOCK` rows: one float32 output, small float64 temporaries.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu":
            return torch.from_numpy(normalize_rows(x.detach().numpy()))
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        with torch.no_grad():
            for a0 in range(0, x.shape[0], NORMALIZE_BLOCK):
                b = x[a0 : a0 + NORMALIZE_BLOCK].double()
                n = torch.linalg.vector_norm(b, dim=1, keepdim=True)
                out[a0 : a0 + b.shape[0]] = b.div_(n.masked_fill_(n == 0, 1))
        return out
    x = np.ascontiguousarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):  # a non-finite row gives NaN, silently as in torch
        if x.shape[0] <= 64:  # a few queries: the fewest numpy calls
            n = np.sqrt(np.add.reduce(np.square(x, dtype=np.float64), axis=1))
            n[n == 0] = 1
            return (x / n[:, None]).astype(np.float32)
        out = np.empty_like(x)
        for a0 in range(0, x.shape[0], NORMALIZE_BLOCK):
            b = x[a0 : a0 + NORMALIZE_BLOCK]
            n = np.sqrt(np.einsum("ij,ij->i", b, b, dtype=np.float64))
            n[n == 0] = 1
            np.divide(b, n[:, None], out=out[a0 : a0 + b.shape[0]], dtype=np.float64,
                      casting="unsafe")
    return out



def concatenate_normalized(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Each ``(N, D_i)`` part's rows L2-normalised, the parts side by side, and the rows
    normalised again (:func:`normalize_rows`): every part weighs the same whatever its models'
    scale. The "concatenated" evaluation of the fold models (Musgrave et al., *A Metric
    Learning Reality Check*, ECCV 2020: "concatenate the 128-dim embeddings of the 4 models
    ... and then L2 normalize"; their models output unit vectors, where the inner
    normalisation changes nothing, while ``model.normalize: false`` would weigh each part by
    its raw norm)."""
    return normalize_rows(np.concatenate([normalize_rows(p) for p in parts], axis=1))


def check_float_matrix(x: Any, name: str = "embeddings") -> None:
    """Raise :class:`~dmlkit.exceptions.ShapeError` unless ``x`` is a 2-D floating-point torch
    tensor: the input of every loss, miner and distance (a numpy array raised AttributeError and
    an integer tensor torch's RuntimeError deep inside a distance)."""
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name} must be a (N, D) floating-point torch tensor, got "
                         f"{type(x).__name__}: pass torch.as_tensor(x, dtype=torch.float32)")
    if x.dim() != 2:
        raise ShapeError(f"{name} must be (N, D), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ShapeError(f"{name} must be a floating-point tensor, got {x.dtype}: convert it "
                         "with .float()")


def common_float(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` in one dtype, the ``torch.promote_types`` of theirs (float32 and float64
    give float64, bfloat16 and float32 give float32): a product of the two needs one dtype
    (float32 embeddings with a float64 reference set raised torch's "mat1 and mat2 must have
    the same dtype"). Tensors already in that dtype are returned as they are (no copy)."""
    common = torch.promote_types(x.dtype, y.dtype)
    return x.to(common), y.to(common)


def check_finite(x: torch.Tensor, name: str = "embeddings") -> float:
    """The largest ``|value|`` of a floating-point tensor ``x`` (0 for an empty one), or
    :class:`~dmlkit.exceptions.NonFiniteError` when it holds NaN or infinity: the one
    finiteness check of every distance's inputs (a normalising distance turned such a row into
    NaN values without a word). One read from the device (NaN propagates through ``aminmax``,
    so both ends are finite exactly when every entry is)."""
    if x.numel() == 0:
        return 0.0
    with torch.no_grad():
        low, high = torch.stack(torch.aminmax(x.detach())).tolist()
    peak = max(abs(low), abs(high))
    if not math.isfinite(peak):
        raise NonFiniteError(f"{name} contain NaN or infinity: check the model output")
    return peak


def check_product_range(x: torch.Tensor, name: str = "embeddings", what: str = "this distance") -> None:
    """Refuse embeddings whose inner products or squared distances are not representable in
    ``x``'s floating type (used by distances that do not normalise).

    Raises :class:`~dmlkit.exceptions.NonFiniteError` when some row's squared norm exceeds
    ``finfo.max / 8`` (``|x|^2 + |y|^2 - 2<x, y>`` could overflow) or when the *largest* squared
    norm is nonzero but below ``finfo.tiny / finfo.eps`` (every product is subnormal or zero).
    """
    if x.numel() == 0 or not x.dtype.is_floating_point:
        return
    info = torch.finfo(x.dtype)
    big, small = float(info.max) / 8, float(info.tiny) / float(info.eps)
    p = check_finite(x, name)
    with torch.no_grad():
        xd = x.detach()
        if p == 0.0:
            return
        # the largest squared norm lies in [p^2, D p^2]: compute it only when that range
        # reaches a limit
        d = xd.shape[-1] if xd.dim() else 1
        if p * p >= small and d * p * p <= big:
            return
        sq = float((xd.double() / p).pow(2).sum(-1).max()) * p * p
    if sq > big:
        raise NonFiniteError(
            f"{name} are too large for {what} in {x.dtype} (largest squared norm {sq:.3g} > "
            f"{float(info.max) / 8:.3g}: products overflow); rescale them, or use a normalising "
            "distance such as cosine"
        )
    if sq < small:
        raise NonFiniteError(
            f"{name} are too small for {what} in {x.dtype} (largest squared norm {sq:.3g}: "
            "products underflow and lose precision); rescale them, or use a normalising "
            "distance such as cosine"
        )


def check_labels(
    labels: Any,
    n: int | None = None,
    name: str = "labels",
    *,
    class_names: list[str] | None = None,
) -> tuple[np.ndarray, list[str] | None]:
    """Validated class labels as ``(int64 array of shape (n,), class_names or None)``.

    * Integer labels (any signed/unsigned integer dtype, numpy or torch, or Python ints) are
      returned as int64, class names ``None``. Floats are accepted only when every value is a
      finite integer exactly representable (``|x| < 2^53``); ``0.1`` or NaN is refused, never
      truncated.
    * String labels (``str`` / ``bytes`` / an object array of strings) are class *names*: the
      result holds codes into ``class_names``, the sorted distinct names
      (``class_names[codes[i]] == labels[i]``). Pass the ``class_names`` of a first set (e.g.
      the query labels) to encode a second set (the reference labels) with the same codes;
      names new to the second set are appended after the sorted ones.
    * A class name holding a NUL character (``"a\\x00"``, which numpy's string arrays would
      merge with ``"a"``) raises :class:`~dmlkit.exceptions.DataError`.
    * Anything else (booleans, complex, mixed or other objects, not 1-D, length != ``n``)
      raises :class:`~dmlkit.exceptions.ShapeError` with one line saying what to pass.
    """
    if isinstance(labels, torch.Tensor):
        t = labels.detach().cpu()
        if t.dtype == torch.bool or t.dtype.is_complex:
            raise ShapeError(f"{name} must be integer class ids or class-name strings, got dtype {t.dtype}")
        arr = t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
    else:
        try:
            # lists as objects first: numpy would silently turn ["a", 1] into strings
            arr = np.asarray(labels, dtype=object) if isinstance(labels, list | tuple) else np.asarray(labels)
        except (TypeError, ValueError) as exc:
            raise ShapeError(f"{name} must be a 1-D array of class ids or names, got {_describe(labels)}") from exc
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        want = f"({n},)" if n is not None else "(N,)"
        raise ShapeError(f"{name} must have shape {want} (one label per embedding row), got {arr.shape}")
    kind = arr.dtype.kind
    if kind == "O":
        kinds = {type(v) for v in arr.tolist()}
        if not kinds:  # an empty list
            arr, kind = arr.astype(np.int64), "i"
        elif all(issubclass(k, str) for k in kinds):
            _refuse_nul_names(arr.tolist(), name)  # before numpy's str array drops trailing NULs
            arr, kind = arr.astype(str), "U"
        elif kinds and all(issubclass(k, int | np.integer) and not issubclass(k, bool | np.bool_) for k in kinds):
            try:
                arr, kind = arr.astype(np.int64), "i"
            except OverflowError:
                raise ShapeError(f"{name} hold integers beyond int64's range") from None
        elif kinds and all(issubclass(k, float | np.floating | int | np.integer) for k in kinds) and not any(
            issubclass(k, bool | np.bool_) for k in kinds
        ):
            arr, kind = arr.astype(np.float64), "f"
        else:
            found = ", ".join(sorted(k.__name__ for k in kinds))
            raise ShapeError(
                f"{name} must be all integer class ids or all class-name strings, got values of "
                f"type {found}: convert them to one of those"
            )
    if kind == "S":
        try:
            arr, kind = np.char.decode(arr, "utf-8"), "U"
        except UnicodeDecodeError:
            raise ShapeError(f"{name} are bytes that are not UTF-8 text: decode them first") from None
    if kind == "U":
        uniq, inverse = np.unique(arr, return_inverse=True)
        _refuse_nul_names(uniq.tolist(), name)
        if class_names is not None:
            vocab = {c: i for i, c in enumerate(class_names)}
            new = sorted(set(uniq.tolist()) - vocab.keys())
            names = [*class_names, *new]
            vocab.update({c: len(class_names) + j for j, c in enumerate(new)})
            codes = np.asarray([vocab[c] for c in uniq.tolist()], dtype=np.int64)[inverse]
            return codes.reshape(-1), names
        return inverse.astype(np.int64).reshape(-1), [str(c) for c in uniq.tolist()]
    if class_names is not None:
        raise ShapeError(
            f"{name} are numbers but the other label set holds class names (strings): use the same "
            "kind of labels for both"
        )
    if kind in "iu":
        if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ShapeError(f"{name} hold integers beyond int64's range")
        return np.ascontiguousarray(arr, dtype=np.int64), None
    if kind == "f":
        if not np.isfinite(arr).all():
            bad = int((~np.isfinite(arr)).sum())
            raise ShapeError(
                f"{name} contain {bad} NaN or infinite value(s): every row needs an integer class "
                "id or a class-name string; drop or fix those rows"
            )
        frac = arr != np.round(arr)
        if frac.any():
            first = int(np.flatnonzero(frac)[0])
            raise ShapeError(
                f"{name} must be integer class ids or class-name strings, got fractional floats "
                f"(e.g. {float(arr[first])!r} at row {first}); map each class to an integer id "
                "(e.g. np.unique(labels, return_inverse=True)[1])"
            )
        if arr.size and float(np.abs(arr).max()) >= 2.0**53:
            raise ShapeError(f"{name} hold floats too large to be exact integer class ids: pass int64 labels")
        return arr.astype(np.int64), None
    raise ShapeError(
        f"{name} must be integer class ids or class-name strings, got dtype {arr.dtype}: "
        "pass an int array or strings"
    )


def _refuse_nul_names(names: list[str], what: str) -> None:
    """Refuse class names holding a NUL character: numpy's string arrays drop trailing NULs,
    so ``"a\\x00"`` and ``"a"`` were one class."""
    for label in names:
        refuse_nul(label, what)


def check_label_pair(
    query_labels: Any, nq: int, reference_labels: Any | None, nr: int,
    names: tuple[str, str] = ("query labels", "reference labels"),
) -> tuple[torch.Tensor, torch.Tensor | None, list[str] | None]:
    """Query and reference labels (:func:`check_labels`) encoded together: class-name strings
    share one code table (each set coded alone, code 0 of one could name another class than
    code 0 of the other), and names on one side with numbers on the other are refused.
    ``names``: how errors call the two sets (e.g. query and gallery ids)."""
    ql, class_names = check_labels(query_labels, nq, names[0])
    if reference_labels is None:
        return torch.from_numpy(ql), None, class_names
    rl, ref_names = check_labels(reference_labels, nr, names[1], class_names=class_names)
    if class_names is None and ref_names is not None:  # else integer ids meet codes of sorted names
        raise ShapeError(f"{names[1]} are class-name strings but the {names[0]} are numbers: use the "
                         "same kind of labels for both")
    return torch.from_numpy(ql), torch.from_numpy(rl), ref_names


def check_shard_batch(x: Any) -> np.ndarray:
    """A batch of embeddings to store (a shard writer's input) as a real ``(B, D)`` numpy array,
    ``D > 0`` (a torch tensor is moved to the CPU as float32); :class:`ShapeError` otherwise."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().float().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iuf":
        raise ShapeError(f"embeddings must be real numbers (B, D), got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ShapeError(f"embeddings must be 2-D (B, D) with D > 0, got shape {arr.shape}")
    return arr


def check_shard_vector(x: Any, n: int, name: str) -> np.ndarray:
    """``n`` integer labels or ids to store beside a batch of ``n`` embeddings, as int64;
    :class:`ShapeError` (another shape) or :class:`DataError` (not integers) otherwise."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.shape != (n,):
        raise ShapeError(f"{name} must have shape ({n},) to match the embeddings, got {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise DataError(f"shard {name} must be integers, got dtype {arr.dtype}: encode class names "
                        "as integer ids (keep the names in the manifest's metadata)")
    return arr.astype(np.int64, copy=False)
