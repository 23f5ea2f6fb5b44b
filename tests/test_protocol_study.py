"""Studies in a database: exactly the requested trials, failures recorded, resume after a kill,
several worker processes sharing one study (SQLite, and a real PostgreSQL server)."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from dmlkit.protocol.study import (
    count_finished,
    fail_running_trials,
    make_sampler,
    make_storage,
    open_study,
    resolve_storage_url,
    run_worker,
    study_summary,
)

HERE = Path(__file__).resolve().parent


def _objective_factory(log_path: str, sleep: float = 0.0):
    def objective(trial):
        x = trial.suggest_float("x", -2.0, 2.0)
        with open(log_path, "a") as fh:
            fh.write(json.dumps({"number": trial.number, "x": x, "pid": os.getpid()}) + "\n")
        time.sleep(sleep)
        if trial.number == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        if trial.number == 2:
            return float("nan")
        return -(x - 0.5) ** 2

    return objective


def _calls(log_path) -> list[dict]:
    p = Path(log_path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def worker_main() -> None:  # run in a subprocess: argv = url, name, trials, log, sleep
    url, name, trials, log, sleep = sys.argv[1:6]
    barrier = Path(sys.argv[6]) if len(sys.argv) > 6 else None
    # a long grace period: a busy machine must not make a live worker look dead (the takeover
    # test detects the killed worker with its own, short, grace period)
    storage = make_storage(url, heartbeat_interval=1, grace_period=60)
    study = open_study(storage, name, int(trials), seed=os.getpid() % 1000, n_startup_trials=2)
    if barrier is not None:  # start claiming together with the other worker
        (barrier / f"ready-{os.getpid()}").touch()
        while not (barrier / "go").exists():
            time.sleep(0.05)
    run_worker(study, _objective_factory(log, float(sleep)), heartbeat_interval=1,
               sampler_factory=lambda n: make_sampler("tpe", 100 + n, 2))


def _spawn(url, name, trials, log, sleep, barrier=None) -> subprocess.Popen:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_protocol_study as t; t.worker_main()"
    extra = [] if barrier is None else [str(barrier)]
    return subprocess.Popen([sys.executable, "-c", code, url, name, str(trials), str(log), str(sleep), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _check_exact(study, trials: int, calls: list[dict]) -> None:
    from optuna.trial import TrialState

    from dmlkit.protocol.study import interrupted_numbers

    all_trials = study.get_trials(deepcopy=False)
    skip = interrupted_numbers(all_trials)
    counted = [t for t in all_trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
               and t.number not in skip]
    assert len(counted) == trials == count_finished(study)
    assert not [t for t in all_trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # every finished trial's objective ran exactly once
    finished_numbers = [t.number for t in counted]
    ran = [c["number"] for c in calls]
    for n in finished_numbers:
        assert ran.count(n) == 1, f"trial {n} ran {ran.count(n)} times"


def test_exact_trials_failures_recorded(tmp_path):
    storage = make_storage(resolve_storage_url(None, tmp_path))
    study = open_study(storage, "s", 6, seed=0, n_startup_trials=2)
    log = tmp_path / "calls.jsonl"
    ran = run_worker(study, _objective_factory(str(log)))
    assert ran == 6
    _check_exact(study, 6, _calls(log))
    summary = study_summary(study)
    assert summary["states"]["COMPLETE"] == 4 and summary["states"]["FAIL"] == 2
    failed = {t.number: t.user_attrs.get("error") for t in study.trials if t.state.name == "FAIL"}
    assert "out of memory" in failed[1] and "not finite" in failed[2]
    # running again does nothing; reopening with more trials adds exactly the difference
    assert run_worker(study, _objective_factory(str(log))) == 0
    study = open_study(storage, "s", 8)
    assert run_worker(study, _objective_factory(str(log))) == 2
    assert count_finished(study) == 8 and len(study.trials) == 8
    with pytest.raises(Exception, match="cannot shrink"):
        open_study(storage, "s", 3)
    with pytest.raises(Exception, match="another search space"):
        open_study(storage, "fp", 2, fingerprint={"a": 1}) and open_study(storage, "fp", 2, fingerprint={"a": 2})


def test_tpe_is_seeded_per_trial(tmp_path):
    xs = []
    for i in range(2):
        storage = make_storage(f"sqlite:///{tmp_path}/seeded{i}.db")
        study = open_study(storage, "s", 5, seed=11, n_startup_trials=2)
        run_worker(study, lambda t: -t.suggest_float("x", 0, 1) ** 2,
                   sampler_factory=lambda n: make_sampler("tpe", 11 + n, 2))
        xs.append([t.params["x"] for t in study.trials])
    assert xs[0] == xs[1]  # reproducible
    assert len(set(xs[0])) == 5  # and every trial samples a new point


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_resume_after_kill_runs_each_trial_once(tmp_path):
    url = resolve_storage_url(None, tmp_path)
    log = tmp_path / "calls.jsonl"
    proc = _spawn(url, "kill", 6, log, 0.7)
    try:
        # kill the worker in the middle of a trial, after 2 trials have finished
        assert _wait_for(lambda: len(_calls(log)) >= 3, 60), "the worker did not start"
        time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    storage = make_storage(url, heartbeat_interval=1, grace_period=3)
    study = open_study(storage, "kill", 6)
    before = {t.number: t.state.name for t in study.trials}
    assert "RUNNING" in before.values()
    assert fail_running_trials(study) == 1  # the local coordinator: no other worker alive
    from dmlkit.protocol.study import interrupted_numbers

    interrupted = [t for t in study.trials if t.number in interrupted_numbers(study.trials)]
    assert len(interrupted) == 1
    run_worker(study, _objective_factory(str(log)))
    _check_exact(study, 6, _calls(log))
    # the interrupted trial was retried with the same parameters
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == interrupted[0].number]
    assert len(retried) == 1 and retried[0].params == interrupted[0].params


@pytest.mark.slow
def test_shared_worker_takes_over_stale_trial_via_heartbeat(tmp_path):
    url = resolve_storage_url(None, tmp_path)
    log = tmp_path / "calls.jsonl"
    proc = _spawn(url, "hb", 4, log, 0.5)
    try:
        assert _wait_for(lambda: len(_calls(log)) >= 2, 60)
    finally:
        proc.kill()
        proc.wait()
    storage = make_storage(url, heartbeat_interval=1, grace_period=2)
    study = open_study(storage, "hb", 4)
    time.sleep(3)  # the dead worker's heartbeat goes stale
    run_worker(study, _objective_factory(str(log)), heartbeat_interval=1)  # not exclusive
    _check_exact(study, 4, _calls(log))


def _two_workers(url: str, tmp_path: Path, trials: int = 8) -> None:
    log = tmp_path / "calls.jsonl"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [_spawn(url, "shared", trials, log, 0.3, barrier) for _ in range(2)]
    if not _wait_for(lambda: len(list(barrier.glob("ready-*"))) == 2 or any(p.poll() is not None for p in procs), 180) \
            or any(p.poll() is not None for p in procs):
        for p in procs:
            p.kill()
        pytest.fail("workers did not start: " + " | ".join(p.communicate()[0].decode()[-1500:] for p in procs))
    (barrier / "go").touch()
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=240)
        outs.append(out.decode())
        assert p.returncode == 0, out.decode()[-3000:]
    storage = make_storage(url)
    study = open_study(storage, "shared", trials)
    calls = _calls(log)
    states = [(t.number, t.state.name, t.system_attrs) for t in study.trials]
    _check_exact(study, trials, calls)
    assert len(calls) == trials, (calls, states)  # nobody ran an extra trial
    assert len({c["pid"] for c in calls}) == 2, ("both workers should have run trials", calls, outs)
    # workers do not repeat each other's points (per-trial seeds, constant liar)
    assert len({round(c["x"], 12) for c in calls}) == trials, (calls, states)


@pytest.mark.slow
def test_two_processes_share_a_sqlite_study(tmp_path):
    _two_workers(resolve_storage_url(None, tmp_path), tmp_path)


# -- PostgreSQL --------------------------------------------------------------------------------
def _pg_bin() -> Path | None:
    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(cand) / "initdb").exists() and (Path(cand) / "pg_ctl").exists():
            return Path(cand)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url():
    """A throwaway PostgreSQL cluster on a free localhost port (skips without the binaries)."""
    pytest.importorskip("psycopg")
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install postgresql")
    # not under pytest's /tmp/pytest-of-USER: another pytest starting meanwhile sets that back to
    # 0700, and the postgres user could no longer reach the cluster (pg_ctl: Permission denied)
    base = Path(tempfile_dir := tempfile.mkdtemp(prefix="dmlkit-pg-"))
    datadir = base / "data"
    prefix: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root: use the postgres system user
        runuser = shutil.which("runuser")
        try:
            import pwd

            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server")
        if runuser is None:
            pytest.skip("running as root without runuser to switch to the postgres user")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        os.chmod(tempfile_dir, 0o755)
        p = base
        while p != p.parent:  # the postgres user must be able to reach the directory
            p = p.parent
            os.chmod(p, os.stat(p).st_mode | 0o011) if p.exists() and str(p).startswith(("/tmp", "/var/tmp")) else None
        prefix = [runuser, "-u", "postgres", "--"]
    port = _free_port()
    run = lambda *cmd: subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)  # noqa: E731
    r = run(str(bindir / "initdb"), "-D", str(datadir), "-U", "dmlkit", "--auth=trust", "-E", "UTF8")
    if r.returncode != 0:
        pytest.skip(f"initdb failed: {r.stderr[-500:]}")
    r = run(str(bindir / "pg_ctl"), "-D", str(datadir), "-l", str(base / "log.txt"), "-w", "-t", "60",
            "-o", f"-p {port} -k {base} -c listen_addresses=127.0.0.1", "start")
    if r.returncode != 0:
        pytest.skip(f"pg_ctl start failed: {r.stderr[-500:]} {r.stdout[-500:]}")
    try:
        r = run(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "dmlkit", "studies")
        assert r.returncode == 0, r.stderr
        yield f"postgresql://dmlkit@127.0.0.1:{port}/studies"
    finally:
        run(str(bindir / "pg_ctl"), "-D", str(datadir), "-m", "immediate", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.postgres
@pytest.mark.slow
def test_two_processes_share_a_postgresql_study(postgres_url, tmp_path):
    url = resolve_storage_url(postgres_url, tmp_path)
    assert url.startswith("postgresql+psycopg://")
    _two_workers(url, tmp_path, trials=8)
    assert not (tmp_path / "study.db").exists()


def test_storage_url_resolution(tmp_path):
    assert resolve_storage_url(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/study.db"
    assert resolve_storage_url("postgresql://u@h:1/db", tmp_path) == "postgresql+psycopg://u@h:1/db"
    assert resolve_storage_url("postgres://u@h/db", tmp_path) == "postgresql+psycopg://u@h/db"
    assert resolve_storage_url("sqlite:////x/y.db", tmp_path) == "sqlite:////x/y.db"
    assert not math.isnan(0.0)


def test_trial_has_a_heartbeat_before_its_objective_runs(tmp_path, monkeypatch):
    """A worker killed before its heartbeat thread first ran must still leave a trial that goes
    stale and is retried (Optuna never declares a trial without any heartbeat stale)."""
    import threading

    import optuna
    from optuna.storages import fail_stale_trials
    from optuna.trial import TrialState

    from dmlkit.protocol import study as study_mod

    storage = make_storage(resolve_storage_url(None, tmp_path), heartbeat_interval=1, grace_period=1)
    study = open_study(storage, "beat", 1)
    trial = study_mod.claim_waiting_trial(study)
    monkeypatch.setattr(threading.Thread, "start", lambda self: None)  # the beat thread never runs
    monkeypatch.setattr(threading.Thread, "join", lambda self, timeout=None: None)
    with study_mod._heartbeat(study._storage, trial._trial_id, 3600):
        pass  # the worker "dies" here
    monkeypatch.undo()
    time.sleep(2.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.FAIL, TrialState.WAITING]  # failed and re-enqueued


def test_claims_are_locked_through_optunas_storage_cache(tmp_path):
    """``study._storage`` is Optuna's cache wrapper; the SQLite claim lock must still engage."""
    from dmlkit.protocol.study import storage_lock

    storage = make_storage(resolve_storage_url(None, tmp_path))
    study = open_study(storage, "locked", 1)
    assert study._storage is not storage  # the wrapper, not the RDBStorage
    import fcntl

    with storage_lock(study._storage), open(tmp_path / "study.lock", "a") as other:
        with pytest.raises(BlockingIOError):  # held: another claimer would wait here
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_damaged_sqlite_study_is_one_line(tmp_path):
    """sqlalchemy's three-line message ([SQL: ...], a link) and a hint about servers became one
    line that names the file's likely state."""
    from dmlkit.exceptions import ConfigError
    from dmlkit.protocol.study import make_storage

    bad = tmp_path / "study.db"
    bad.write_bytes(b"SQLite format 3\0" + b"\x07" * 2000)
    with pytest.raises(ConfigError) as info:
        make_storage(f"sqlite:///{bad}")
    text = str(info.value)
    assert "\n" not in text and "damaged" in text and "sqlalche.me" not in text
