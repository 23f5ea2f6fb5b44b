"""``protocol.launcher: torchrun``: the config, the torchrun command line, rank 0's result, a
rank's failure as the trial's one line, timeouts, and a real 2-process trial (gloo on CPU)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dmlkit.distributed import DistributedError
from dmlkit.exceptions import ConfigError
from dmlkit.protocol.config import BenchConfig, TorchrunSettings, bench_config_from_dict
from dmlkit.protocol.launch import (
    LaunchResult,
    TorchrunLauncher,
    dataset_parts,
    launcher_for,
    read_rank_error,
)
from dmlkit.protocol.runner import Bench
from dmlkit.utils import atomic_write_json, process_alive

TINY = {
    "name": "tiny-torchrun",
    "fixed": {
        "seed": 0,
        "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28,
                 "options": {"sets": ["background"]}},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 16,
                  "freeze_batchnorm": True},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 2},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1, "device": "cpu", "eval_batch_size": 200, "log_every": 1},
    },
    # one train/validation/test split (4:1:5 of 20 classes): one training run per trial
    "protocol": {"split": "ratio_4_1_5", "folds": 1, "num_classes": 20, "trials": 1, "n_startup_trials": 1,
                 "seeds": [0],
                 "launcher": "torchrun", "nproc_per_trial": 2, "pretrained": False,
                 "torchrun": {"threads_per_process": 1, "timeout_s": 300}},
    "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}, "miner": {"name": "batch_hard"},
                 "search": {"loss.neg_margin": {"low": 0.5, "high": 1.5}}}],
}


def _config(**protocol) -> BenchConfig:
    data = copy.deepcopy(TINY)
    data["protocol"].update(protocol)
    return bench_config_from_dict(data)


# -- config ------------------------------------------------------------------------------------
def test_launcher_config_defaults_and_errors():
    local = _config(launcher="local", nproc_per_trial=1)
    assert local.protocol.launcher == "local" and launcher_for(local) is None
    with pytest.raises(ConfigError, match="needs protocol.launcher: torchrun"):
        _config(launcher="local", nproc_per_trial=2)
    with pytest.raises(ConfigError, match="does not divide the global batch of fixed.sampler"):
        _config(nproc_per_trial=3)  # 4 classes x 4 samples = 16
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        _config(torchrun={"rdzv_endpoint": "no-port"})
    with pytest.raises(ConfigError, match="dmlkit sets these itself"):
        _config(torchrun={"extra_args": ["--nproc-per-node=4"]})
    data = copy.deepcopy(TINY)
    data["fixed"]["classification_sampler"] = {"classes_per_batch": 9, "samples_per_class": 1}
    with pytest.raises(ConfigError, match="classification_sampler"):
        bench_config_from_dict(data)


def test_bench_trains_through_the_launcher_and_resumes_across_launchers(tmp_path):
    cfg = _config()
    bench = Bench(cfg, tmp_path, data_root="/some/data", threads=3)
    assert isinstance(bench.train_fn, TorchrunLauncher)
    assert bench.train_fn.nproc == 2 and bench.train_fn.threads == 1 and bench.train_fn.data_root == "/some/data"
    bench.prepare()
    # the same study may continue with another launcher or rank count: how runs start, not what
    Bench(_config(launcher="local", nproc_per_trial=1), tmp_path).prepare()
    with pytest.raises(ConfigError, match="another config"):
        Bench(_config(num_classes=30), tmp_path).prepare()


# -- command line, environment, results, failures ------------------------------------------------
def test_command_line():
    spec = Path("/runs/x/launch/spec.json")
    cmd = TorchrunLauncher(TorchrunSettings(), 4, python="py").command(spec)
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert cmd[cmd.index("--nnodes") + 1] == "1" and cmd[cmd.index("--max-restarts") + 1] == "0"
    assert cmd[-3:] == ["-m", "dmlkit.protocol.launch", str(spec)]
    fixed = TorchrunSettings(rdzv_endpoint="node1:29400", extra_args=["--monitor-interval", "1"])
    cmd = TorchrunLauncher(fixed, 2, python="py").command(spec, run_id="trial7")
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node1:29400"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d" and cmd[cmd.index("--rdzv-id") + 1] == "trial7"
    assert cmd.index("--monitor-interval") < cmd.index("-m", 2)  # torchrun's options before the script
    env = TorchrunLauncher(TorchrunSettings(threads_per_process=3), 2).environment()
    assert env["OMP_NUM_THREADS"] == env["DMLKIT_NUM_THREADS"] == "3"


def test_result_and_earliest_rank_error_are_collected(tmp_path):
    launcher = TorchrunLauncher(TorchrunSettings(), 2)
    with pytest.raises(DistributedError, match="rank 0 wrote no result.json"):
        launcher.collect(tmp_path, tmp_path)
    atomic_write_json(tmp_path / "result.json", {"val_metrics": {"map_at_r": 0.25, "nmi": float("nan")},
                                                 "test_metrics": None, "best_step": 4, "world_size": 2, "steps": 4})
    res = launcher.collect(tmp_path, tmp_path)
    assert isinstance(res, LaunchResult) and res.val_metrics["map_at_r"] == 0.25 and np.isnan(res.val_metrics["nmi"])
    assert res.test_metrics is None and res.best_step == 4 and res.world_size == 2 and res.extra == {"steps": 4}

    assert read_rank_error(tmp_path) is None
    now = time.time()
    # rank 1 failed first; rank 0's error is the collective that rank 1's death broke
    atomic_write_json(tmp_path / "error-rank0.json", {"rank": 0, "time": now + 1, "error": "RuntimeError: gloo timeout"})
    atomic_write_json(tmp_path / "error-rank1.json", {"rank": 1, "time": now, "error": "NonFiniteError: loss is NaN"})
    (tmp_path / "error-rank2.json").write_text("{truncated")  # a rank killed while writing
    assert read_rank_error(tmp_path) == (1, "NonFiniteError: loss is NaN")


def test_failed_job_is_one_line_naming_the_rank(tmp_path):
    """A real torchrun job of 2 ranks whose data root does not exist: the trial's error is the
    rank's one line (DataNotFoundError ...), not a traceback or torchrun's summary."""
    cfg = _config()
    launcher = TorchrunLauncher(cfg.protocol.torchrun, 2, data_root=str(tmp_path / "no-data"))
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedError, match=r"^rank [01] of 2 failed: DataNotFoundError: ") as err:
        launcher(cfg.experiment(cfg.methods[0]), run_dir, train_set=_Classes([1, 2]), val_set=_Classes([3]))
    assert "\n" not in str(err.value)
    launch = run_dir / "launch"
    spec = json.loads((launch / "spec.json").read_text())
    assert spec["classes"] == {"train": [1, 2], "val": [3], "test": []} and spec["threads"] == 1
    # the rank named in the message wrote its error; the other one did too unless torchrun
    # stopped it first (it terminates the remaining ranks once one has failed)
    named = int(str(err.value).split()[1])
    written = sorted(p.name for p in launch.glob("error-rank*.json"))
    assert f"error-rank{named}.json" in written and set(written) <= {"error-rank0.json", "error-rank1.json"}
    assert "Traceback" in (launch / "torchrun.log").read_text()  # the details stay in the log


class _Classes:
    def __init__(self, classes) -> None:
        self.classes = np.asarray(classes)


def test_timeout_stops_the_whole_job(tmp_path):
    """The job runs in its own session: on timeout the launcher and every process it started
    are stopped, and the trial fails with a timeout line."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    launcher = TorchrunLauncher(TorchrunSettings(timeout_s=3, kill_grace_s=2), 2)
    start = time.monotonic()
    with pytest.raises(DistributedError, match="timed out after 3 s"):
        launcher.run([sys.executable, "-c", code], tmp_path, tmp_path / "run")
    assert time.monotonic() - start < 60
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and process_alive(child):
        time.sleep(0.1)
    assert not process_alive(child), "the job's child process outlived the timeout"



def test_nonzero_exit_without_rank_error_reports_the_log_tail(tmp_path):
    launcher = TorchrunLauncher(TorchrunSettings(), 2)
    with pytest.raises(DistributedError, match="code 3 and no rank reported an error.*agent gave up"):
        launcher.run([sys.executable, "-c", "import sys; print('agent gave up'); sys.exit(3)"], tmp_path, tmp_path)


def test_ranks_rebuild_the_benchs_datasets(data_root):
    """The ranks get class ids and rebuild the subsets: the same rows and transforms as the
    bench's own datasets (train-time augmentation only on the training part)."""
    from dmlkit.protocol.runner import _with_transform, load_full_dataset

    cfg = _config()
    full = load_full_dataset(cfg, data_root)
    train_ids, val_ids = [0, 3, 5], [7, 8]
    parts = dataset_parts(cfg.experiment(cfg.methods[0]), {"train": train_ids, "val": val_ids}, data_root)
    assert parts["test"] is None
    for part, ids, is_train in (("train", train_ids, True), ("val", val_ids, False)):
        ours = _with_transform(full.subset_classes(ids), cfg, train=is_train)
        theirs = parts[part]
        assert len(theirs) == len(ours) and np.array_equal(theirs.labels, ours.labels)
        assert theirs.fingerprint() == ours.fingerprint()
        assert repr(theirs.transform) == repr(ours.transform)


# -- a real distributed trial ----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:training did not beat the untrained model")  # 2 steps of training
def test_trial_runs_as_a_two_process_job(tmp_path, data_root):
    """One search trial whose training run is a 2-rank gloo job under torchrun (``dmlkit
    bench`` as a user runs it): the trial completes, its objective (validation MAP@R from rank
    0's result) is recorded once, the run's log holds every step once (rank 0 writes), and
    the objective and step losses are the ones the same trial gets in one process, random
    augmentation included (each item's augmentation is seeded by its place in the global
    batch, not by the rank that loads it)."""
    import optuna

    from dmlkit.protocol.study import count_finished

    data = copy.deepcopy(TINY)
    (tmp_path / "bench.yaml").write_text(json.dumps(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DMLKIT_NUM_THREADS": "1", "COLUMNS": "200"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dmlkit", "bench", str(tmp_path / "bench.yaml"), "--stage", "search",
                           "--out", str(out), "--data-root", str(data_root), "--threads", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = optuna.load_study(storage=f"sqlite:///{out}/study.db", study_name="tiny-torchrun/contrastive")
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 1 and count_finished(study) == 1
    trial = trials[0]
    assert trial.state.name == "COMPLETE", trial.user_attrs.get("error")
    fold_values = []
    for fold in (0,):
        run = out / "search" / "contrastive" / "trial0" / f"fold{fold}"
        result = json.loads((run / "launch" / "result.json").read_text())
        assert result["world_size"] == 2
        fold_values.append(result["val_metrics"]["map_at_r"])
        assert trial.user_attrs[f"fold{fold}_val"]["map_at_r"] == pytest.approx(fold_values[-1])
        steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()
                 if json.loads(line).get("event") == "train"]
        assert steps and len(steps) == len(set(steps)), steps  # logged once, not once per rank
        assert not list((run / "launch").glob("error-rank*.json"))
    assert trial.value == pytest.approx(float(np.mean(fold_values)))

    # the same trial in one process (the local launcher, in this process)
    data["protocol"].update({"launcher": "local", "nproc_per_trial": 1})
    local = Bench(bench_config_from_dict(data), tmp_path / "local", data_root=data_root)
    local.run(stage="search")
    local_trial = optuna.load_study(storage=local.storage, study_name="tiny-torchrun/contrastive").trials[0]
    assert local_trial.params == trial.params
    # MAP@R is a step function of the embeddings: float-level differences (reduction order,
    # thread counts) may flip a neighbour's rank, so the objective gets a margin of a few flips;
    # the per-step losses below are continuous and match tightly
    assert trial.value == pytest.approx(local_trial.value, abs=0.01)

    def losses(run: Path) -> list[float]:
        rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r.get("event") == "train"]

    fold0 = Path("search") / "contrastive" / "trial0" / "fold0"
    assert losses(out / fold0) == pytest.approx(losses(tmp_path / "local" / fold0), rel=1e-4)
