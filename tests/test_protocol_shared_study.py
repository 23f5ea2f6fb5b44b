"""A study shared by workers (PostgreSQL): a silent server is an error, not a hang; progress
counts come from one snapshot; workers raising protocol.trials at once add each slot once;
a worker with other sampler or heartbeat settings, or another bench directory's config, is refused."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import socket
import threading
import time
import warnings
from threading import BrokenBarrierError

import optuna
import pytest
import yaml

from dmlkit.exceptions import ConfigError
from dmlkit.metrics.scoring import scoring_stamp
from dmlkit.protocol import study as study_mod
from dmlkit.protocol.runner import Bench, _progress, method_fingerprint
from dmlkit.protocol.study import make_storage, open_study, resolve_storage_url, study_summary
from test_protocol_study import postgres_url  # noqa: F401  (the throwaway PostgreSQL fixture)
from test_protocol_two_workers import TINY, _Classes, _config


def test_a_server_that_never_answers_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """A host that accepts the TCP connection and stays silent: make_storage gives up after
    libpq's connect_timeout with the one-line storage error (it waited for ever)."""
    pytest.importorskip("psycopg")
    monkeypatch.setattr(study_mod, "_CONNECT_TIMEOUT_S", 2)  # libpq's minimum
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_stay_silent() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_stay_silent, daemon=True)
    thread.start()
    url = resolve_storage_url(f"postgresql://u@127.0.0.1:{server.getsockname()[1]}/db", tmp_path)
    result: list[BaseException] = []

    def open_it() -> None:
        try:
            make_storage(url)
        except BaseException as exc:  # handed to the main thread
            result.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    start = time.monotonic()
    opener.start()
    opener.join(timeout=20)
    try:
        assert not opener.is_alive(), "make_storage still waits for a silent server after 20 s"
        assert time.monotonic() - start < 20
        assert len(result) == 1 and isinstance(result[0], ConfigError), result
        assert "cannot open the study storage" in str(result[0])
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        server.close()


def test_a_connect_timeout_in_the_url_is_kept(monkeypatch):
    """The URL's own connect_timeout wins over dmlkit's default."""
    seen: dict = {}

    class FakeStorage:
        def __init__(self, url, engine_kwargs, **_):
            seen.update(engine_kwargs)

    monkeypatch.setattr("optuna.storages.RDBStorage", FakeStorage)
    make_storage("postgresql+psycopg://u@h/db?connect_timeout=3")
    assert "connect_args" not in seen
    make_storage("postgresql+psycopg://u@h/db")
    assert seen["connect_args"] == {"connect_timeout": study_mod._CONNECT_TIMEOUT_S}


def _study_completed_by_another_worker_between_queries():
    """Three RUNNING trials; after every ``get_trials`` query another worker completes one."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    running = [study.ask() for _ in range(3)]
    original = study.get_trials

    def get_trials(*args, **kwargs):
        out = original(*args, **kwargs)
        if running:
            study.tell(running.pop(0), 0.5)  # the other worker, right after this query
        return out

    study.get_trials = get_trials
    return study


def test_progress_counts_no_failed_trial_when_none_failed():
    """No trial ever fails, yet two separate queries showed a trial completed between them
    as "1 failed"."""
    assert _progress(_study_completed_by_another_worker_between_queries(), 3) == "0/3 trials completed"
    summary = study_summary(_study_completed_by_another_worker_between_queries())
    assert (summary["finished"], summary["failed"]) == (0, 0), summary


def _grow(url: str, barrier) -> None:
    """A worker started with a larger protocol.trials. Its first enqueue waits (1 s at most)
    for the other worker's: without a lock both have read the old slot count by then."""
    original = optuna.Study.enqueue_trial
    waited = []

    def enqueue_trial(self, *args, **kwargs):
        if not waited:
            waited.append(True)
            try:
                barrier.wait(timeout=1.0)
            except BrokenBarrierError:  # the other worker waits for our lock: as it should
                pass
        return original(self, *args, **kwargs)

    optuna.Study.enqueue_trial = enqueue_trial
    open_study(make_storage(url), "grow/m", 6, fingerprint={"sha256": "x"})


def _two_workers_grow(url: str) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    open_study(make_storage(url), "grow/m", 4, fingerprint={"sha256": "x"})  # the first search
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_grow, args=(url, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    study = optuna.load_study(storage=make_storage(url), study_name="grow/m")
    assert study.user_attrs["dmlkit_slots"] == 6
    return len(study.get_trials(deepcopy=False))


def test_two_workers_raising_trials_at_once_add_each_slot_once_sqlite(tmp_path):
    assert _two_workers_grow(resolve_storage_url(None, tmp_path)) == 6


@pytest.mark.postgres
def test_two_workers_raising_trials_at_once_add_each_slot_once_postgres(postgres_url, tmp_path):  # noqa: F811
    assert _two_workers_grow(resolve_storage_url(postgres_url, tmp_path)) == 6


def test_the_sampler_settings_are_part_of_the_study_key(tmp_path):
    """A worker with another protocol.sampler, sampler_seed or n_startup_trials joined the study
    and sampled other points; with the defaults the key is the one earlier versions wrote."""
    bench = Bench(_config(), tmp_path / "A")
    split = bench.split(_Classes(range(100, 140)))
    method = bench.config.methods[0]
    key = method_fingerprint(bench.config, method, split)
    for setting, value in (("sampler", "random"), ("sampler_seed", 7), ("n_startup_trials", 3)):
        other = bench.config.model_copy(deep=True)
        setattr(other.protocol, setting, value)
        assert method_fingerprint(other, method, split) != key, setting
    default = bench.config.model_copy(deep=True)
    default.protocol.n_startup_trials = 10  # TINY sets 1; all three at their defaults:
    old_blob = json.dumps({"fixed": default.fixed_fingerprint(), "method": method.model_dump(mode="json"),
                           "split": split.to_dict()}, sort_keys=True)
    assert method_fingerprint(default, method, split) == {"sha256": hashlib.sha256(old_blob.encode()).hexdigest()}


def test_a_worker_with_other_heartbeat_settings_is_refused(tmp_path):
    """A worker whose grace period is shorter than another's heartbeat interval failed that
    worker's live trials: the study keeps its creator's values and refuses others."""
    storage = make_storage(resolve_storage_url(None, tmp_path))
    beat = {"heartbeat_interval": 1, "grace_period": 4}
    open_study(storage, "hb/m", 2, heartbeat=beat)
    open_study(storage, "hb/m", 2, heartbeat=dict(beat))  # the same values: joins
    with pytest.raises(ConfigError, match="--set protocol.grace_period=4 --set protocol.heartbeat_interval=1"):
        open_study(storage, "hb/m", 2, heartbeat={"heartbeat_interval": 1, "grace_period": 60})
    open_study(storage, "old/m", 2)  # a study from before the values were recorded accepts any
    open_study(storage, "old/m", 2, heartbeat={"heartbeat_interval": 1, "grace_period": 60})


def test_worker_refuses_a_bench_directory_of_another_config(run_cli, tmp_path):
    """`--worker` compares the bench directory's config.yaml as a coordinator does."""
    Bench(_config(), tmp_path / "bench").prepare()
    other = {**TINY, "protocol": {**TINY["protocol"], "sampler_seed": 5}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    code, _, err = run_cli(["bench", str(tmp_path / "other.yaml"), "--worker", "--out", str(tmp_path / "bench")])
    assert code == 2, err
    assert "holds a benchmark with another config" in err


def _legacy_study(bench: Bench, split, *, key_has_sampler: bool = False) -> optuna.Study:
    """The study of ``bench``'s first method as a dmlkit before commit e8532d0 made it: its key
    without the sampler settings (or, ``key_has_sampler``, as e8532d0 made it: with them), no
    fingerprint version."""
    method = bench.config.methods[0]
    key = {"fixed": bench.config.fixed_fingerprint(), "method": method.model_dump(mode="json"),
           "split": split.to_dict()}
    if key_has_sampler:
        key["search"] = bench.config.protocol.search_fingerprint()
    study = optuna.create_study(storage=bench.storage, study_name=bench.study_name(method), direction="maximize")
    study.set_user_attr("dmlkit_fingerprint",
                        {"sha256": hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()})
    study_mod.grow_slots(study, bench.config.protocol.trials)
    return study


def test_an_older_study_with_other_than_default_sampler_settings_resumes_in_its_bench_directory(tmp_path):
    """A study made by a dmlkit whose key left the sampler settings out (n_startup_trials: 1
    here, 2 in bench_quick.yaml) was refused as "another search space" after the upgrade: its
    bench directory's config.yaml shows the settings are the same, so it resumes, with this
    dmlkit's key recorded from then on (other settings are then refused)."""
    old = Bench(_config(), tmp_path / "A")
    old.prepare()  # the older run's config.yaml
    split = old.split(_Classes(range(100, 140)))
    _legacy_study(old, split)
    bench = Bench(_config(), tmp_path / "A")
    bench.check_config_dir()
    method = bench.config.methods[0]
    study = bench._open_study(method, split)
    assert study.user_attrs["dmlkit_fingerprint"] == method_fingerprint(bench.config, method, split)
    assert study.user_attrs["dmlkit_fingerprint_version"] == study_mod.FINGERPRINT_VERSION
    other = bench.config.model_copy(deep=True)
    other.protocol.n_startup_trials = 10
    with pytest.raises(ConfigError, match="another search space"):
        open_study(bench.storage, bench.study_name(method), 2, fingerprint=method_fingerprint(other, method, split),
                   legacy_fingerprint=method_fingerprint(other, method, split, legacy=True), legacy_checked=True)


def test_an_older_study_is_refused_where_its_sampler_settings_cannot_be_shown(tmp_path):
    """Without a bench directory's config.yaml for its study.db nothing shows the older study
    was sampled with these settings: refused, naming that cause (not another search space);
    a study whose unversioned key holds the settings (e8532d0) resumes."""
    bench = Bench(_config(), tmp_path / "A")
    split = bench.split(_Classes(range(100, 140)))
    method = bench.config.methods[0]
    _legacy_study(bench, split)
    with pytest.raises(ConfigError, match="older dmlkit, which did not record protocol.sampler") as err:
        bench._open_study(method, split)
    assert "another search space" not in str(err.value)
    assert "dmlkit_fingerprint_version" not in optuna.load_study(
        storage=bench.storage, study_name=bench.study_name(method)).user_attrs
    recent = Bench(_config(), tmp_path / "B")
    _legacy_study(recent, recent.split(_Classes(range(100, 140))), key_has_sampler=True)
    assert recent._open_study(method, split).user_attrs["dmlkit_fingerprint_version"] == 2


def test_a_search_resumed_over_trials_another_dmlkit_scored_warns(tmp_path):
    """A study searched by an older dmlkit and resumed by this one mixed objective values of two
    versions of the metric code (validation MAP@R differed in the 5th digit), so a near tie
    could flip the best parameters silently: a resume with trials left says so, once."""
    bench = Bench(_config(), tmp_path / "A")
    split = bench.split(_Classes(range(100, 140)))
    method = bench.config.methods[0]
    study = bench._open_study(method, split)
    study.tell(study.ask(), 0.5)  # scored by an older dmlkit: no "dmlkit_scoring"
    with pytest.warns(UserWarning, match=r"earlier trials were scored by an older dmlkit, which did not "
                      r"record its version, new ones by this dmlkit \(dmlkit .*, scoring revision 1\).*"
                      r"A new bench directory avoids mixing them \(or `--stage final --set protocol.trials=1`"):
        bench._open_study(method, split)
    current = Bench(_config(), tmp_path / "B")
    study = current._open_study(method, split)
    trial = study.ask()
    trial.set_user_attr("dmlkit_scoring", scoring_stamp())  # as the search objective records it
    study.tell(trial, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        current._open_study(method, split)  # scored by this dmlkit: nothing to say
