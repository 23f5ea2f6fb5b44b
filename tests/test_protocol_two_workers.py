"""Two machines share one study through PostgreSQL and nothing else: two ``dmlkit bench
--worker`` processes with different working directories, bench directories and data-root
spellings complete one study, no trial lost or duplicated; the class split both derive is the
same (it comes from the config and the data, not from a shared file)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from dmlkit.exceptions import ConfigError
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.runner import Bench, method_fingerprint
from dmlkit.protocol.study import make_storage, open_study, resolve_storage_url
from test_protocol_study import postgres_url  # noqa: F401  (the throwaway PostgreSQL fixture)

TRIALS = 4
TINY = {
    "name": "two-machines",
    "fixed": {
        "seed": 0,
        "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28,
                 "options": {"sets": ["background"]}},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 16,
                  "freeze_batchnorm": False},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 2},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1, "device": "cpu", "eval_batch_size": 200},
    },
    # one train/validation/test split (4:1:5 of 20 classes): one training run per trial
    "protocol": {"split": "ratio_4_1_5", "folds": 1, "num_classes": 20, "trials": TRIALS, "n_startup_trials": 1,
                 "seeds": [0], "heartbeat_interval": 2, "grace_period": 120},
    "methods": [{"name": "triplet", "loss": {"name": "triplet"}, "miner": {"name": "batch_hard"},
                 "search": {"loss.margin": {"low": 0.05, "high": 0.5, "log": True}}}],
}


class _Classes:
    """Just enough of a dataset for :meth:`Bench.split`: its class ids."""

    def __init__(self, classes) -> None:
        self.classes = np.asarray(list(classes), dtype=np.int64)


def _config(**fixed_data):
    data = copy.deepcopy(TINY)
    data["fixed"]["data"].update(fixed_data)
    return bench_config_from_dict(data)


def test_machines_derive_the_same_split_and_study_key(tmp_path):
    """No shared bench directory: each machine computes split.json itself, from config + data;
    where each keeps its data (data.root) does not change the study's key, other data does."""
    a = Bench(_config(root="/data/on/machine-a"), tmp_path / "A")
    b = Bench(_config(root="/mnt/elsewhere/b"), tmp_path / "B")
    split_a = a.split(_Classes(range(100, 140)))
    split_b = b.split(_Classes(range(100, 140)))
    assert split_a.to_dict() == split_b.to_dict()
    assert (tmp_path / "A" / "split.json").read_text() == (tmp_path / "B" / "split.json").read_text()
    method = a.config.methods[0]
    fp_a = method_fingerprint(a.config, method, split_a)
    assert fp_a == method_fingerprint(b.config, method, split_b)
    # a machine whose copy of the dataset has other classes gets another split: refused
    c = Bench(_config(), tmp_path / "C")
    split_c = c.split(_Classes(range(101, 141)))
    assert split_c.to_dict() != split_a.to_dict()
    storage = make_storage(resolve_storage_url(None, tmp_path))
    open_study(storage, "two-machines/triplet", TRIALS, fingerprint=fp_a)
    with pytest.raises(ConfigError, match="another search space or fixed settings"):
        open_study(storage, "two-machines/triplet", TRIALS, fingerprint=method_fingerprint(c.config, method, split_c))


def _worker(cwd: Path, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DMLKIT_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("DMLKIT_DATA", None)  # each "machine" names its own data root
    return subprocess.Popen([sys.executable, "-m", "dmlkit", "bench", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.postgres
@pytest.mark.slow
def test_two_workers_on_two_machines_complete_one_study(postgres_url, tmp_path, data_root):  # noqa: F811
    import optuna
    from optuna.trial import TrialState

    machines = {name: tmp_path / name for name in ("machine-a", "machine-b")}
    for cwd in machines.values():
        cwd.mkdir()
    # machine A names the data in its config, machine B through a relative --data-root to a link
    cfg_a = copy.deepcopy(TINY)
    cfg_a["fixed"]["data"]["root"] = str(data_root)
    cfg_a["protocol"]["storage"] = postgres_url
    (machines["machine-a"] / "bench.yaml").write_text(yaml.safe_dump(cfg_a))
    cfg_b = copy.deepcopy(TINY)
    cfg_b["protocol"]["storage"] = postgres_url
    (machines["machine-b"] / "bench.yaml").write_text(yaml.safe_dump(cfg_b))
    (machines["machine-b"] / "data").symlink_to(data_root, target_is_directory=True)

    # each worker takes at most half of the trials, so both must take part for the study to finish
    common = ["bench.yaml", "--worker", "--out", "bench", "--threads", "1", "--max-trials", str(TRIALS // 2)]
    procs = {"machine-a": _worker(machines["machine-a"], common),
             "machine-b": _worker(machines["machine-b"], [*common, "--data-root", "data"])}
    outs = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name}'s worker did not finish in time")
        outs[name] = out.decode(errors="replace")
        assert proc.returncode == 0, f"{name}: {outs[name][-3000:]}"

    url = resolve_storage_url(postgres_url, tmp_path)
    study = optuna.load_study(storage=url, study_name="two-machines/triplet")
    trials = study.get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    assert sorted(numbers) == list(range(TRIALS)), [(t.number, t.state.name) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in trials), [(t.number, t.state.name, t.user_attrs.get("error"))
                                                                 for t in trials]
    # every trial ran on exactly one machine: its run directories exist in one bench dir only
    ran = {name: {int(p.name[len("trial"):]) for p in (cwd / "bench" / "search" / "triplet").glob("trial*")}
           for name, cwd in machines.items()}
    assert ran["machine-a"].isdisjoint(ran["machine-b"]), ran
    assert ran["machine-a"] | ran["machine-b"] == set(range(TRIALS)), ran
    assert len(ran["machine-a"]) == len(ran["machine-b"]) == TRIALS // 2, ran
    for t in trials:  # both folds' validation results are in the database, not only on disk
        assert "fold0_val" in t.user_attrs, t.user_attrs
        assert t.value == pytest.approx(np.mean(t.user_attrs["fold_map_at_r"]))
    # both machines derived the same split without sharing a file; no SQLite study was made
    split_a = (machines["machine-a"] / "bench" / "split.json").read_text()
    assert split_a == (machines["machine-b"] / "bench" / "split.json").read_text()
    assert not list(tmp_path.rglob("study.db"))
    # either machine can now run the final stage from the shared study: the best trial is global
    bench = Bench(bench_config_from_dict(cfg_a), machines["machine-a"] / "bench")
    params, info = bench.best_params(bench.config.methods[0])
    best = max(trials, key=lambda t: t.value)
    assert info["trial"] == best.number and params == best.params
    assert info["finished"] == TRIALS


def test_coordinator_waits_for_other_workers_and_reruns_a_dead_ones_trial(tmp_path, data_root):
    """``dmlkit bench`` (not ``--worker``) on a shared study finishes the search before its final
    stage: it runs what is WAITING, waits for a live worker's RUNNING trial, and reruns the trial
    of a worker that died once its heartbeat went stale."""
    import threading
    import time
    from types import SimpleNamespace

    from optuna.trial import TrialState

    from dmlkit.protocol.study import claim_waiting_trial, count_finished, interrupted_numbers

    url = f"sqlite:///{tmp_path}/shared.db"
    data = copy.deepcopy(TINY)
    data["protocol"].update({"storage": url, "trials": 3, "heartbeat_interval": 1, "grace_period": 4})
    cfg = bench_config_from_dict(data)
    ran: list[str] = []

    def fake_train(config, run_dir, **_):  # this machine's training runs
        ran.append(f"{run_dir.parent.name}/{run_dir.name}")
        return SimpleNamespace(val_metrics={"map_at_r": 0.25})

    bench = Bench(cfg, tmp_path / "coordinator", data_root=data_root, train_fn=fake_train)
    # two other machines claimed trials 0 and 1 before this one started
    remote = make_storage(url, heartbeat_interval=1, grace_period=4)
    study = open_study(remote, "two-machines/triplet", 3)
    live, dead = claim_waiting_trial(study), claim_waiting_trial(study)
    stop = threading.Event()
    finished_here: list[float] = []

    def other_machines() -> None:
        """Both keep beating until this machine has run the waiting trial; then one machine
        dies (no more beats) and the other finishes its trial 3 s later."""
        while not ran and not stop.is_set():
            for trial in (live, dead):
                study._storage.record_heartbeat(trial._trial_id)
            time.sleep(0.2)
        finished_here.append(time.monotonic())
        end = time.monotonic() + 3
        while time.monotonic() < end and not stop.is_set():
            study._storage.record_heartbeat(live._trial_id)
            time.sleep(0.2)
        study.tell(live, 0.75)

    thread = threading.Thread(target=other_machines, daemon=True)
    thread.start()
    try:
        bench.run(stage="search")
    finally:
        stop.set()
        thread.join(timeout=30)
    # it waited past the live worker's finish and the dead worker's grace period
    assert finished_here and time.monotonic() - finished_here[0] >= 3
    trials = study.get_trials(deepcopy=False)
    assert count_finished(study) == 3
    assert interrupted_numbers(trials) == {dead.number}
    by_number = {t.number: t for t in trials}
    assert by_number[live.number].state == TrialState.COMPLETE and by_number[live.number].value == 0.75
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retried) == 1 and retried[0].state == TrialState.COMPLETE
    # this machine ran the waiting trial and the dead worker's retry, nothing else, once each
    mine = sorted({r.split("/")[0] for r in ran})
    assert mine == sorted(f"trial{n}" for n in (2, retried[0].number)), ran
    assert len(ran) == len(set(ran)) == 2  # two trials, one training run each
