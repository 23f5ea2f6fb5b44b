"""End to end: ``dmlkit bench`` on a tiny real slice of Omniglot, killed mid-study and resumed;
the test classes are never read by the search; ``dmlkit compare`` on the results."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from _reference import write_fake_final_run

TINY = {
    "name": "tiny",
    "fixed": {
        "seed": 0,
        "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28},
        "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 16,
                  "freeze_batchnorm": False},
        "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 3},
        "classification_sampler": {"classes_per_batch": 16, "samples_per_class": 1, "batches_per_epoch": 3},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1, "device": "cpu", "eval_batch_size": 200},
    },
    "protocol": {"num_classes": 16, "folds": 2, "trials": 3, "n_startup_trials": 1, "seeds": [0, 1]},
    "methods": [
        {"name": "triplet", "loss": {"name": "triplet"}, "miner": {"name": "batch_hard"},
         "search": {"loss.margin": {"low": 0.05, "high": 0.5, "log": True}}},
        {"name": "contrastive", "loss": {"name": "contrastive"},
         "search": {"loss.neg_margin": {"low": 0.5, "high": 1.5}}},
    ],
}


def _write(tmp: Path, data: dict) -> Path:
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dmlkit", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DMLKIT_NUM_THREADS": "1", "COLUMNS": "200"}


def _finished(db: Path, name: str) -> int:
    import optuna

    from dmlkit.protocol.study import count_finished

    if not db.exists():
        return 0
    try:
        study = optuna.load_study(storage=f"sqlite:///{db}", study_name=name)
    except Exception:
        return 0
    return count_finished(study)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, data_root):
    """Run the tiny bench, kill it after the first finished trial, then resume to the end."""
    tmp = tmp_path_factory.mktemp("bench")
    cfg = _write(tmp, TINY)
    out = tmp / "out"
    args = _cli("bench", str(cfg), "--out", str(out), "--data-root", str(data_root), "--threads", "1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    killed_after = None
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            n = _finished(out / "study.db", "tiny/triplet")
            if n >= 1:
                proc.send_signal(signal.SIGKILL)
                killed_after = n
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert killed_after is not None and killed_after < TINY["protocol"]["trials"], "could not kill mid-study"
    import optuna

    before = {t.number: (t.state.name, t.value, t.params) for t in
              optuna.load_study(storage=f"sqlite:///{out / 'study.db'}", study_name="tiny/triplet").trials}
    r = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {"out": out, "stdout": r.stdout, "before": before, "killed_after": killed_after, "config": cfg}


@pytest.mark.slow
def test_resume_after_kill_finishes_exact_trials(bench_run):
    import optuna

    from dmlkit.protocol.study import counted_trials, interrupted_numbers

    out = bench_run["out"]
    for method in ("triplet", "contrastive"):
        study = optuna.load_study(storage=f"sqlite:///{out / 'study.db'}", study_name=f"tiny/{method}")
        counted = counted_trials(study)
        assert len(counted) == TINY["protocol"]["trials"]
        assert all(t.state.name == "COMPLETE" for t in counted)
        assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")]
    # trials finished before the kill were kept, untouched, and not run again
    study = optuna.load_study(storage=f"sqlite:///{out / 'study.db'}", study_name="tiny/triplet")
    after = {t.number: (t.state.name, t.value, t.params) for t in study.trials}
    for number, (state, value, params) in bench_run["before"].items():
        if state == "COMPLETE":
            assert after[number] == (state, value, params)
    completed_params = [tuple(sorted(t.params.items())) for t in counted_trials(study)]
    assert len(set(completed_params)) == len(completed_params)
    # an interrupted trial (if the kill hit one mid-way) was retried once, with its own
    # parameters when it had already drawn them
    for n in interrupted_numbers(study.trials):
        retry = [t for t in study.trials if t.system_attrs.get("failed_trial") == n]
        assert len(retry) == 1
        if study.trials[n].params:
            assert retry[0].params == study.trials[n].params


@pytest.mark.slow
def test_results_table_and_traceability(bench_run, data_root):
    out = bench_run["out"]
    res = json.loads((out / "results.json").read_text())
    assert list(res["methods"]) == ["pretrained", "triplet", "contrastive"]
    assert res["metrics"][:3] == ["precision_at_1", "r_precision", "map_at_r"]
    assert res["modes"] == {"concatenated": 32, "separated": 16}
    assert res["split"]["dev_classes"] == 8 and res["split"]["test_classes"] == 8
    for name, row in res["methods"].items():
        for mode in ("concatenated", "separated"):
            for m in ("precision_at_1", "r_precision", "map_at_r"):
                cell = row[mode][m]
                assert len(cell["values"]) == 2 and cell["ci95"] is not None and 0 <= cell["mean"] <= 1
                assert cell["mean"] == pytest.approx(np.mean(cell["values"]))
        assert len(row["runs"]) == 4  # 2 seeds x 2 folds
        for run in row["runs"]:  # relative to the bench directory: a copy finds its own files
            assert not Path(run["embeddings"]).is_absolute() and (out / run["embeddings"]).exists()
            if name != "pretrained":
                assert (out / run["checkpoint"]).exists()
    assert set(res["methods"]["triplet"]["best_params"]) == {"loss.margin"}
    assert res["provenance"]["versions"]["torch"] and "git_commit" in res["provenance"]
    assert res["config"]["protocol"]["trials"] == 3
    # the separated value of one seed is the mean of its fold models' own metrics
    from dmlkit.embeddings import load_embeddings
    from dmlkit.metrics import evaluate
    from dmlkit.protocol import load_results

    copy = out.parent / "bench-copy"  # a moved or copied bench reads its own files
    if not copy.exists():
        shutil.copytree(out, copy)
    seed0 = [r for r in load_results(copy)["methods"]["triplet"]["runs"] if r["seed"] == 0]
    assert all(Path(r["embeddings"]).is_relative_to(copy) for r in seed0)
    maps = [evaluate(*load_embeddings(r["embeddings"])[:2], metrics=["map_at_r"])["map_at_r"] for r in seed0]
    assert res["methods"]["triplet"]["separated"]["map_at_r"]["values"][0] == pytest.approx(np.mean(maps))
    md = (out / "results.md").read_text()
    assert "Concatenated (32-dim)" in md and "Separated (16-dim)" in md
    import re

    assert len(re.findall(r"\d\.\d\d ± \d+\.\d\d", md)) == 3 * 6 and "| pretrained |" in md
    csv_text = (out / "results.csv").read_text().splitlines()
    assert csv_text[0] == "method,mode,metric,mean,ci95,n,values" and len(csv_text) == 1 + 3 * 2 * 3
    assert "MAP@R" in bench_run["stdout"] and "±" in bench_run["stdout"]
    for f in ("config.yaml", "provenance.json", "split.json"):
        assert (out / f).exists()
    # a final run's own split.json: the fold's classes and the bench's test classes (its
    # config.yaml says data.split: default, so `dmlkit report RUN` embedded Omniglot's
    # published test split, 659 classes, instead of the bench's 8)
    from dmlkit.data import ClassSplit
    from dmlkit.training import build_datasets, load_config
    from dmlkit.training.trainer import with_run_split

    bench_split = json.loads((out / "split.json").read_text())
    run = out / "final" / "triplet" / "seed0" / "fold1"
    own = ClassSplit.from_json(run / "split.json")
    assert sorted(own.test) == sorted(bench_split["test"]) and set(own.train) | set(own.val) <= set(bench_split["train"]) | set(bench_split["val"])
    test = build_datasets(with_run_split(load_config(run / "config.yaml"), run), ("test",),
                          data_root=data_root)["test"]
    assert sorted(np.unique(test.labels).tolist()) == sorted(own.test)
    assert len(test) == len(load_embeddings(run / "embeddings" / "test.npz")[1])


@pytest.mark.slow
def test_compare_cli(bench_run, tmp_path):
    out = bench_run["out"]
    report = tmp_path / "cmp.json"
    r = subprocess.run(_cli("compare", str(out / "results.json"), "-m", "triplet", "-m", "contrastive",
                            "-m", "pretrained", "-o", str(report)),
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(report.read_text())
    assert data["queries"] == 160 and len(data["comparisons"]) == 3 * 2 * 3
    assert "relative improvement over contrastive" in r.stdout
    assert set(data["relative_improvement"]) == {"contrastive", "triplet"}


@pytest.mark.slow
def test_search_never_reads_the_test_classes(tmp_path, data_root, monkeypatch):
    """Record every sample the search reads (and every dataset it trains on): no test class."""
    from dmlkit.data.base import MetricDataset
    from dmlkit.protocol import Bench, bench_config_from_dict
    from dmlkit.training import train as real_train

    data = json.loads(json.dumps(TINY))
    data["methods"] = data["methods"][:1]
    data["protocol"].update({"trials": 1, "seeds": [0]})
    data["fixed"]["data"]["root"] = str(data_root)
    cfg = bench_config_from_dict(data)
    read: list[int] = []
    trained_on: list[set[int]] = []
    classes_seen: list[int] = []

    for cls in {c for c in MetricDataset.__subclasses__()} | {MetricDataset}:
        original = cls.__getitem__

        def spy(self, index, _original=original):
            x, label = _original(self, index)
            read.append(int(label))
            return x, label

        monkeypatch.setattr(cls, "__getitem__", spy)

    def train_spy(config, run_dir, *, train_set=None, val_set=None, test_set=None, **kw):
        trained_on.append(set(np.unique(train_set.labels).tolist()) | set(np.unique(val_set.labels).tolist()))
        if test_set is not None:
            classes_seen.extend(np.unique(test_set.labels).tolist())
        return real_train(config, run_dir, train_set=train_set, val_set=val_set, test_set=test_set, **kw)

    bench = Bench(cfg, tmp_path / "b", train_fn=train_spy)
    bench.prepare()
    bench.search()
    split = bench.split()
    test = set(split.test)
    assert read, "the spy saw no reads"
    assert not set(read) & test, "the search read test samples"
    assert trained_on and all(not s & test for s in trained_on)
    assert set(read) <= set(split.dev)
    # the final stage, and only it, reads the test classes (the spy works)
    read.clear()
    bench.final()
    assert set(read) & test and set(classes_seen) == test


def test_cli_rejects_a_method_that_changes_a_fixed_setting(tmp_path):
    bad = json.loads(json.dumps(TINY))
    bad["methods"][0]["model"] = {"embedding_size": 128}
    r = subprocess.run(_cli("bench", str(_write(tmp_path, bad)), "--out", str(tmp_path / "o")),
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2
    assert "identical across methods" in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_bench_workers_start_from_python_without_the_cli(tmp_path, data_root, monkeypatch):
    """``Bench.run(workers=2)`` starts its worker processes itself (multiprocessing, no
    ``python -m dmlkit`` subprocess), so the protocol works from Python."""
    import optuna

    from dmlkit.protocol import Bench, bench_config_from_dict
    from dmlkit.protocol.study import count_finished

    real_popen = subprocess.Popen

    def no_dmlkit_cli(cmd, *args, **kwargs):
        assert "dmlkit" not in " ".join(map(str, cmd)), f"the bench shelled out: {cmd}"
        return real_popen(cmd, *args, **kwargs)  # e.g. provenance's `git rev-parse`

    monkeypatch.setattr(subprocess, "Popen", no_dmlkit_cli)
    fixed = {**TINY["fixed"], "data": {"dataset": "att_faces", "transform": "grayscale", "image_size": 28}}
    data = {**TINY, "fixed": fixed, "methods": TINY["methods"][:1],
            "protocol": {**TINY["protocol"], "trials": 2, "seeds": [0]}}
    bench = Bench(bench_config_from_dict(data), tmp_path / "b", data_root=data_root, threads=1)
    assert bench.run(workers=2, stage="search") is None
    study = optuna.load_study(storage=bench.storage_url, study_name="tiny/triplet")
    assert count_finished(study) == 2
    logs = sorted(p.name for p in (tmp_path / "b").glob("worker*-search.log"))
    assert logs == ["worker0-search.log", "worker1-search.log"]


def test_final_runs_trained_with_an_earlier_best_are_trained_again(tmp_path, data_root):
    """A bench resumed with more trials can find a new best: final runs on disk from the old
    best must not be reused (their test numbers would be reported under the new parameters)."""
    import yaml

    from dmlkit.protocol import Bench, bench_config_from_dict
    from dmlkit.protocol.stages import FinalStage

    data = json.loads(json.dumps(TINY))
    data["protocol"].update({"seeds": [0]})
    data["fixed"]["data"]["root"] = str(data_root)
    cfg = bench_config_from_dict(data)
    trained: list[tuple[str, float]] = []

    def fake_train(config, run_dir, **_):
        trained.append((run_dir.name, config.loss.params["neg_margin"]))
        write_fake_final_run(config, run_dir)

    bench = Bench(cfg, tmp_path / "b", train_fn=fake_train)
    full = bench.full_dataset()
    stage = FinalStage(cfg, bench.split(full), full, bench.dir, train_fn=fake_train)
    method = cfg.methods[1]  # contrastive, searched over loss.neg_margin
    stage.run_method(method, {"loss.neg_margin": 0.9})
    assert trained == [("fold0", 0.9), ("fold1", 0.9)]
    stage.run_method(method, {"loss.neg_margin": 0.9})  # the same best: reused
    assert len(trained) == 2
    stage.run_method(method, {"loss.neg_margin": 1.3})  # a new best: trained again, from scratch
    assert trained[2:] == [("fold0", 1.3), ("fold1", 1.3)]
    saved = yaml.safe_load((bench.dir / "final" / "contrastive" / "seed0" / "fold1" / "config.yaml").read_text())
    assert saved["loss"]["params"]["neg_margin"] == 1.3


def test_final_stage_with_workers_before_any_search_is_one_line(tmp_path, data_root):
    """The coordinator spawned the final workers, which each failed in their logs; the error
    said to rerun the same command, which failed the same way forever."""
    from dmlkit.exceptions import DmlkitError
    from dmlkit.protocol import Bench
    from dmlkit.protocol.config import bench_config_from_dict

    bench = Bench(bench_config_from_dict(TINY), tmp_path / "b", data_root=data_root)
    with pytest.raises(DmlkitError, match="no search study for 'triplet': run the search first"):
        bench.run(workers=2, stage="final")
    assert not list((tmp_path / "b").glob("worker*.log"))
