"""dmlkit in a hostile or unusual environment (audit s41_env): ``COLUMNS=0``, a read-only install
without a writable numba cache, closed or full standard streams, an output encoding that lacks a
character, SIGTERM/SIGHUP during an atomic write, full and read-only disks, a bad
``$DMLKIT_NUM_THREADS``, ``-o /dev/stdout`` into a pipe, and small wording faults.

Command-line tests run ``python -m dmlkit`` (or, where a fault must be injected, a runner that
calls :func:`dmlkit.cli.main`) in a subprocess with the environment or the streams changed.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"


def _env(**changes: str | None) -> dict[str, str]:
    """This process's environment with dmlkit's source first on the path and ``changes`` (``None``
    removes a variable)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def dmlkit(args: list[str], cwd: Path, env: dict[str, str] | None = None, **streams) -> subprocess.CompletedProcess:
    """``python -m dmlkit ARGS`` in ``cwd``; stdout and stderr captured as text unless ``streams``
    say otherwise."""
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **streams}
    return subprocess.run([sys.executable, "-m", "dmlkit", *args], cwd=cwd, env=env or _env(),
                          text=True, timeout=300, **streams)


def _lines(text: str | None) -> list[str]:
    return [line for line in (text or "").splitlines() if line.strip()]


@pytest.fixture
def emb(tmp_path: Path) -> Path:
    """``e.npz`` (80 x 16, 10 classes) and a copy named ``émb.npz`` in ``tmp_path``."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "e.npz", embeddings=rng.standard_normal((80, 16)).astype(np.float32),
             labels=np.repeat(np.arange(10), 8))
    (tmp_path / "émb.npz").write_bytes((tmp_path / "e.npz").read_bytes())
    return tmp_path


# -- F1: COLUMNS=0 off a terminal -------------------------------------------------------------
@pytest.mark.parametrize("columns", ["0", "00", "-5", "abc", ""])
def test_a_columns_that_is_no_positive_width_counts_as_unset(columns, monkeypatch):
    from dmlkit.commands._console import PIPE_WIDTH, columns_from_environment, output_console

    monkeypatch.setenv("COLUMNS", columns)
    assert columns_from_environment() is None
    assert output_console().width == PIPE_WIDTH  # off a terminal (pytest captures the streams)
    assert output_console(stderr=True).width == PIPE_WIDTH
    assert output_console(pipe_width=80).width == 80
    monkeypatch.setenv("COLUMNS", "120")
    assert columns_from_environment() == 120 and output_console().width == 120


def test_train_logs_keep_their_width_under_columns_0(monkeypatch):
    """``train``'s progress log (rich's log handler) was laid out at width 0 too."""
    import logging

    from rich.logging import RichHandler

    from dmlkit.commands.train import _setup_logging

    log = logging.getLogger("dmlkit")
    kept, level = list(log.handlers), log.level
    monkeypatch.setenv("COLUMNS", "0")
    try:
        for handler in kept:
            log.removeHandler(handler)
        _setup_logging(False)
        (handler,) = [h for h in log.handlers if isinstance(h, RichHandler)]
        assert handler.console.width == 80  # rich's own width off a terminal
    finally:
        for handler in list(log.handlers):
            log.removeHandler(handler)
        for handler in kept:
            log.addHandler(handler)
        log.setLevel(level)


def test_columns_0_keeps_the_error_line_and_the_metrics_table(emb):
    """``COLUMNS=0`` (docker exec, CI without a tty): the error line and the metrics table
    vanished (width 0), exit codes unchanged."""
    env = _env(COLUMNS="0")
    missing = dmlkit(["evaluate", "missing.npz"], emb, env)
    assert missing.returncode == 2 and missing.stdout == ""
    assert _lines(missing.stderr) == ["error: embeddings file not found: missing.npz"]
    ok = dmlkit(["evaluate", "e.npz"], emb, env)
    assert ok.returncode == 0, ok.stderr
    assert "precision_at_1" in ok.stdout and "map_at_r" in ok.stdout


# -- F2: a read-only install without a writable numba cache -----------------------------------
#: Simulated read-only file systems (tests run as root, which chmod does not stop): creating or
#: writing a file, or making a folder, under $TEST_READ_ONLY (but not under $TEST_WRITABLE)
#: fails with EROFS, as on a read-only mount. numba's and dmlkit's test of a cache folder both
#: go through os.open/os.mkdir (tempfile.TemporaryFile, os.makedirs).
SITECUSTOMIZE = """
import errno, os
_ro = [p for p in os.environ.get("TEST_READ_ONLY", "").split(os.pathsep) if p]
_rw = [p for p in os.environ.get("TEST_WRITABLE", "").split(os.pathsep) if p]

def _inside(path, roots):
    path = os.path.abspath(os.fsdecode(path))
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)

def _refused(path):
    return _inside(path, _ro) and not _inside(path, _rw)

_open, _mkdir = os.open, os.mkdir

def _ro_open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and _refused(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return _open(path, flags, mode, dir_fd=dir_fd)

def _ro_mkdir(path, mode=0o777, *, dir_fd=None):
    if _refused(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return _mkdir(path, mode, dir_fd=dir_fd)

os.open, os.mkdir = _ro_open, _ro_mkdir
"""

KERNEL_PROBE = """
import os, numpy as np
import dmlkit.metrics._kernels as k
print(k.pack_keys(np.array([0.5, -1.0], np.float32), 7).tolist())
print(type(k.pack_keys._cache).__name__, getattr(k.pack_keys._cache, "cache_path", None))
"""


def _read_only_world(tmp_path: Path, writable: list[Path]) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for folder in ("tmp", "home", "cache"):
        (tmp_path / folder).mkdir(exist_ok=True)
    env = _env(PYTHONPATH=os.pathsep.join([str(site), str(SRC)]), TEST_READ_ONLY=os.sep,
               TEST_WRITABLE=os.pathsep.join(map(str, writable)), HOME=str(tmp_path / "home"),
               TMPDIR=str(tmp_path / "tmp"), NUMBA_CACHE_DIR=str(tmp_path / "cache"), XDG_CACHE_HOME=None)
    return subprocess.run([sys.executable, "-c", KERNEL_PROBE], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_numba_caches_the_kernels_in_a_private_temporary_folder_when_nothing_else_is_writable(tmp_path):
    """Package tree, HOME and NUMBA_CACHE_DIR read-only: the first kernel's decorator raised
    "cannot cache function 'pack_keys': no locator available" (and `dmlkit evaluate` of 2^22
    pairs a 70-line traceback). The temporary directory holds the cache instead."""
    res = _read_only_world(tmp_path, writable=[tmp_path / "tmp"])
    assert res.returncode == 0, res.stderr[-3000:]
    keys, cache = res.stdout.splitlines()
    assert keys == str([(np.float32(0.5).view(np.int32).item() << 32) | (2**32 - 1 - 7),
                        ((np.float32(-1.0).view(np.int32).item() ^ 0x7FFFFFFF) << 32) | (2**32 - 1 - 7)])
    folder = tmp_path / "tmp" / f"dmlkit-numba-{os.getuid()}"
    assert cache.split()[0] == "FunctionCache" and cache.split()[1].startswith(str(folder))
    assert any(folder.rglob("_kernels.pack_keys-*.nbi"))  # the cache was written there
    assert (folder.stat().st_mode & 0o777) == 0o700  # private: numba loads pickles from it


def test_numba_compiles_without_a_cache_when_no_folder_can_hold_it(tmp_path):
    """No folder for the cache (here the fallback folder is one that others can write: numba
    loads pickles from it, so it is not used): the kernels compile uncached, with one warning."""
    planted = tmp_path / "tmp" / f"dmlkit-numba-{os.getuid()}"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    res = _read_only_world(tmp_path, writable=[tmp_path / "tmp"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[1].split()[0] == "NullCache"
    assert "set NUMBA_CACHE_DIR to a writable folder" in res.stderr and "Traceback" not in res.stderr


def test_the_fallback_folder_of_another_user_is_not_used(tmp_path, monkeypatch):
    """A cache folder under a shared /tmp that this user does not own alone (group- or
    world-writable) is refused: numba loads pickles from it."""
    from dmlkit.metrics import _numba_cache

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert not _numba_cache._private_dir(str(shared))
    assert _numba_cache._private_dir(str(tmp_path / "mine"))
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


# -- F3: closed or full standard streams --------------------------------------------------------
def _stderr_read_only() -> None:
    """fd 2 open on a file for reading: what ``2>&-`` leaves when a launcher script's own file
    takes the freed descriptor (a pyenv shim); every write to it fails with EBADF."""
    fd = os.open(__file__, os.O_RDONLY)
    os.dup2(fd, 2)
    os.close(fd)


@pytest.mark.parametrize("how", ["read-only fd", "/dev/full"])
def test_an_unwritable_stderr_does_not_stop_the_command(emb, how):
    """``verify`` (its progress and warnings on stderr) died with exit 1 and no output."""
    args = ["verify", "e.npz", "--pairs", "40", "--folds", "2"]
    if how == "/dev/full":
        with open("/dev/full", "w") as full:
            res = dmlkit(args, emb, stderr=full)
    else:
        res = dmlkit(args, emb, stderr=subprocess.DEVNULL, preexec_fn=_stderr_read_only)
    assert res.returncode == 0
    assert "accuracy (%)" in res.stdout


def test_a_closed_stdout_fails_a_command_whose_output_is_its_result(emb):
    """``evaluate >&-`` exited 0 with the metrics lost; a command whose result is files
    (``index``) drops its summary and succeeds."""
    closed = {"stdout": subprocess.DEVNULL, "preexec_fn": lambda: os.close(1)}
    res = dmlkit(["evaluate", "e.npz"], emb, **closed)
    assert res.returncode == 1
    (line,) = _lines(res.stderr)
    assert line.startswith("error: standard output is closed or cannot be written: the output of `dmlkit evaluate`")
    res = dmlkit(["index", "e.npz", "-o", "idx.npz"], emb, **closed)
    assert res.returncode == 0 and res.stderr == "" and (emb / "idx.npz").is_file()


# -- F4: an output encoding that lacks a character ----------------------------------------------
def test_a_file_name_the_output_encoding_lacks_is_escaped_not_a_traceback(emb):
    res = dmlkit(["evaluate", "émb.npz"], emb, _env(PYTHONIOENCODING="ascii"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "\\xe9mb.npz" in res.stdout and "precision_at_1" in res.stdout


def test_compare_prints_under_cp1252(tmp_path):
    """The ``A − B`` header (U+2212) raised UnicodeEncodeError under Windows' cp1252 even with
    ASCII method names; the header is ``A - B`` in the table and the Markdown file."""
    from _reference import bench_entries
    from dmlkit.protocol.config import bench_config_from_dict
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split
    from dmlkit.utils import atomic_write_json

    cfg = bench_config_from_dict({
        "name": "enc", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}},
                    {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    labels = np.repeat(np.arange(12), 4)
    results = build_results(cfg, make_bench_split(range(24), "halves", folds=2),
                            bench_entries(tmp_path, cfg, labels, 12), bench_dir=tmp_path)
    atomic_write_json(tmp_path / "results.json", results)
    res = dmlkit(["compare", "results.json", "--metric", "map_at_r", "--mode", "separated", "-o", "c.md"],
                 tmp_path, _env(PYTHONIOENCODING="cp1252"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "A - B" in res.stdout and "written: c.md" in res.stdout
    assert "| A - B |" in (tmp_path / "c.md").read_text(encoding="utf-8")


# -- F5: SIGTERM and SIGHUP unwind like Ctrl-C --------------------------------------------------
#: The atomic write's fsync is where the signal lands: the runner marks it and waits.
STOP_RUNNER = """
import os, pathlib, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)  # as a command starts from a shell (not inherited ignored)
marker = pathlib.Path(sys.argv[1])
def slow_fsync(fd):
    marker.touch()
    time.sleep(120)
os.fsync = slow_fsync
import dmlkit.cli
dmlkit.cli.main(sys.argv[2:])
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_an_atomic_write_removes_the_temporary_file(emb, sig):
    """``index`` stopped by SIGTERM mid-write left ``.idx.npz.XXXX.tmp`` (25 MB in the audit);
    Ctrl-C removed it. Now SIGTERM and SIGHUP unwind the same way: exit 128 + N, one line."""
    out = emb / "out"
    out.mkdir()
    marker = emb / "in-fsync"
    proc = subprocess.Popen([sys.executable, "-c", STOP_RUNNER, str(marker), "index", "e.npz", "-o", "out/idx.npz"],
                            cwd=emb, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")], "no write in progress"
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, stderr[-2000:])
    assert sorted(p.name for p in out.iterdir()) == []  # no partial file, no result
    assert _lines(stderr) == [f"interrupted: stopped by {signal.Signals(sig).name} (files already written are complete)"]


def test_the_interrupted_line_fits_the_command():
    from dmlkit.cli import _interrupted_line

    assert _interrupted_line(130, ["train", "c.yaml"]).endswith("the run continues with --resume)")
    assert "--resume" in _interrupted_line(143, ["track", "train", "c.yaml"])
    assert "--resume" not in _interrupted_line(130, ["serve", "run"])
    assert _interrupted_line(130, ["serve", "run"]) == "interrupted: stopped by Ctrl-C (the server is shut down)"
    assert _interrupted_line(129, ["evaluate", "e.npz"]) == (
        "interrupted: stopped by SIGHUP (files already written are complete)")


def test_an_ignored_sighup_stays_ignored():
    """``nohup dmlkit train ...`` ignores SIGHUP: the command must not start taking it."""
    from dmlkit.signals import exit_on_signals

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with exit_on_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


# -- F6: a full or read-only disk names the file ------------------------------------------------
def _fail_fsync(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_names_the_output_file(emb, run_cli, monkeypatch):
    """A ``write``/``fsync`` error names no file: it read ``error: file error: No space left on
    device``."""
    monkeypatch.chdir(emb)
    monkeypatch.setattr(os, "fsync", _fail_fsync)
    code, out, err = run_cli(["index", "e.npz", "-o", "sub/idx.npz"])
    assert code == 2 and out == ""
    assert _lines(err) == ["error: cannot write sub/idx.npz: No space left on device (the disk is full: "
                           "free space or write to another disk)"]
    assert not list(emb.rglob("*.tmp*")) and not (emb / "sub" / "idx.npz").exists()


def test_a_read_only_folder_names_the_output_not_the_temporary_file(emb, run_cli, monkeypatch):
    """compare -o on a read-only folder said ``cannot access ro/.c.md.u1zrti74.tmp`` and only
    after printing its whole table."""
    import tempfile

    def read_only(*args, dir=None, prefix="", suffix="", **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(dir, f"{prefix}u1zrti74{suffix}"))

    import dmlkit.protocol.compare as compare

    report = {"warnings": [], "seeds": {"x": 1, "y": 1}, "queries": 10, "confidence": 0.95,
              "relative_improvement": {}, "min_seeds_for_significance": 3,
              "comparisons": [{"a": "x", "b": "y", "mode": "separated", "metric": "map_at_r", "diff": 0.01,
                               "ci_low": -0.02, "ci_high": 0.04, "p": 0.5, "p_holm": 0.5,
                               "significant": False, "variance": "seeds and queries"}]}
    monkeypatch.setattr(compare, "compare_results", lambda *a, **k: report)
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.chdir(emb)
    (emb / "ro").mkdir()
    code, out, err = run_cli(["compare", "e.npz", "-o", "ro/c.md"])
    assert code == 2 and out == ""  # nothing printed for a refused command
    assert _lines(err) == ["error: cannot write ro/c.md: Read-only file system (read-only file system: "
                           "write somewhere else)"]


def test_a_checkpoint_on_a_full_disk_reads_as_every_other_file(tmp_path, monkeypatch):
    from dmlkit.exceptions import CheckpointError
    from dmlkit.training.checkpoint import save_checkpoint

    monkeypatch.setattr(os, "fsync", _fail_fsync)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint({"step": 1}, tmp_path / "last.pt")
    assert str(info.value) == (f"cannot write {tmp_path / 'last.pt'}: No space left on device (the disk is "
                               "full: free space or write to another disk)")
    assert list(tmp_path.iterdir()) == []


# -- F7: $DMLKIT_NUM_THREADS below 1 ------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_thread_variable_below_one_is_refused_as_the_option_is(tmp_path, value):
    res = dmlkit(["bench", str(REPO / "configs" / "bench_quick.yaml"), "--out", "b", "--data-root", "no-data"],
                 tmp_path, _env(DMLKIT_NUM_THREADS=value))
    assert res.returncode == 2 and res.stdout == ""
    assert _lines(res.stderr) == [f"error: DMLKIT_NUM_THREADS='{value}': at least 1 and at most 1024 threads, "
                                  "as --threads"]


# -- F8: -o /dev/stdout into a pipe ------------------------------------------------------------
def test_an_output_path_that_is_a_pipe_is_refused_in_one_line(emb):
    assert dmlkit(["index", "e.npz", "-o", "idx.npz"], emb).returncode == 0
    res = dmlkit(["query", "idx.npz", "e.npz", "-o", "/dev/stdout"], emb)  # stdout: a pipe
    assert res.returncode == 2
    assert _lines(res.stderr) == ["error: /dev/stdout exists and is not a regular file (a pipe): choose "
                                  "another output path"]


# -- F9: small wording faults -----------------------------------------------------------------
def test_a_data_root_with_a_newline_gives_a_one_line_error(tmp_path):
    from dmlkit.data.datasets import load_att_faces
    from dmlkit.exceptions import DataNotFoundError

    with pytest.raises(DataNotFoundError) as info:
        load_att_faces(root=tmp_path / "a\nb")
    message = str(info.value)
    assert "\n" not in message and "a\\nb" in message and message.startswith("att_faces not found")


def test_a_blank_16_bit_image_is_refused_in_words_for_any_use():
    from PIL import Image

    from dmlkit.data.imaging import to_8bit
    from dmlkit.exceptions import DataError

    img = Image.fromarray(np.arange(0, 700, dtype=np.uint16).reshape(25, 28))  # 16-bit, values 0..699
    with pytest.raises(DataError, match="would be blank") as info:
        to_8bit(img, "upload.png")
    assert "training" not in str(info.value)


def test_missing_glyphs_are_one_warning_per_process():
    """matplotlib warns once per character and figure: a report with class names in Chinese
    repeated the same two warnings 12 times."""
    from dmlkit.report import style

    style._missing_said.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with style.figure_style():
                warnings.warn("Glyph 26085 (\\N{CJK UNIFIED IDEOGRAPH-65E5}) missing from font(s) DejaVu Sans.", stacklevel=1)
                warnings.warn("Glyph 26412 (\\N{CJK UNIFIED IDEOGRAPH-672C}) missing from font(s) DejaVu Sans.", stacklevel=1)
                warnings.warn("another warning", stacklevel=1)
    texts = [str(w.message) for w in caught]
    assert texts.count("another warning") == 3
    glyphs = [t for t in texts if "glyph" in t.lower()]
    assert len(glyphs) == 1 and "日 本" in glyphs[0] and "Glyph 26085" not in glyphs[0]


def test_a_figure_that_fails_keeps_its_warnings():
    """figure_style re-emitted the block's warnings only when it ended normally: a figure that
    raised lost the warning that might say why (diff review s41)."""
    import warnings

    from dmlkit.report.style import figure_style

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="figure failed"):
            with figure_style():
                warnings.warn("a warning from inside the figure", UserWarning, stacklevel=1)
                raise RuntimeError("figure failed")
    assert [str(w.message) for w in caught] == ["a warning from inside the figure"]


def test_which_commands_give_their_result_on_stdout():
    """reid, patches evaluate and track evaluate print their results too (a closed stdout lost
    them with exit 0); an output file or folder makes the printed part a summary."""
    from dmlkit.cli import _output_was_the_product as product

    for argv in (["reid", "--run-dir", "r"], ["patches", "evaluate", "x"], ["track", "evaluate", "d"],
                 ["evaluate", "e.npz"], ["--help"]):
        assert product(argv), argv
    for argv in (["reid", "-o", "r.json"], ["track", "evaluate", "d", "--out-dir", "o"],
                 ["patches", "train", "c.yaml"], ["train", "quickstart"], ["evaluate", "e.npz", "--out=x"]):
        assert not product(argv), argv
