"""Audit fixes of the protocol's storage check and distributed launch (the bench runner,
``dmlkit.protocol.launch``, ``dmlkit.distributed``)."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from _reference import SMALL_BENCH_FIXED, tiny_alphadigits_bench
from dmlkit.cli import app, main
from dmlkit.distributed import DistributedError
from dmlkit.exceptions import ConfigError
from dmlkit.protocol import stages
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.launch import TorchrunLauncher
from dmlkit.protocol.runner import Bench
from dmlkit.protocol.stages import release_claims
from dmlkit.training import train
from dmlkit.utils import process_alive

BASE = {
    "name": "t",
    "fixed": copy.deepcopy(SMALL_BENCH_FIXED),
    "protocol": {"trials": 3},
    "methods": [{"name": "triplet", "loss": {"name": "triplet"},
                 "search": {"loss.margin": {"low": 0.01, "high": 1.0}}}],
}


def _with_storage(url):
    data = copy.deepcopy(BASE)
    data["protocol"]["storage"] = url
    return bench_config_from_dict(data)


@pytest.mark.parametrize("url", ["mysql://alice@db/studies", "mysql+pymysql://alice:s3cret@db/studies",
                                 "oracle://alice@db/studies", "mssql+pyodbc://alice@db/studies"])
def test_an_unsupported_database_is_refused_naming_the_supported_ones(url):
    """Only SQLite and PostgreSQL are supported: a mysql:// URL passed validation (and failed
    later, inside Optuna / SQLAlchemy, or ran on an engine nobody tests)."""
    with pytest.raises(ConfigError, match=r"not supported.*sqlite:///.*postgresql://") as info:
        _with_storage(url)
    assert "s3cret" not in str(info.value)  # named by its scheme: the URL may hold a password


@pytest.mark.parametrize("url", ["sqlite:///tmp/x/study.db", "postgresql://alice@db:5432/studies",
                                 "postgres://alice@db/studies", "postgresql+psycopg://alice@db/studies"])
def test_sqlite_and_postgresql_urls_are_accepted(url):
    assert _with_storage(url).protocol.storage == url


# -- final-run claims: a finishing runner leaves a live worker's claims alone ------------------
#: A worker process that claims one final run (as ``FinalStage.run_method(claim=True)`` does),
#: says so, holds it ``argv[2]`` seconds and exits without finishing it (a worker that died).
CLAIMER = """
import sys, time
from pathlib import Path
from dmlkit.protocol.stages import _claim
assert _claim(Path(sys.argv[1]))
print("claimed", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _claimer(run_dir: Path, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CLAIMER, str(run_dir), str(hold_s)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_release_claims_removes_only_the_claims_of_dead_processes(tmp_path):
    live_dir = tmp_path / "final" / "m" / "seed0" / "fold0"
    dead_dir = tmp_path / "final" / "m" / "seed0" / "fold1"
    live = _claimer(live_dir, 30)
    dead = _claimer(dead_dir, 0)
    dead.wait(timeout=30)
    try:
        assert release_claims(tmp_path) == 1
        assert (live_dir / ".claimed").exists() and not (dead_dir / ".claimed").exists()
        # another process cannot take a live claim; a dead one's run is claimed again
        assert not stages._claim(live_dir) and stages._claim(dead_dir)
    finally:
        live.kill()
        live.wait()


#: A worker that finds the claim of a dead worker slowly (its look at the claim takes
#: ``argv[2]`` seconds), takes the run over if it can, says so and stays alive ``argv[3]``
#: seconds (so that its own claim stays live while the other contender looks).
SLOW_TAKEOVER = """
import sys, time
from pathlib import Path
from dmlkit.protocol import stages
look = stages._claim_is_live
def slow_look(path):
    live = look(path)
    time.sleep(float(sys.argv[2]))
    return live
stages._claim_is_live = slow_look
print("took" if stages._claim(Path(sys.argv[1])) else "lost", flush=True)
time.sleep(float(sys.argv[3]))
"""


def test_two_workers_never_both_take_over_a_dead_workers_claim(tmp_path):
    """Both looked at the dead claim, then the first removed it and made its own, and the
    second removed *that* claim and made its own: two workers trained one run."""
    run_dir = tmp_path / "final" / "m" / "seed0" / "fold0"
    _claimer(run_dir, 0).wait(timeout=30)  # a worker that claimed the run and died
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    workers = [subprocess.Popen([sys.executable, "-c", SLOW_TAKEOVER, str(run_dir), "1.0", "4"],
                                stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        said = sorted(w.stdout.readline().strip() for w in workers)
    finally:
        for w in workers:
            w.kill()
            w.wait()
    assert said == ["lost", "took"]


@pytest.mark.filterwarnings("ignore:training did not beat")
def test_a_finishing_runner_neither_releases_nor_trains_a_live_workers_claimed_run(tmp_path, data_root,
                                                                                   monkeypatch):
    """Two runners on one study: a worker (``--worker --stage final``) trains final run seed 0
    fold 0 while the coordinator reaches its final stage. The coordinator removed every claim
    (release_claims) and trained every run without claiming, so both trained the same run at
    once. It now trains the other runs, waits while the worker is alive, and trains the run
    itself once the worker died without finishing it."""
    import torch

    monkeypatch.setattr(stages, "CLAIM_POLL_S", 0.2)
    config = bench_config_from_dict(tiny_alphadigits_bench(
        "claims", {"num_classes": 16, "folds": 2, "trials": 1, "seeds": [0], "pretrained": False,
                   "storage": f"sqlite:///{tmp_path}/study.db"},
        [{"name": "contrastive", "loss": {"name": "contrastive"}}],
        model={"embedding_size": 8}, sampler={"samples_per_class": 2, "batches_per_epoch": 1}))
    bench_dir = tmp_path / "bench"
    claimed = bench_dir / "final" / "contrastive" / "seed0" / "fold0"
    worker = _claimer(claimed, 6)
    trained = []

    def train_fn(cfg, run_dir, **kw):
        trained.append((Path(run_dir), worker.poll() is not None))
        return train(cfg, run_dir, **kw)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = Bench(config, bench_dir, data_root=data_root, train_fn=train_fn).run(stage="final")
    finally:
        torch.set_num_threads(before)
        worker.kill()
        worker.wait()
    assert [p.name for p, _ in trained] == ["fold1", "fold0"]
    assert trained[1] == (claimed, True), "the live worker's run was trained while it was alive"
    assert results["methods"]["contrastive"]["concatenated"]["map_at_r"]["mean"] is not None


# -- SIGTERM stops the bench's children --------------------------------------------------------
#: A stand-in torchrun job: a process that starts a child (a rank) and writes both pids.
JOB = ("import os, subprocess, sys, time; "
       "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
       "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {p.pid}'); "
       "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)")

#: ``run_job(folder, name)``: what a bench worker does with ``launcher: torchrun``: one run as a
#: job under :class:`TorchrunLauncher`; its own pid goes to ``folder/name.worker``.
WORKER_MODULE = f"""
import os, sys
from pathlib import Path
from dmlkit.protocol.config import TorchrunSettings
from dmlkit.protocol.launch import TorchrunLauncher

JOB = {JOB!r}


def run_job(folder, name):
    folder = Path(folder)
    (folder / (name + ".worker")).write_text(str(os.getpid()))
    TorchrunLauncher(TorchrunSettings(kill_grace_s=5), 2).run(
        [sys.executable, "-c", JOB, str(folder / (name + ".job"))], folder, folder / name)
"""

#: The bench's side: one job in this process, or two worker processes each running a job.
PARENT = """
import sys
from benchworker import run_job
from dmlkit.protocol.processes import run_worker_processes
folder, mode = sys.argv[1], sys.argv[2]
if mode == "launch":
    run_job(folder, "w0")
else:
    run_worker_processes(run_job, [(folder, "w0"), (folder, "w1")], ["w0", "w1"], grace_s=10)
"""


def _pids_of(folder: Path, names, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((folder / name).exists() for name in names):
            return [int(p) for name in names for p in (folder / name).read_text().split()]
        time.sleep(0.1)
    raise AssertionError(f"the processes did not start in {timeout_s:g} s: {sorted(os.listdir(folder))}")



@pytest.mark.parametrize("mode", ["launch", "workers"])
def test_sigterm_stops_every_process_the_bench_started(tmp_path, mode):
    """SIGTERM to a bench (``kill``, a scheduler's time limit) ended it at once: its worker
    processes and their torchrun jobs (own process sessions) ran on, orphaned. Now the bench
    stops them, waits and exits non-zero (143)."""
    (tmp_path / "benchworker.py").write_text(WORKER_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), mode], env=env)
    try:
        names = ["w0.worker", "w0.job"] + (["w1.worker", "w1.job"] if mode == "workers" else [])
        children = _pids_of(tmp_path, names)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(process_alive(pid) for pid in children):
        time.sleep(0.1)
    survivors = [pid for pid in children if process_alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes {survivors} outlived the bench"


# -- a rank that dies silently is the one the failed trial names -------------------------------
#: The ranks of a run (``rank_main``, whose training is replaced): they join the gloo group,
#: then rank 1 is killed (SIGKILL: the kernel's out-of-memory killer, a scheduler) while rank 0
#: is in a collective, whose error ("Connection closed by peer") rank 0 writes.
KILLED_RANK = """
import os, signal, sys, time
import torch
import torch.distributed as dist
import dmlkit.protocol.launch as launch
from dmlkit.distributed import init_distributed


def train(config, run_dir, **kw):
    init_distributed()
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    for _ in range(600):
        dist.all_reduce(t)
        time.sleep(0.05)


launch.train = train
launch.dataset_parts = lambda *a, **k: {"train": None, "val": None, "test": None}
sys.exit(launch.rank_main(sys.argv[1]))
"""


class _Classes:
    def __init__(self, classes) -> None:
        import numpy as np

        self.classes = np.asarray(classes)


def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_lost_it(tmp_path):
    """Rank 1 was killed; rank 0's error is the broken collective. The trial blamed rank 0
    ("rank 0 of 2 failed: RuntimeError: [.../pair.cc] Connection closed by peer"); it now names
    rank 1, how it ended (torchrun's exit code, SIGKILL), and that rank 0 lost contact with it."""
    data = copy.deepcopy(BASE)
    data["protocol"].update({"launcher": "torchrun", "nproc_per_trial": 2,
                             "torchrun": {"threads_per_process": 1, "timeout_s": 120}})
    config = bench_config_from_dict(data)
    script = tmp_path / "killed_rank.py"
    script.write_text(KILLED_RANK)
    launcher = TorchrunLauncher(config.protocol.torchrun, 2,
                                env={"PYTHONPATH": os.pathsep.join(sys.path), "DMLKIT_DIST_TIMEOUT": "60"})
    command = launcher.command
    launcher.command = lambda spec, run_id="x": [*command(spec, run_id)[:-3], str(script), str(spec)]
    start = time.monotonic()
    with pytest.raises(DistributedError) as err:
        launcher(config.experiment(config.methods[0]), tmp_path / "run", train_set=_Classes([1, 2]))
    message = str(err.value)
    assert time.monotonic() - start < 90
    assert message.startswith("rank 1 of 2 died without reporting an error"), message
    assert "SIGKILL" in message and "rank 0 of 2 failed" not in message and "\n" not in message


# -- the rank that lost a failed peer says so in one line --------------------------------------
TRAIN = {
    "name": "peer-fails", "seed": 3,
    "data": {"dataset": "binary_alphadigits", "split": {"kind": "default", "val_fraction": 0.25}},
    "model": {"trunk": "small_cnn", "trunk_options": {"widths": [8, 16]}, "pretrained": False,
              "in_channels": 1, "embedding_size": 16},
    "loss": {"name": "triplet", "params": {"margin": 0.2}},
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 20},
    "optimizer": {"preset": "cpu_quick"},
    "training": {"epochs": 1, "device": "cpu", "log_every": 1},
}

#: ``dmlkit train`` whose rank 1 meets a corrupt image at its second step (a DataError of its
#: own) while rank 0 waits in the step's collectives.
PEER_FAILS = """
import os, sys
import dmlkit.training.loop as loop
from dmlkit.exceptions import DataError
step = loop.Trainer.train_step
def failing_step(self, x, y):
    if os.environ.get("RANK") == "1" and self.state.step == 1:
        raise DataError("cannot read image /data/x.png: simulated corrupt image on rank 1")
    return step(self, x, y)
loop.Trainer.train_step = failing_step
from dmlkit.cli import main
main(sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rank_a_failed_peer_left_prints_one_line_naming_it(tmp_path, data_root):
    """Rank 0 printed gloo's 60-line traceback ("RuntimeError: [.../pair.cc:561] Connection
    closed by peer"); it now prints one line naming rank 1 and its error, and exits 2."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(TRAIN))
    (tmp_path / "driver.py").write_text(PEER_FAILS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("WORLD_SIZE", None)
    logs = tmp_path / "logs"
    # torchrun looks at its workers every 5 s, not every 0.1 s: it must not stop rank 0 (SIGTERM)
    # before rank 0's collective has failed on rank 1's exit and rank 0 has said so
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                           "--monitor-interval", "5",
                           "--redirects", "3", "--log-dir", str(logs), str(tmp_path / "driver.py"),
                           "train", str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path / "run"),
                           "--data-root", str(data_root), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    rank0 = next(logs.rglob("0/stderr.log")).read_text()
    rank1 = next(logs.rglob("1/stderr.log")).read_text()
    assert "simulated corrupt image on rank 1" in rank1
    assert rank0.strip(), "torchrun stopped rank 0 before its collective failed"
    assert "Traceback" not in rank0, rank0
    errors = [line for line in rank0.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "rank 1" in errors[0] and "simulated corrupt image" in errors[0], rank0


def test_a_broken_collective_outside_training_is_one_line_too(capsys):
    """A command that is not training (``dmlkit evaluate`` under torchrun) meeting gloo's
    error: one ``error:`` line and exit code 2, not its traceback."""
    def broken() -> None:
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] "
                           "Connection closed by peer [127.0.0.1]:18821. This is typically caused by a "
                           "remote worker crashing. GLHF!")

    app.command("broken-collective")(broken)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["broken-collective"])
    finally:
        app.registered_commands.pop()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().count("\n") == 0 and "lost contact" in err and "Connection closed by peer" in err
    assert "pair.cc" not in err
    with pytest.raises(RuntimeError, match="unrelated"):  # any other error is left as it is
        app.command("other-error")(lambda: (_ for _ in ()).throw(RuntimeError("unrelated")))
        try:
            main(["other-error"])
        finally:
            app.registered_commands.pop()
