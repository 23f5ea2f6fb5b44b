"""Signals and leaks (audit s42, F1-F5): a stop signal is never lost while data-loading workers
fork, workers leave stopping to the main process, an error raised while a stop unwinds is still
that stop, a SIGKILLed bench takes its worker processes and torchrun jobs with it, a truncated
16-bit RGB PNG leaves no open file, and torchrun leaves nothing in ``$TMPDIR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
import yaml
from torch.utils.data import DataLoader, Dataset, TensorDataset

from _reference import grey_image_folder, one_error_line, tiny_image_folder_config
from dmlkit import cli, embeddings
from dmlkit.exceptions import DataError
from dmlkit.protocol.config import TorchrunSettings
from dmlkit.protocol.launch import TorchrunLauncher
from dmlkit.signals import exit_on_signals, ignore_stop_signals, signals_deferred, stop_code
from dmlkit.training import loop
from dmlkit.training.seeding import seed_worker
from dmlkit.utils import process_alive

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# -- F1: a signal that lands inside the fork of the loader's workers ---------------------------
#: The signal the next fork delivers to this process from inside an at-fork callback, where
#: the audit found it (``logging``'s ``_releaseLock``): CPython printed the handler's exception
#: as "Exception ignored" and dropped it.
_ARMED: list[int] = []


def _after_fork_in_parent() -> None:
    if _ARMED:
        os.kill(os.getpid(), _ARMED.pop())
        sum(range(10))  # bytecode: the handler runs here, inside the callback


os.register_at_fork(after_in_parent=_after_fork_in_parent)


def _fork_with(sig: int) -> None:
    """Fork as a DataLoader starts a worker, with ``sig`` arriving inside the fork."""
    _ARMED[:] = [sig]
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    finally:
        _ARMED.clear()


class _ForkingLoader(DataLoader):
    """A DataLoader whose iterator start forks once with ``SIGNAL`` arriving inside the fork."""

    SIGNAL = signal.SIGINT

    def __iter__(self):
        _fork_with(self.SIGNAL)
        return super().__iter__()


@pytest.fixture
def stop_handlers():
    """Ctrl-C raises KeyboardInterrupt, SIGTERM / SIGHUP SystemExit(128 + N), as under the CLI."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with exit_on_signals():
            yield
    finally:
        signal.signal(signal.SIGINT, before)


def _expected(sig: int):
    return KeyboardInterrupt if sig == signal.SIGINT else SystemExit


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_inside_the_fork_is_raised_as_the_deferred_block_ends(stop_handlers, sig):
    with pytest.raises(_expected(sig)) as info:
        with signals_deferred():
            _fork_with(sig)
            reached = True  # not raised inside the block: the fork is not interrupted
    assert reached
    if sig != signal.SIGINT:
        assert info.value.code == 128 + sig


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_embedding_pass_does_not_lose_a_signal_that_lands_in_the_fork(stop_handlers, monkeypatch, sig):
    """The audit's lost Ctrl-C: the signal's exception was dropped inside ``os.fork`` and the
    embedding pass (every validation) went on."""
    monkeypatch.setattr(_ForkingLoader, "SIGNAL", sig)
    monkeypatch.setattr(embeddings, "DataLoader", _ForkingLoader)
    data = TensorDataset(torch.ones(6, 3), torch.zeros(6, dtype=torch.long))
    with pytest.raises(_expected(sig)):
        embeddings.embed(lambda x: x, data, batch_size=2, device="cpu")


@pytest.mark.filterwarnings("ignore")
def test_a_training_epoch_does_not_lose_a_signal_that_lands_in_the_fork(stop_handlers, monkeypatch, tmp_path):
    """Each epoch builds a new DataLoader, so its workers fork every epoch: Ctrl-C was lost in 6
    of about 40 tries in the audit, and training went on."""
    from dmlkit.training import train

    monkeypatch.setattr(loop, "DataLoader", _ForkingLoader)
    config = tiny_image_folder_config("fork-signal", val_fraction=0.0)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "run", data_root=grey_image_folder(tmp_path / "data", classes=4), progress=False)


# -- F2: the workers leave the stop signals to the main process --------------------------------
class _SignalState(Dataset):
    """Each item: which of :data:`STOPS` the loading process ignores, and which it blocks."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        state = [float(signal.getsignal(s) is signal.SIG_IGN) for s in STOPS] + [float(s in blocked) for s in STOPS]
        return torch.tensor(state), 0


def test_embedding_workers_ignore_the_stop_signals_and_do_not_block_them(stop_handlers):
    """A group SIGTERM (``timeout``, systemd) killed the workers while the main process unwound
    (tracebacks, exit 1); a SIGHUP unwound them with dmlkit's handler."""
    emb, _ = embeddings.embed(lambda x: x, _SignalState(), batch_size=1, device="cpu", num_workers=1)
    assert emb.tolist() == [[1, 1, 1, 0, 0, 0]] * 2


def test_training_workers_ignore_the_stop_signals_and_do_not_block_them(stop_handlers):
    loader = DataLoader(_SignalState(), batch_size=1, num_workers=1, worker_init_fn=seed_worker)
    with signals_deferred():  # as the trainer starts them
        started = iter(loader)
    assert [x.tolist() for x, _ in started] == [[[1, 1, 1, 0, 0, 0]]] * 2


def test_ignore_stop_signals_drops_a_signal_pending_since_the_fork():
    pid = os.fork()
    if pid == 0:  # the child: as a worker forked inside signals_deferred
        code = 1
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
            os.kill(os.getpid(), signal.SIGTERM)  # a group SIGTERM while it starts
            ignore_stop_signals(0)
            code = 0 if not signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(STOPS) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_worker_prints_no_traceback_for_a_transfer_the_stopped_main_process_dropped():
    """Stopped while it fetched a batch, the main process dropped the connection to the
    worker's ``resource_sharer`` thread, which printed a ConnectionResetError traceback."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import io

            sys.stderr = io.StringIO()
            ignore_stop_signals(0)
            for error in (ConnectionResetError(104, "Connection reset by peer"), EOFError(), ValueError("shown")):
                sys.excepthook(type(error), error, None)
            os.write(write, sys.stderr.getvalue().encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        printed = pipe.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert printed.strip() == "ValueError: shown"


# -- F2: an error raised while a stop unwinds is still that stop -------------------------------
def _probe(body):
    """Run ``body`` as a CLI command ``probe``: ``(exit code, stderr lines)``."""
    probe = typer.Typer()
    probe.command("probe")(body)
    cli.app.registered_commands.append(probe.registered_commands[0])
    try:
        cli.main(["probe"])
        return 0
    except SystemExit as exc:
        return exc.code
    finally:
        cli.app.registered_commands.pop()


def _dataloader_error_after(sig: int) -> None:
    try:
        os.kill(os.getpid(), sig)
        time.sleep(5)
    except BaseException as stop:
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated.") from (
            None if sig == signal.SIGINT else stop)


@pytest.mark.parametrize("sig", STOPS, ids=lambda s: signal.Signals(s).name)
def test_an_error_raised_while_a_stop_unwinds_is_that_stop(capsys, sig):
    """A group SIGTERM: the SystemExit(143) unwind met torch's "DataLoader worker ... is killed
    by signal" RuntimeError, which went out as a traceback with exit 1."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = _probe(lambda: _dataloader_error_after(sig))
    finally:
        signal.signal(signal.SIGINT, before)
    name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    assert code == 128 + sig
    assert capsys.readouterr().err.splitlines() == [f"interrupted: stopped by {name} (files already written are complete)"]


def test_an_error_after_a_swallowed_stop_signal_is_that_stop_and_the_next_command_starts_afresh(capsys):
    def swallowed() -> None:
        try:  # e.g. a handler that ran inside an at-fork callback: its SystemExit was dropped
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)
        except SystemExit:
            pass
        raise DataError("a later error")

    assert _probe(swallowed) == 129
    assert capsys.readouterr().err.startswith("interrupted: stopped by SIGHUP")

    def plain() -> None:
        raise DataError("a later error")

    assert one_error_line(_probe(plain), capsys.readouterr().err) == "error: a later error"
    assert stop_code(ValueError()) is None


# -- F1 / F2 end to end: `dmlkit train` with data.num_workers=2 ---------------------------------
#: The child takes Ctrl-C, SIGTERM and SIGHUP as a terminal's command does (a suite started in
#: the background of a shell inherits SIGINT ignored).
RUNNER = """
import signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
import dmlkit.cli
dmlkit.cli.main(sys.argv[1:])
"""


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _training(tmp_path: Path) -> subprocess.Popen:
    """A long ``dmlkit train`` (200 epochs, validation every epoch) with 2 loader workers, in its
    own process group; returns once it trains."""
    config = tiny_image_folder_config("stop-me", val_fraction=0.25)
    config["data"].update(root=str(grey_image_folder(tmp_path / "data", classes=16)), num_workers=2)
    config["training"].update(epochs=200, eval_every_epochs=1)
    config["sampler"].update(batches_per_epoch=40)  # workers alive most of the time
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, "train", "config.yaml", "--run-dir", "run", "-q"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    log = tmp_path / "run" / "log.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        # training (an epoch logged), with its 2 loader workers running
        if log.exists() and '"epoch"' in log.read_text() and len(_children(proc.pid)) >= 2:
            return proc
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"the training did not start: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, False), (signal.SIGTERM, True), (signal.SIGHUP, True)],
                         ids=["ctrl-c", "group-sigterm", "group-sighup"])
def test_a_stopped_training_with_loader_workers_exits_128_plus_n_with_one_line(tmp_path, sig, group):
    """Ctrl-C was sometimes lost (training went on); a signal to the process group gave
    tracebacks and, for SIGTERM, sometimes exit 1."""
    proc = _training(tmp_path)
    try:
        (os.killpg if group else os.kill)(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        f"interrupted: stopped by {name} (files already written are complete; the run continues with --resume)"]


# -- F3: a SIGKILLed bench takes its worker processes and torchrun jobs with it ---------------
#: A stand-in job (what torchrun would be): writes its pid, then sleeps.
JOB = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
       "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)")

#: The bench's side: a torchrun job in this process, or two worker processes each in a job.
PARENT = f"""
import os, sys
from pathlib import Path
from dmlkit.protocol.config import TorchrunSettings
from dmlkit.protocol.launch import TorchrunLauncher
from dmlkit.protocol.processes import run_worker_processes

WORKER = '''
import os, sys
from pathlib import Path
from dmlkit.protocol.config import TorchrunSettings
from dmlkit.protocol.launch import TorchrunLauncher
folder, name = Path({{folder!r}}), {{name!r}}
(folder / (name + ".worker")).write_text(str(os.getpid()))
TorchrunLauncher(TorchrunSettings(kill_grace_s=5), 2).run(
    [sys.executable, "-c", {JOB!r}, str(folder / (name + ".job"))], folder, folder / name)
'''
folder, mode = sys.argv[1], sys.argv[2]
if mode == "launch":
    exec(WORKER.format(folder=folder, name="w0"))
else:
    run_worker_processes(exec, [(WORKER.format(folder=folder, name=n), {{}}) for n in ("w0", "w1")],
                         ["w0", "w1"], stagger_s=0)
"""


def _pids_of(folder: Path, names, timeout_s: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all((folder / name).exists() for name in names):
            return [int((folder / name).read_text()) for name in names]
        time.sleep(0.1)
    raise AssertionError(f"the processes did not start in {timeout_s:g} s: {sorted(os.listdir(folder))}")


@pytest.mark.parametrize("mode", ["launch", pytest.param("workers", marks=pytest.mark.slow)])
def test_a_sigkilled_bench_takes_its_workers_and_jobs_with_it(tmp_path, mode):
    """The OOM killer or ``kill -9`` on a bench: its 2 workers ran on for 110 s and finished the
    whole search stage beside a rerun; a torchrun job outlived it by its fold."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), mode])
    children: list[int] = []
    try:
        names = ["w0.worker", "w0.job"] + (["w1.worker", "w1.job"] if mode == "workers" else [])
        children = _pids_of(tmp_path, names)
        if mode == "launch":
            children.remove(proc.pid)  # the bench itself started the job
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(process_alive(pid) for pid in children):
            time.sleep(0.1)
        survivors = [pid for pid in children if process_alive(pid)]
    finally:
        proc.kill()
        proc.wait()
        for pid in children:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes {survivors} outlived the SIGKILLed bench"


# -- F4: a truncated 16-bit RGB PNG ------------------------------------------------------------
def _truncated_rgb16_png(path: Path) -> Path:
    import struct
    import zlib

    rows = np.random.default_rng(0).integers(0, 65535, (64, 64, 3)).astype(">u2")
    raw = b"".join(b"\0" + row.tobytes() for row in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 16, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    path.write_bytes(png[: len(png) // 2])
    return path


def test_a_truncated_16_bit_rgb_png_leaves_no_open_file(tmp_path):
    """The second handle full_depth opens (to decode the other byte order) stayed open when the
    first decode failed: one file descriptor per read while the errors are kept."""
    import gc

    from dmlkit.data import load_image

    path = _truncated_rgb16_png(tmp_path / "rgb16_trunc.png")
    fds = Path("/proc/self/fd")
    before = len(os.listdir(fds)) if fds.exists() else 0
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            with pytest.raises(DataError) as info:
                load_image(path)
            kept.append(info.value)  # e.g. a skip list holding the errors
        held = len(os.listdir(fds)) - before if fds.exists() else 0
        kept.clear()
        gc.collect()
    assert held == 0, f"{held} files left open by 20 failed reads"
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


# -- F5: torchelastic's log folders go beside the run, not into $TMPDIR ----------------------
def test_torchrun_leaves_nothing_in_tmpdir(tmp_path, monkeypatch):
    """Torch's default ``--log-dir``: an empty ``torchelastic_*`` tree in ``$TMPDIR`` for every
    training run, kept (hundreds for a bench)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    launch_dir = tmp_path / "run" / "launch"
    launch_dir.mkdir(parents=True)
    script = tmp_path / "rank.py"
    script.write_text("print('rank ran')\n")
    launcher = TorchrunLauncher(TorchrunSettings(), 1)
    cmd = launcher.command(launch_dir / "spec.json")  # its script replaced by one that prints
    launcher.run([*cmd[:cmd.index("-m", 3)], str(script)], launch_dir, tmp_path / "run")
    assert "rank ran" in (launch_dir / "torchrun.log").read_text()
    assert sorted(os.listdir(tmp)) == [], "torchrun left files in $TMPDIR"
    assert (launch_dir / "torchelastic").is_dir()
