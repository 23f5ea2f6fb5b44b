"""Ctrl-C and exit codes: a stopped command exits 130 with one line, never 0, never an abort.

The kNN search runs compiled kernels on Python threads; exiting while one of them is inside a
kernel used to abort the interpreter (``terminate called without an active exception``, exit
-6). Typer in non-standalone mode returns (instead of raising) exit codes, which the CLI used to
drop, so Ctrl-C exited 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Imports first, then "ready", then the command: the signal lands inside the command.
# The child starts with SIGINT as a terminal's Ctrl-C finds it: unblocked, Python's handler. A
# suite started in the background of a non-interactive shell (`( .ci/run & )`) inherits SIGINT
# ignored and hands it down: the child then finished its search and exited 0 (reproduced).
RUNNER = """
import signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
import dmlkit.cli, dmlkit.metrics  # noqa: F401  (import time must not count)
print("ready", flush=True)
dmlkit.cli.main(sys.argv[1:])
"""


def _start(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.Popen([sys.executable, "-c", RUNNER, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_ctrl_c_during_the_knn_search_exits_130_with_one_line(tmp_path):
    rng = np.random.default_rng(0)
    n = 250_000  # the search takes about 8 s on 2 idle cores; the signal comes after 1.5 s
    np.savez(tmp_path / "emb.npz", embeddings=rng.standard_normal((n, 32)).astype(np.float32),
             labels=rng.integers(0, n // 20, n))
    proc = _start(["evaluate", "emb.npz", "-m", "map_at_r"], tmp_path)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    assert proc.poll() is None, "the evaluation finished before the interrupt: make it larger"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert not (proc.returncode == 0 and "map_at_r" in out), "the evaluation finished before the interrupt"
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted"), err


def test_a_non_zero_typer_exit_code_reaches_the_shell(tmp_path):
    import typer

    from dmlkit import cli

    probe = typer.Typer()

    @probe.command("exit-with")
    def _exit_with(code: int) -> None:
        raise typer.Exit(code)

    cli.app.registered_commands.append(probe.registered_commands[0])
    try:
        with pytest.raises(SystemExit) as info:
            cli.main(["exit-with", "3"])
        assert info.value.code == 3
        cli.main(["exit-with", "0"])  # success: no SystemExit at all
    finally:
        cli.app.registered_commands.pop()
