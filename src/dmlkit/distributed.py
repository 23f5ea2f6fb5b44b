"""The few :mod:`torch.distributed` helpers every stage shares (training, embedding, evaluation).

dmlkit runs on PyTorch's own engine: processes are started by ``torchrun`` (one node:
``torchrun --nproc-per-node N``; several: ``--nnodes``/``--rdzv-endpoint``; SLURM: ``srun
torchrun ...``), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``. :func:`init_distributed` joins the process group those variables describe
(NCCL on GPUs, gloo on CPUs) with a timeout on every collective, so a rank that dies or never
arrives ends the job with an error instead of a hang. Without those variables everything here
is a no-op for one process, so the same code runs alone and under ``torchrun``.

The global batch of metric learning: losses and miners must see every rank's embeddings (a
triplet's negative may live on another GPU). :func:`all_gather_with_grad` concatenates the
ranks' embeddings in rank order (rank-major: the global batch in the order a one-process run
would see it, when each rank holds its contiguous share, as the samplers' ``num_replicas`` /
``rank`` give) and sends the gradient of each slice back to the rank that owns it, summed over
ranks (an all-reduce of the gradient; PyTorch's public autograd collectives in
``torch.distributed.nn`` are deprecated in favour of a private module, so this 20-line
:class:`torch.autograd.Function` uses the plain collectives). When every rank computes the same loss ``L`` of the gathered batch, rank ``r``'s
embeddings receive ``W * dL/dx_r``; ``DistributedDataParallel`` averages the parameter
gradients over the ``W`` ranks, so the update is exactly the one-process gradient of ``L``
(no world-size factor to add, unlike pytorch-metric-learning's ``DistributedLossWrapper``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dmlkit.exceptions import ConfigError, DmlkitError

__all__ = [
    "DistributedContext",
    "agree",
    "all_gather_object",
    "all_gather_unequal",
    "all_gather_with_grad",
    "all_reduce_sum",
    "all_reduce_with_grad",
    "barrier",
    "broadcast_object",
    "broadcast_tensors_",
    "check_same_config",
    "config_digest",
    "context",
    "init_distributed",
    "is_main_process",
    "launched_by_torchrun",
    "leaving_alone_on_failure",
    "lost_peer",
    "lost_peer_error",
    "lost_peer_reason",
    "main_process_first",
    "mark_every_rank",
    "on_main",
    "raised_on_every_rank",
    "ranks_by_value",
    "shard_bounds",
    "shutdown",
    "timeout_seconds",
]

#: Seconds a collective may wait for the other ranks before the job fails (default 10 min;
#: ``$DMLKIT_DIST_TIMEOUT`` overrides it, e.g. when rank 0 evaluates a very large split alone).
DEFAULT_TIMEOUT_S = 600
#: The longest collective timeout accepted: 2**31 milliseconds (about 24.8 days). Larger values
#: (``inf``, ``1e30``) overflowed in the conversion to a ``timedelta``: a traceback on every rank.
MAX_TIMEOUT_S = 2**31 // 1000
_T = TypeVar("_T")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(DmlkitError):
    """A distributed job that cannot start or went out of step (exit code 2, one line)."""


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: ``rank`` of ``world_size`` (``0`` of ``1`` alone)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def context() -> DistributedContext:
    """The current process group's rank and size (one process when none is initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedContext()
    return DistributedContext(dist.get_rank(), dist.get_world_size(),
                              _local_rank(), str(dist.get_backend()))


def is_main_process() -> bool:
    """Rank 0 (or no process group): the one process that writes files, logs and progress."""
    return context().is_main


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """``WORLD_SIZE`` > 1 in the environment (torchrun, ``srun torchrun``, or by hand)."""
    env = os.environ if env is None else env
    try:
        return int(env.get("WORLD_SIZE", "1")) > 1
    except ValueError as exc:
        raise DistributedError(f"WORLD_SIZE={env.get('WORLD_SIZE')!r} is not an integer") from exc


def timeout_seconds(env: Mapping[str, str] | None = None) -> float:
    """The collective timeout: ``$DMLKIT_DIST_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_S`."""
    env = os.environ if env is None else env
    raw = env.get("DMLKIT_DIST_TIMEOUT")
    if not raw:
        return float(DEFAULT_TIMEOUT_S)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    return _checked_timeout(value, f"DMLKIT_DIST_TIMEOUT={raw!r}")


def _checked_timeout(value: float, what: str) -> float:
    """``value`` when it is a number of seconds above 0 and at most :data:`MAX_TIMEOUT_S`, else a
    :class:`DistributedError` naming ``what`` (``nan`` passed every comparison before)."""
    if not 0 < value <= MAX_TIMEOUT_S:  # False for nan
        raise DistributedError(f"{what} must be a number of seconds above 0 and at most "
                               f"{MAX_TIMEOUT_S} (about 24 days)")
    return float(value)


def _env_int(name: str, default: int = 0) -> int:
    """``$name`` as a whole number (``default`` when unset); anything else is one error line."""
    raw = os.environ.get(name) or str(default)
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer (torchrun sets it: start the job "
                               "with `torchrun --nproc-per-node N dmlkit ...`)") from None


def _local_rank() -> int:
    """``$LOCAL_RANK`` (0 when unset); a value that is not a whole number is one error line."""
    return _env_int("LOCAL_RANK")


def _check_ranks() -> None:
    """Refuse, in one line, a ``RANK`` outside ``[0, WORLD_SIZE)`` or a ``LOCAL_RANK`` outside
    ``[0, LOCAL_WORLD_SIZE)`` (``WORLD_SIZE`` when unset), or either not a whole number: gloo
    refused them with a C++ assertion ("invalid literal for int()" for ``RANK=abc``) while rank
    0 waited the 10-minute timeout for the process that never came."""
    world = _env_int("WORLD_SIZE", 1)
    local_size = "LOCAL_WORLD_SIZE" if os.environ.get("LOCAL_WORLD_SIZE") else "WORLD_SIZE"
    for name, size_name in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", local_size)):
        value, size = _env_int(name), _env_int(size_name, world)
        if not 0 <= value < size:
            raise DistributedError(f"{name}={value} is outside 0..{size - 1} ({size_name}={size}): each "
                                   f"process of the job needs its own {name} from 0 to {size_name} - 1 "
                                   "(torchrun sets them: start the job with `torchrun --nproc-per-node N "
                                   "dmlkit ...`)")


def init_distributed(device: str | torch.device | None = None, *, backend: str | None = None,
                     timeout_s: float | None = None) -> DistributedContext:
    """Join the process group that torchrun's environment describes; no-op for one process.

    ``backend`` defaults to NCCL when ``device`` is CUDA and gloo otherwise. Every collective
    fails after ``timeout_s`` seconds (default :func:`timeout_seconds`) instead of hanging.
    Missing or malformed launcher variables raise :class:`DistributedError` naming them and
    the command that sets them.
    """
    timeout_s = timeout_seconds() if timeout_s is None else _checked_timeout(timeout_s, f"timeout_s={timeout_s!r}")
    if dist.is_available() and dist.is_initialized():
        return context()
    if not launched_by_torchrun():
        return DistributedContext()
    if not dist.is_available():
        raise DistributedError("this PyTorch build has no torch.distributed: run one process")
    missing = [v for v in _TORCHRUN_VARS if not os.environ.get(v)]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: start the "
            "job with `torchrun --nproc-per-node N dmlkit ...` (several machines: add --nnodes "
            "and --rdzv-endpoint HOST:PORT), which sets them"
        )
    _check_ranks()
    dev = torch.device(device) if device is not None else None
    use_cuda = dev is not None and dev.type == "cuda"
    backend = backend or ("nccl" if use_cuda else "gloo")
    local_rank = _local_rank()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:  # rendezvous failed: unreachable master, timeout
        raise DistributedError(
            f"could not join the process group at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} ({backend}): {str(exc).splitlines()[0]}"
        ) from None
    return context()


#: Seconds :func:`shutdown` waits for the other ranks before leaving a gloo group.
SHUTDOWN_BARRIER_S = 10.0


def shutdown() -> None:
    """Leave the process group (safe to call when none was joined).

    On gloo the ranks first meet at a barrier (``monitored_barrier``, at most
    :data:`SHUTDOWN_BARRIER_S` seconds): a rank that tears its connections down while a peer
    is still using them makes the peer's gloo threads abort the process at exit ("terminate
    called without an active exception", exit -6) after a run that succeeded. A peer that
    never arrives (it failed) only delays the exit by the timeout. A rank that failed on its own
    (:func:`leaving_alone_on_failure`) skips the barrier: its peers may be waiting in another
    collective, and only its exit lets torchrun end the job (waiting for them held the whole job
    for the collective timeout, 10 minutes)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1 and not _LEAVING_ALONE:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=SHUTDOWN_BARRIER_S))
        except RuntimeError:
            pass  # a peer is gone: nothing left to wait for
    dist.destroy_process_group()


_LEAVING_ALONE = False


@contextmanager
def leaving_alone_on_failure() -> Iterator[None]:
    """Mark this rank as leaving the job alone when the block raises an error the other ranks
    did not raise with it (not :func:`mark_every_rank`-ed): :func:`shutdown` then skips its exit
    barrier, so the process exits at once and torchrun stops the others."""
    global _LEAVING_ALONE
    try:
        yield
    except BaseException as exc:
        if context().enabled and not raised_on_every_rank(exc):
            _LEAVING_ALONE = True
            if lost_peer(exc):  # gloo's / NCCL's traceback: one line naming the rank that failed
                raise lost_peer_error(exc) from None
            _record_failure(exc)
        raise


_FAILED_KEY = "dmlkit/failed-rank/{}"


def _store() -> Any:
    """The process group's key-value store (torchrun's agent or rank 0 hosts it: it outlives a
    failed rank), or ``None``."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private helper of torch: no store, no names
        return None


def _record_failure(exc: BaseException) -> None:
    """Leave this rank's one-line error in the store, for the peers that lose contact with it."""
    store = _store()
    if store is None:
        return
    first = (str(exc).strip().splitlines() or [""])[0]
    try:
        store.set(_FAILED_KEY.format(dist.get_rank()), f"{type(exc).__name__}: {first}"[:300])
    except Exception:
        pass


def _failed_peers() -> dict[int, str]:
    """``{rank: one-line error}`` of the peers that recorded a failure (:func:`_record_failure`)."""
    store = _store()
    if store is None:
        return {}
    found = {}
    for rank in range(dist.get_world_size()):
        key = _FAILED_KEY.format(rank)
        try:
            if rank != dist.get_rank() and store.check([key]):
                found[rank] = store.get(key).decode(errors="replace")
        except Exception:
            break
    return found


def lost_peer_error(exc: BaseException) -> DistributedError:
    """One line for a :func:`lost_peer` error on this rank: the rank that failed and its error
    when that rank recorded it (a rank failing inside :func:`leaving_alone_on_failure` does),
    else that a peer failed or was killed, with the gist of ``exc``."""
    ctx = context()
    failed = _failed_peers() if ctx.enabled else {}
    if failed:
        rank, error = min(failed.items())
        return DistributedError(f"rank {ctx.rank} of {ctx.world_size} stopped: rank {rank} failed ({error}); "
                                f"this rank lost contact with it ({lost_peer_reason(exc)})")
    return DistributedError(f"rank {ctx.rank} of {ctx.world_size} lost contact with the other ranks "
                            f"({lost_peer_reason(exc)}): a rank failed or was killed; its own error, if "
                            "any, is printed by that rank (torchrun's summary names it)")


#: What gloo and NCCL say when a collective fails because a peer rank is gone or stopped
#: answering (torch raises some of these as a plain ``RuntimeError``).
_LOST_PEER_TEXT = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                   "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL communicator")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because another rank is gone (it failed, was
    killed or stopped answering): ``torch.distributed``'s own errors (``DistBackendError``...)
    and gloo's / NCCL's plain ``RuntimeError``s about a closed connection or a timeout. Such an
    error is the consequence, not the cause: the rank that is gone says why, if it could."""
    if isinstance(exc, DmlkitError):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _LOST_PEER_TEXT)


def lost_peer_reason(exc: BaseException) -> str:
    """The gist of a :func:`lost_peer` error, one short line: ``Read error [127.0.0.1]:233:
    Connection reset by peer`` (gloo's source location and its advice dropped)."""
    text = " ".join(str(exc).split())
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # "[/__w/pytorch/.../pair.cc:545] "
    text = text.split(". ", 1)[0].rstrip(".")
    return (text[:200] + "...") if len(text) > 200 else (text or type(exc).__name__)


def agree(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` on every rank, then an agreement: when it raised a
    :class:`dmlkit.exceptions.DmlkitError` on any rank, every rank raises one error (marked
    :func:`mark_every_rank`, so rank 0 prints it once): the error itself when every rank met
    the same one, else one line naming the ranks and what each met. For checks that depend on
    each rank's own arguments or files (a data root, a config on a shared disk): without it a
    failure on rank 1 alone left rank 0 waiting in its next collective for 10 minutes. One
    process: plain ``fn(*args, **kwargs)``."""
    if not context().enabled:
        return fn(*args, **kwargs)
    result: Any = None
    failure: DmlkitError | None = None
    try:
        result = fn(*args, **kwargs)
    except DmlkitError as exc:
        failure = exc
    reports = all_gather_object(None if failure is None else (type(failure).__name__, str(failure)))
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return result
    if len(failed) == len(reports) and len({report for _, report in failed}) == 1 and failure is not None:
        raise mark_every_rank(failure)
    listing = "; ".join(f"rank {rank}: {message}" for rank, (_, message) in failed)
    raise mark_every_rank(DistributedError(f"{len(failed)} of {len(reports)} ranks failed to start: {listing}"))


def barrier() -> None:
    if context().enabled:
        dist.barrier()


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape on all ranks) along dim 0, in rank order,
    keeping the autograd graph: the gradient of each slice returns to its rank, summed over
    ranks. Returns ``x`` itself for one process."""
    ctx = context()
    if not ctx.enabled:
        return x
    _check_same_shape(x)
    return _GatherWithGrad.apply(x)


def all_reduce_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ranks, differentiable: the gradient of the sum is all-reduced back
    (each rank's ``x`` receives the sum of every rank's gradient of the result)."""
    if not context().enabled:
        return x
    return _AllReduceWithGrad.apply(x)


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        ctx.rows = x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = dist.get_rank() * ctx.rows
        return grad[start : start + ctx.rows]


class _AllReduceWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = x.detach().clone().contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def all_gather_unequal(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` in rank order when the ranks hold different numbers of
    rows (no gradient): pad to the largest, gather, cut the padding away."""
    ctx = context()
    if not ctx.enabled:
        return x
    sizes = all_gather_object(int(x.shape[0]))
    biggest = max(sizes)
    # NCCL moves CUDA tensors only: CPU inputs travel through the rank's GPU and come back
    device = (torch.device("cuda", torch.cuda.current_device())
              if ctx.backend == "nccl" and x.device.type != "cuda" else x.device)
    padded = torch.zeros((biggest, *x.shape[1:]), dtype=x.dtype, device=device)
    padded[: x.shape[0]] = x.to(device)
    parts = [torch.empty_like(padded) for _ in range(ctx.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0).to(x.device)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's (picklable) ``obj``, in rank order; ``[obj]`` for one process."""
    ctx = context()
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ranks (a new tensor, no gradient); ``x`` for one process."""
    if not context().enabled:
        return x
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s (picklable) ``obj`` on every rank; ``obj`` itself for one process."""
    if not context().enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_tensors_(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's ``tensors`` in place with rank ``src``'s (no-op for one process)."""
    if not context().enabled:
        return
    for t in tensors:
        dist.broadcast(t, src=src)


def mark_every_rank(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised identically on every rank (a bad config, a refused resume): the
    CLI prints it on rank 0 only, so a job's error is one line, not one line per process."""
    exc.dmlkit_every_rank = True  # type: ignore[attr-defined]
    return exc


def raised_on_every_rank(exc: BaseException) -> bool:
    """Whether :func:`mark_every_rank` marked ``exc``."""
    return bool(getattr(exc, "dmlkit_every_rank", False))


def on_main(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` on rank 0 only and hand its result to every rank.

    An exception raised by ``fn`` on rank 0 is re-raised on every rank (the same class and
    message when it pickles, else :class:`DistributedError`), so a refused resume or a bad
    split ends every rank with the same one-line error instead of leaving the other ranks
    waiting in their next collective. One process: ``fn(*args, **kwargs)``.
    """
    ctx = context()
    if not ctx.enabled:
        return fn(*args, **kwargs)
    outcome: tuple[str, Any]
    if ctx.is_main:
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except Exception as exc:  # re-raised on every rank below
            outcome = ("error", exc)
    else:
        outcome = ("ok", None)
    try:
        outcome = broadcast_object(outcome)
    except Exception as exc:  # a peer is gone (or the outcome did not pickle)
        if ctx.is_main and outcome[0] == "error":
            raise outcome[1] from None  # rank 0's own error
        why = " ".join(str(exc).split())[:300]
        raise DistributedError(f"rank {ctx.rank} lost contact with the other ranks while rank 0 ran "
                               f"{getattr(fn, '__name__', 'a step')} (a rank that stopped prints its own "
                               f"error): {why}") from None
    kind, value = outcome
    if kind == "error":
        raise mark_every_rank(value)
    return value


def shard_bounds(n: int, world_size: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """``(start, stop)``: this rank's contiguous share of ``n`` rows, without padding.

    Rank ``r`` of ``W`` gets rows ``[r * n // W, (r + 1) * n // W)``: shares differ by at most
    one row, every row belongs to exactly one rank, and concatenating the shares in rank order
    is the dataset order (unlike :class:`torch.utils.data.DistributedSampler`, which pads with
    duplicates and interleaves).
    """
    ctx = context()
    w = ctx.world_size if world_size is None else int(world_size)
    r = ctx.rank if rank is None else int(rank)
    return r * n // w, (r + 1) * n // w


def config_digest(config: Any) -> str:
    """SHA-256 of a config's canonical JSON (pydantic models, dicts): equal configs, equal digests."""
    data = config.model_dump(mode="json") if hasattr(config, "model_dump") else config
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def ranks_by_value(value: Any) -> dict[Any, list[int]]:
    """Every rank's (picklable, hashable) ``value``, gathered: ``{value: [ranks that hold it]}``,
    in the order of the lowest rank holding each; one entry when the ranks agree (and alone)."""
    groups: dict[Any, list[int]] = {}
    for rank, held in enumerate(all_gather_object(value)):
        groups.setdefault(held, []).append(rank)
    return groups


def check_same_config(config: Any, what: str = "config") -> None:
    """Refuse to start when the ranks were given different configs (one clear line)."""
    groups = ranks_by_value(config_digest(config))
    if len(groups) > 1:
        listing = "; ".join(f"ranks {r} have {d[:12]}" for d, r in groups.items())
        raise ConfigError(f"the ranks were started with different {what}s ({listing}): start "
                          "every rank with the same config file and --set overrides")


def _check_same_shape(x: torch.Tensor) -> None:
    shapes = all_gather_object(tuple(x.shape))
    if len(set(shapes)) > 1:
        raise DistributedError(f"ranks hold batches of different shapes {shapes}: every rank "
                               "must get an equal share of the global batch")


@contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first (e.g. a download or a cache write), then the others."""
    ctx = context()
    if ctx.enabled and not ctx.is_main:
        dist.barrier()
    try:
        yield
    finally:
        if ctx.enabled and ctx.is_main:
            dist.barrier()
