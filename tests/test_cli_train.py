"""`dmlkit train` / `dmlkit embed` end to end on a small real Omniglot slice.

The slow test: train -> checkpoint -> SIGKILL mid-run -> --resume (bit-identical weights to an
uninterrupted run) -> embed -> evaluate.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from _reference import omniglot_run_config, run_cli

REPO = Path(__file__).resolve().parents[1]


def _write_config(tmp_path: Path, epochs: int = 4) -> Path:
    return omniglot_run_config(
        tmp_path, "cli-slice", train=range(0, 20), val=range(20, 26),
        miner={"name": "semi_hard"},
        sampler={"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 6},
        training={"epochs": epochs, "device": "cpu", "log_every": 2, "csv_log": True})


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dmlkit", *args], capture_output=True, text=True,
                          env=env, timeout=300)


pytestmark = pytest.mark.usefixtures("one_thread")


def _run_main(capsys, *args: str) -> tuple[int, str]:
    code, out, err = run_cli(capsys, *args)
    return code, " ".join((out + err).split())  # rich wraps long lines


def test_bad_config_is_reported_without_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"data": {"dataset": "omniglot"}, "loss": {"name": "triplet"},
                                    "model": {"embeding_size": 3}}))
    code, text = _run_main(capsys, "train", str(path), "--run-dir", str(tmp_path / "run"))
    assert code == 2
    assert "model.embeding_size" in text and "Traceback" not in text
    code, text = _run_main(capsys, "train", str(path), "--set", "oops")
    assert code == 2 and "key.sub=value" in text


def test_embed_without_checkpoint_says_what_to_do(tmp_path, capsys):
    code, text = _run_main(capsys, "embed", str(tmp_path))
    assert code == 2 and "no checkpoint" in text
    code, text = _run_main(capsys, "embed", str(tmp_path / "missing.pt"))
    assert code == 2 and "not found" in text


def test_train_refuses_to_overwrite_a_run(tmp_path, capsys, data_root):
    cfg = _write_config(tmp_path, epochs=1)
    run = tmp_path / "run"
    code, text = _run_main(capsys, "train", str(cfg), "--run-dir", str(run), "--data-root",
                           str(data_root), "--quiet", "--set", "sampler.batches_per_epoch=1")
    assert code == 0, text
    assert "test MAP@R" in text
    # the table marks its unit as every dmlkit table does, and says how the run ended in words
    assert "MAP@R (%)" in text and "P@1 (%)" in text and "all epochs done after" in " ".join(text.split())
    code, text = _run_main(capsys, "train", str(cfg), "--run-dir", str(run), "--data-root",
                           str(data_root), "--quiet", "--set", "sampler.batches_per_epoch=1")
    assert code == 2 and "--resume" in text


@pytest.mark.slow
def test_train_kill_resume_embed_evaluate(tmp_path, data_root):
    cfg = _write_config(tmp_path, epochs=5)
    full, killed = tmp_path / "full", tmp_path / "killed"
    common = ["--data-root", str(data_root), "--quiet"]

    done = _cli("train", str(cfg), "--run-dir", str(full), *common)
    assert done.returncode == 0, done.stderr
    assert "test MAP@R" in done.stdout
    metrics = json.loads((full / "metrics.json").read_text())
    assert {"best_step", "val", "test"} <= set(metrics)
    assert (full / "log.csv").exists() and (full / "split.json").exists()

    # start the same run, SIGKILL it as soon as its first checkpoint exists, then resume
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dmlkit", "train", str(cfg), "--run-dir",
                             str(killed), *common], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    last = killed / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while not last.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last.exists()
    step_at_kill = torch.load(last, weights_only=True)["step"]
    assert step_at_kill < 30, "the run finished before it could be killed"

    resumed = _cli("train", str(cfg), "--run-dir", str(killed), "--resume", *common)
    assert resumed.returncode == 0, resumed.stderr
    a = torch.load(full / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(last, weights_only=True)
    assert a["step"] == b["step"] == 30
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert json.loads((killed / "metrics.json").read_text()) == metrics

    out = tmp_path / "emb.npz"
    embedded = _cli("embed", str(killed), "--split", "test", "-o", str(out), "--data-root",
                    str(data_root), "--quiet")
    assert embedded.returncode == 0, embedded.stderr
    with np.load(out) as x, np.load(full / "embeddings" / "test.npz") as y:
        assert x["embeddings"].shape == (200, 16)
        np.testing.assert_allclose(x["embeddings"], y["embeddings"], rtol=1e-5, atol=1e-6)
        assert np.array_equal(x["labels"], y["labels"])

    from dmlkit.metrics import evaluate

    with np.load(out) as x:
        again = evaluate(x["embeddings"], x["labels"], metrics=["map_at_r", "precision_at_1"])
    assert again["map_at_r"] == pytest.approx(metrics["test"]["map_at_r"], abs=1e-6)
    evaluated = _cli("evaluate", str(out), "--json", "--metrics", "map_at_r,precision_at_1")
    assert evaluated.returncode == 0, evaluated.stderr
    printed = json.loads(evaluated.stdout)
    assert printed["map_at_r"] == pytest.approx(metrics["test"]["map_at_r"], abs=1e-6)
    assert printed["precision_at_1"] == pytest.approx(metrics["test"]["precision_at_1"], abs=1e-6)


@pytest.mark.slow
def test_train_from_python_writes_the_same_run_directory_as_the_cli(tmp_path, capsys, data_root):
    """``dmlkit.training.train`` owns the run directory: split.json, test embeddings, metrics."""
    from dmlkit.config import load_config
    from dmlkit.training import train

    cfg = _write_config(tmp_path, epochs=1)
    sets = ["--set", "sampler.batches_per_epoch=2"]
    code, text = _run_main(capsys, "train", str(cfg), "--run-dir", str(tmp_path / "cli"), "--data-root",
                           str(data_root), "--quiet", *sets)
    assert code == 0, text
    result = train(load_config(cfg, ["sampler.batches_per_epoch=2"]), tmp_path / "py", progress=False,
                   data_root=data_root)

    def files(run):
        return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())

    assert files(tmp_path / "cli") == files(tmp_path / "py")
    assert {"split.json", "embeddings/test.npz", "metrics.json", "config.yaml"} <= set(files(tmp_path / "py"))
    cli_metrics = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert json.loads((tmp_path / "py" / "metrics.json").read_text()) == cli_metrics
    assert result.test_metrics == cli_metrics["test"]
    assert yaml.safe_load((tmp_path / "py" / "config.yaml").read_text())["data"]["root"] == str(data_root)
    with np.load(tmp_path / "cli" / "embeddings" / "test.npz") as a, np.load(tmp_path / "py" / "embeddings" / "test.npz") as b:
        np.testing.assert_array_equal(a["embeddings"], b["embeddings"])
        np.testing.assert_array_equal(a["indices"], b["indices"])


def test_a_refused_train_leaves_the_existing_run_untouched(tmp_path, data_root, capsys):
    """Training into a directory that holds a run, without --resume, is refused before any file
    of the run is written (split.json used to be overwritten first, so it no longer matched
    best.pt)."""
    config = _write_config(tmp_path, epochs=1)
    run = tmp_path / "run"
    code, _ = _run_main(capsys, "train", str(config), "--run-dir", str(run), "--data-root", str(data_root),
                        "--quiet", "--set", "sampler.batches_per_epoch=2")
    assert code == 0
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    changed = yaml.safe_load(config.read_text())
    changed["seed"] = 7
    changed["data"]["split"] = {"kind": "default", "val_fraction": 0.1}  # would write another split
    config.write_text(yaml.safe_dump(changed))
    code, err = _run_main(capsys, "train", str(config), "--run-dir", str(run), "--data-root", str(data_root),
                          "--quiet")
    assert code == 2 and "already holds a run" in err and "--resume" in err
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_every_run_has_a_step_0_baseline(tmp_path, data_root, capsys):
    config = _write_config(tmp_path, epochs=1)
    run = tmp_path / "run"
    code, text = _run_main(capsys, "train", str(config), "--run-dir", str(run), "--data-root", str(data_root),
                           "--set", "sampler.batches_per_epoch=2")
    assert code == 0, text
    metrics = json.loads((run / "metrics.json").read_text())
    assert set(metrics["baseline"]) == {"val", "test"}
    assert json.loads((run / "baseline.json").read_text()) == metrics["baseline"]
    assert 0 <= metrics["baseline"]["test"]["map_at_r"] <= 1
    assert "step 0 (untrained)" in text


def test_the_baseline_warning_names_the_split_and_the_numbers():
    from dmlkit.training.trainer import baseline_warnings

    base = {"val": {"map_at_r": 0.39}, "test": {"map_at_r": 0.39}}
    lines = baseline_warnings(base, {"val": {"map_at_r": 0.45}, "test": {"map_at_r": 0.358}})
    assert len(lines) == 1 and "on test: MAP@R 35.80 after training vs 39.00 at step 0" in lines[0]
    assert baseline_warnings(base, {"val": {"map_at_r": 0.4}, "test": None}) == []
