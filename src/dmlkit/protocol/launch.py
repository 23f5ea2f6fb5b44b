"""A bench trial's training runs as distributed jobs: ``protocol.launcher: torchrun``.

With the default ``local`` launcher the bench worker trains each run (one fold of a search
trial, one final fold model) in its own process. With ``torchrun`` each run becomes a
single-node job of ``protocol.nproc_per_trial`` processes started by PyTorch's own launcher::

    python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N --max-restarts 0 \\
        --log-dir RUN_DIR/launch/torchelastic -m dmlkit.protocol.launch RUN_DIR/launch/spec.json

The worker keeps everything that touches the study (claiming the trial, Optuna's sampler, the
heartbeat, recording the objective): the ranks only train, so a trial's objective is recorded
once, by the worker, whatever the number of ranks. The hand-over goes through files in
``RUN_DIR/launch/``:

``spec.json``
    the run's full experiment config, the class ids of its train / validation / test sets
    (the class-disjoint subsets the bench built; the ranks rebuild exactly these subsets,
    with the transforms :func:`dataset_parts` derives from the config), the data root and
    ``resume``;
``result.json``
    written by rank 0 only, atomically, after training: the run's validation and test
    metrics (what the local launcher's :class:`~dmlkit.training.TrainResult` carries);
``error-rank<r>.json``
    a rank that fails writes its one-line error (``ExceptionClass: first line``), the time and
    ``lost_peer`` (its error is a collective broken by another rank: a consequence); the
    launcher reports the earliest error that is not (the cause: the other ranks' errors are
    usually the collective timeouts or closed connections it provoked), else the rank that
    died without writing one (torchrun's summary in ``torchrun.log`` says how), as a
    :class:`DistributedError`, so the search records the trial as failed with that line and
    goes on;
``torchrun.log``
    the output of torchrun and every rank;
``torchelastic/``
    torchrun's log folders (by default it left one in ``$TMPDIR`` per run).

Torchrun never restarts a failed run (``--max-restarts 0``): retrying is the bench's job
(failed trials are recorded; an interrupted final run resumes from its checkpoint).
``protocol.torchrun.timeout_s`` bounds a run's wall time: the whole job (its own process
session) is sent SIGTERM, then SIGKILL after ``kill_grace_s``, and the trial fails with a
timeout message. The job also gets SIGTERM when the process that started it dies, even by
SIGKILL (``PR_SET_PDEATHSIG``: :func:`dmlkit.protocol.processes.die_with_parent`).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlkit.config import ExperimentConfig, config_from_dict
from dmlkit.data import get_transforms
from dmlkit.distributed import DistributedError, lost_peer, lost_peer_reason, shutdown
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError
from dmlkit.protocol.config import DATA_ROOT_FIX, BenchConfig, TorchrunSettings
from dmlkit.protocol.processes import die_with_parent
from dmlkit.signals import exit_on_signals
from dmlkit.training import train
from dmlkit.training.data_root import load_dataset_at
from dmlkit.utils import atomic_write_json, read_json, read_json_object

__all__ = [
    "LaunchResult",
    "TorchrunLauncher",
    "dataset_parts",
    "launcher_for",
    "rank_main",
    "read_rank_error",
    "silent_rank_error",
    "torchrun_exits",
]

SPEC_FORMAT = "dmlkit-launch-spec/1"
PARTS = ("train", "val", "test")


@dataclass
class LaunchResult:
    """What a distributed training run hands back (the fields of ``TrainResult`` the bench reads)."""

    run_dir: Path
    val_metrics: dict[str, float]
    test_metrics: dict[str, float] | None = None
    best_step: int = 0
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def _classes(dataset) -> list[int]:
    if dataset is None:
        return []
    classes = getattr(dataset, "classes", None)
    if classes is None:
        raise DataError(
            f"the torchrun launcher rebuilds each rank's data from class ids, but {type(dataset).__name__} "
            "has no 'classes': use protocol.launcher: local for this dataset"
        )
    return sorted(int(c) for c in classes)


def dataset_parts(config: ExperimentConfig, classes: Mapping[str, Sequence[int]],
                  data_root: str | Path | None = None) -> dict[str, Any]:
    """``{part: class subset of the configured dataset, or None}`` for train / val / test.

    The same construction as the bench's own (``Bench``: the dataset's ``subset_classes`` with
    the fixed transform; train-time augmentation on the training part unless the trunk is
    frozen), so a run trains on the same rows whichever launcher starts it.
    """
    d = config.data
    full = load_dataset_at(d, data_root, fix=DATA_ROOT_FIX, key="fixed.data")
    out: dict[str, Any] = {}
    for part in PARTS:
        ids = [int(c) for c in classes.get(part) or []]
        if not ids:
            out[part] = None
            continue
        subset = full.subset_classes(ids)
        if d.transform is not None:
            augment = part == "train" and not config.model.frozen_trunk
            subset = subset.with_transform(get_transforms(d.transform, train=augment, image_size=d.image_size))
        out[part] = subset
    return out


def _rank_errors(launch_dir: Path) -> list[tuple[float, int, str, bool]]:
    """``(time, rank, one-line error, lost_peer)`` of every ``error-rank<r>.json`` readable."""
    found = []
    for path in Path(launch_dir).glob("error-rank*.json"):
        try:
            data = read_json(path, "rank error file")
            found.append((float(data["time"]), int(data["rank"]), str(data["error"]), bool(data.get("lost_peer"))))
        except (OSError, DataError, ValueError, KeyError, TypeError):  # DataError: corrupt or nested too deeply
            continue
    return found


def read_rank_error(launch_dir: Path) -> tuple[int, str] | None:
    """The ``(rank, one-line error)`` of a failed run's cause, or ``None``: the earliest error of
    a rank that failed on its own; only when every rank lost a peer (a rank killed silently),
    the earliest of those."""
    found = _rank_errors(launch_dir)
    own = [e for e in found if not e[3]]
    if not (own or found):
        return None
    _, rank, error, _ = min(own or found)
    return rank, error


#: The exit of one rank in torchrun's failure summary: ``rank : 1 (local_rank: 1)`` then
#: ``exitcode : -9 (pid: 26869)``.
_SUMMARY_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_exits(log_path: Path) -> tuple[int | None, dict[int, int]]:
    """``(root-cause rank, {rank: exit code})`` from the failure summary torchrun writes at the
    end of ``torchrun.log`` (negative: killed by that signal); ``(None, {})`` without one."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None, {}
    root = text.rfind("Root Cause (first observed failure):")
    if root < 0:
        return None, {}
    failures = text.rfind("Failures:", 0, root)
    exits = {int(r): int(c) for r, c in _SUMMARY_RANK.findall(text, failures if failures >= 0 else root)}
    cause = _SUMMARY_RANK.search(text, root)
    return (int(cause.group(1)) if cause else None), exits


def _how_it_ended(code: int | None) -> str:
    if code is None:
        return "its exit code is not in torchrun.log: killed? out of memory?"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}: out of memory, a scheduler, by hand?"
    return f"exit code {code}"


def silent_rank_error(launch_dir: Path, nproc: int) -> str | None:
    """When the ranks that reported an error only lost a peer: the line naming the rank that
    died without reporting one (killed by a signal, out of memory), from torchrun's summary of
    the ranks' exits; ``None`` when no such rank can be told."""
    found = _rank_errors(launch_dir)
    if any(not lost for *_, lost in found):
        return None
    reported = {rank for _, rank, _, _ in found}
    cause, exits = torchrun_exits(launch_dir / "torchrun.log")
    silent = [r for r in range(nproc) if r not in reported]
    if cause in silent:
        rank = cause
    else:  # the ranks torchrun stopped itself (SIGTERM) are not the cause
        dead = [r for r in silent if exits.get(r, 0) != 0 and exits[r] != -signal.SIGTERM]
        if dead:
            rank = dead[0]
        elif found and len(silent) == 1 and not exits:
            rank = silent[0]
        else:
            return None
    line = f"rank {rank} of {nproc} died without reporting an error ({_how_it_ended(exits.get(rank))})"
    if found:
        _, lost_rank, error, _ = min(found)
        line += f"; rank {lost_rank} lost contact with it ({error.split(': ', 1)[-1]})"
    return line + f"; see {launch_dir}/torchrun.log"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class TorchrunLauncher:
    """Run one training run as ``nproc`` processes under ``python -m torch.distributed.run``.

    Called like :func:`dmlkit.training.train` (``launcher(config, run_dir, train_set=...,
    val_set=..., test_set=..., resume=...)``), so the bench's stages take it as their
    ``train_fn``. The datasets must be class subsets of the configured dataset (as the bench's
    are): the ranks get their class ids, not the objects.
    """

    def __init__(self, settings: TorchrunSettings | None = None, nproc: int = 2, *,
                 data_root: str | Path | None = None, threads: int | None = None,
                 python: str = sys.executable, env: Mapping[str, str] | None = None) -> None:
        if nproc < 1:
            raise ConfigError(f"nproc_per_trial must be >= 1, got {nproc}")
        self.settings = settings or TorchrunSettings()
        self.nproc = int(nproc)
        self.data_root = None if data_root is None else str(data_root)
        self.threads = threads or self.settings.threads_per_process or max(1, (os.cpu_count() or 1) // self.nproc)
        self.python = python
        self.env = dict(env or {})

    # -- the command line ---------------------------------------------------------------------
    def command(self, spec_path: str | Path, run_id: str = "dmlkit-trial") -> list[str]:
        """The torchrun command line of one run (a single-node job of ``nproc`` ranks)."""
        s = self.settings
        cmd = [self.python, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(self.nproc), "--max-restarts", "0"]
        if s.rdzv_endpoint is None:
            cmd.append("--standalone")  # c10d rendezvous on localhost, a free port per run
        else:
            cmd += ["--rdzv-backend", s.rdzv_backend, "--rdzv-endpoint", s.rdzv_endpoint, "--rdzv-id", run_id]
        # torchelastic's log folders go beside the run (by default one per run in $TMPDIR, kept)
        cmd += ["--log-dir", str(Path(spec_path).parent / "torchelastic")]
        cmd += [*s.extra_args, "-m", "dmlkit.protocol.launch", str(spec_path)]
        return cmd

    def environment(self) -> dict[str, str]:
        """The ranks' environment: this one, with one thread budget per rank."""
        env = {**os.environ, **self.env}
        env["OMP_NUM_THREADS"] = str(self.threads)
        env["DMLKIT_NUM_THREADS"] = str(self.threads)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    # -- one run ------------------------------------------------------------------------------
    def __call__(self, config: ExperimentConfig, run_dir: str | Path, *, train_set=None, val_set=None,
                 test_set=None, resume: bool = False, progress: bool = False, **_: Any) -> LaunchResult:
        run_dir = Path(run_dir)
        launch_dir = run_dir / "launch"
        launch_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*launch_dir.glob("error-rank*.json"), launch_dir / "result.json"]:
            stale.unlink(missing_ok=True)  # left by an earlier attempt of this run
        spec = {
            "format": SPEC_FORMAT,
            "config": config.model_dump(mode="json"),
            "run_dir": str(run_dir.resolve()),
            "data_root": self.data_root,
            "classes": {"train": _classes(train_set), "val": _classes(val_set), "test": _classes(test_set)},
            "resume": bool(resume),
            "threads": self.threads,
        }
        if not spec["classes"]["train"]:
            raise DataError(f"training run {run_dir} has no training classes")
        spec_path = atomic_write_json(launch_dir / "spec.json", spec)
        self.run(self.command(spec_path, run_id=f"dmlkit-{os.getpid()}-{time.time_ns()}"),
                 launch_dir, run_dir)
        return self.collect(launch_dir, run_dir)

    def run(self, cmd: Sequence[str], launch_dir: Path, run_dir: Path) -> None:
        """Start the job in its own process session and wait; a failure or timeout raises.
        When this process is stopped meanwhile (SIGTERM, Ctrl-C), the whole job is stopped
        (:meth:`_stop`) before the interruption goes on (SIGTERM: ``SystemExit(143)``)."""
        timeout = self.settings.timeout_s
        # SIGTERM raises SystemExit here (it ended this process at once and left the job running)
        with open(launch_dir / "torchrun.log", "ab") as log, exit_on_signals():
            # its own session (a timeout stops the whole job); SIGTERM when this process dies,
            # even by SIGKILL (PR_SET_PDEATHSIG: torchrun then stops its ranks)
            proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                    start_new_session=True, preexec_fn=die_with_parent())
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._stop(proc)
                raise DistributedError(
                    f"training run {run_dir.name} timed out after {timeout:g} s "
                    f"(protocol.torchrun.timeout_s); its {self.nproc} ranks were stopped"
                ) from None
            except BaseException:  # the worker itself is stopped (SIGTERM, Ctrl-C): the job with it
                self._stop(proc)
                raise
        if rc != 0:
            silent = silent_rank_error(launch_dir, self.nproc)
            if silent is not None:  # not the rank that lost contact with it
                raise DistributedError(silent)
            found = read_rank_error(launch_dir)
            if found is not None:
                rank, error = found
                if error.startswith(f"{NonFiniteError.__name__}: "):  # diverged: the run's own outcome,
                    # which the final stage records as a failed run (as it does for one process)
                    raise NonFiniteError(f"rank {rank} of {self.nproc}: {error.split(': ', 1)[1]}")
                raise DistributedError(f"rank {rank} of {self.nproc} failed: {error}")
            raise DistributedError(
                f"torchrun exited with code {rc} and no rank reported an error (killed? out of "
                f"memory?): {_tail(launch_dir / 'torchrun.log') or 'no output'}; see {launch_dir}/torchrun.log"
            )

    def _stop(self, proc: subprocess.Popen) -> None:
        for sig, wait in ((signal.SIGTERM, self.settings.kill_grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                # the agent is gone; its ranks may linger a moment in the session
                if sig == signal.SIGTERM:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
            except subprocess.TimeoutExpired:
                continue

    def collect(self, launch_dir: Path, run_dir: Path) -> LaunchResult:
        """Read rank 0's ``result.json``."""
        path = launch_dir / "result.json"
        if not path.exists():
            raise DistributedError(
                f"the ranks of {run_dir.name} exited cleanly but rank 0 wrote no {path.name}; "
                f"see {launch_dir}/torchrun.log"
            )
        data = read_json_object(path, "rank 0 result file")  # corrupt or nested too deeply: one DataError line

        def metrics(values: Mapping[str, Any] | None) -> dict[str, float] | None:
            if values is None:
                return None
            return {k: math.nan if v is None else float(v) for k, v in values.items()}

        return LaunchResult(run_dir=run_dir, val_metrics=metrics(data.get("val_metrics")) or {},
                            test_metrics=metrics(data.get("test_metrics")),
                            best_step=int(data.get("best_step", 0)), world_size=int(data.get("world_size", 1)),
                            extra={k: v for k, v in data.items() if k not in
                                   ("val_metrics", "test_metrics", "best_step", "world_size")})


def launcher_for(config: BenchConfig, *, data_root: str | Path | None = None,
                 threads: int | None = None) -> TorchrunLauncher | None:
    """The bench's training function for ``protocol.launcher`` (``None``: train in-process)."""
    p = config.protocol
    if p.launcher == "local":
        return None
    threads = p.torchrun.threads_per_process or threads  # --threads: per process, ranks included
    return TorchrunLauncher(p.torchrun, p.nproc_per_trial, data_root=data_root, threads=threads)


# -- what each rank runs ----------------------------------------------------------------------
def rank_main(spec_path: str | Path) -> int:
    """One rank of a run: rebuild the datasets and train (``train`` joins the process group);
    rank 0 reports.

    Returns the exit code: 0, or 1 after writing ``error-rank<r>.json``.
    """
    import torch

    spec_path = Path(spec_path)
    launch_dir = spec_path.parent
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        spec = read_json_object(spec_path, "dmlkit launch spec")
        if spec.get("format") != SPEC_FORMAT:
            raise ConfigError(f"{spec_path} is not a dmlkit launch spec ({SPEC_FORMAT})")
        torch.set_num_threads(max(1, int(spec.get("threads") or 1)))
        config = config_from_dict(spec["config"], source=str(spec_path))
        parts = dataset_parts(config, spec["classes"], spec.get("data_root"))
        # train() joins the process group torchrun describes (after checking the batch split)
        result = train(config, Path(spec["run_dir"]), train_set=parts["train"], val_set=parts["val"],
                       test_set=parts["test"], resume=bool(spec.get("resume")), progress=False)
        if rank == 0:
            atomic_write_json(launch_dir / "result.json", {
                "val_metrics": dict(result.val_metrics),
                "test_metrics": None if result.test_metrics is None else dict(result.test_metrics),
                "best_step": int(result.best_step), "world_size": world,
                "steps": int(result.steps), "train_seconds": float(result.train_seconds),
            })
    except BaseException as exc:  # every failure becomes the trial's one line
        import traceback

        traceback.print_exc()
        lost = lost_peer(exc)  # a consequence: the rank that is gone is the cause
        try:
            atomic_write_json(launch_dir / f"error-rank{rank}.json", {
                "rank": rank, "time": time.time(), "lost_peer": lost,
                "error": f"{type(exc).__name__}: {lost_peer_reason(exc)}" if lost else _one_line(exc)})
        except OSError:
            pass
        return 1
    finally:
        shutdown()
    return 0


if __name__ == "__main__":  # python -m dmlkit.protocol.launch SPEC.json (started by torchrun)
    if len(sys.argv) != 2:
        sys.stderr.write("usage: python -m torch.distributed.run ... -m dmlkit.protocol.launch SPEC.json\n")
        sys.exit(2)
    sys.exit(rank_main(sys.argv[1]))
