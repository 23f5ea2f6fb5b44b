"""Command-line audit of train / embed / bench / verify: options accepted and then silently
ignored are refused with one error line (exit 2), summary lines show only computed metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def emb_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 8)
    emb = rng.normal(size=(80, 16)).astype(np.float32) + labels[:, None] * 0.3
    path = tmp_path / "e.npz"
    np.savez(path, embeddings=emb, labels=labels)
    return path


# -- verify: options of the other pair source ---------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["--images", "somewhere"], "--images"),       # locates a pair list's images: no list here
    (["--device", "cuda"], "--device"),            # embeds with --checkpoint: none here
])
def test_verify_refuses_pair_list_options_without_a_pair_list(run_cli, emb_file, args, option):
    code, out, err = run_cli(["verify", str(emb_file), "--pairs", "100", "--json", *args])
    assert code == 2 and out == ""
    assert err.startswith("error: ") and option in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("option", ["--pairs", "--seed"])
def test_verify_refuses_random_pair_options_with_a_pair_list(run_cli, emb_file, tmp_path, option):
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("a.png,b.png,1\n")
    code, out, err = run_cli(["verify", str(emb_file), "--pair-list", str(pairs), option, "100"])
    assert code == 2 and out == "" and option in err and "--pair-list" in err


def test_verify_random_pairs_still_take_their_options(run_cli, emb_file):
    code, out, err = run_cli(["verify", str(emb_file), "--pairs", "100", "--seed", "3", "-q", "--json"])
    assert code == 0, err
    assert json.loads(out)["num_pairs"] == 100


# -- train ------------------------------------------------------------------------------------------

def test_train_refuses_allow_world_size_change_without_resume(run_cli, tmp_path):
    run = tmp_path / "run"
    code, out, err = run_cli(["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir", str(run),
                              "--data-root", str(tmp_path / "no-data"), "--allow-world-size-change"])
    assert code == 2 and out == ""
    assert "--allow-world-size-change" in err and "--resume" in err
    assert not run.exists()


def test_train_summary_shows_only_computed_metrics(run_cli, tmp_path, monkeypatch):
    """With training.eval_metrics without precision_at_1 the summary line said 'P@1 nan %'."""
    import dmlkit.training
    from dmlkit.training.trainer import TrainResult

    def fake_train(cfg, out_dir, **kwargs):
        return TrainResult(run_dir=Path(out_dir), best_checkpoint=Path(out_dir) / "best.pt", best_step=3,
                           val_metrics={"map_at_r": 0.25}, history=[], test_metrics={"map_at_r": 0.5})

    monkeypatch.setattr(dmlkit.training, "train", fake_train)
    code, out, err = run_cli(["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir",
                              str(tmp_path / "run"), "-q", "--set", "training.eval_metrics=[map_at_r]"])
    assert code == 0, err
    line = out.strip().splitlines()[-1]
    assert line.startswith("test MAP@R 50.00 %") and "nan" not in line and "P@1" not in line


# -- bench ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["--max-trials", "2"], "--max-trials"),      # bounds a --worker only
    (["--worker", "--workers", "2"], "--workers"),  # a --worker is one process
])
def test_bench_refuses_options_of_the_other_mode(run_cli, tmp_path, args, option):
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["bench", str(REPO / "configs" / "bench_quick.yaml"), "--out", str(out_dir),
                              "--data-root", str(tmp_path / "no-data"), *args])
    assert code == 2 and out == ""
    assert option in err and "--worker" in err and "not found" not in err
    assert not out_dir.exists()


def test_bench_bad_thread_variable_is_one_error_line(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("DMLKIT_NUM_THREADS", "abc")
    code, out, err = run_cli(["bench", str(REPO / "configs" / "bench_quick.yaml"), "--out",
                              str(tmp_path / "bench"), "--data-root", str(tmp_path / "no-data")])
    assert code == 2 and "DMLKIT_NUM_THREADS" in err and "Traceback" not in err


def test_train_progress_logs_go_to_stderr_not_stdout(run_cli, tmp_path, monkeypatch):
    """stdout holds results only: a run that logged progress and then failed printed its
    'epoch 1 ...: val MAP@R 0.15' log lines on stdout beside nothing else (docs/errors.md)."""
    import logging

    import dmlkit.training
    from dmlkit.exceptions import CheckpointError

    def failing_train(cfg, out_dir, **kwargs):
        logging.getLogger("dmlkit.training").info("epoch 1 step 2: val MAP@R 0.1496")
        raise CheckpointError("cannot write run/log.jsonl: No space left on device")

    monkeypatch.setattr(dmlkit.training, "train", failing_train)
    code, out, err = run_cli(["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir",
                              str(tmp_path / "run")])
    logging.getLogger("dmlkit").setLevel(logging.WARNING)
    assert code == 2 and out == ""
    assert "val MAP@R 0.1496" in err and "No space left" in err


def test_oneshot_table_marks_its_percent(run_cli, monkeypatch):
    """The table showed 'error_percent 77.2500': tables give percent with two decimals, the row
    marked (%) (docs/metrics.md); JSON keeps the documented error_percent key."""
    import dmlkit.apps
    import dmlkit.apps.fewshot
    import dmlkit.training
    from dmlkit.config import config_from_dict

    config = config_from_dict({"data": {"dataset": "omniglot"}, "loss": {"name": "contrastive"}})
    monkeypatch.setattr(dmlkit.training, "load_checkpoint", lambda checkpoint: (None, config))
    monkeypatch.setattr(dmlkit.apps.fewshot, "model_image_embedder", lambda model, config: None)
    monkeypatch.setattr(dmlkit.apps, "load_omniglot_one_shot_runs", lambda root: [])
    monkeypatch.setattr(dmlkit.apps, "omniglot_one_shot_error", lambda embedder, runs, distance: {
        "error_percent": 77.25, "per_run_error_percent": [77.25] * 20, "runs": 20})
    code, out, err = run_cli(["oneshot", "run"])
    assert code == 0, err
    assert "error (%)" in out and "77.25 " in out and "77.2500" not in out
    code, out, err = run_cli(["oneshot", "run", "--json"])
    assert code == 0 and json.loads(out)["error_percent"] == 77.25


def test_bench_worker_final_stage_refuses_max_trials(run_cli, tmp_path):
    """--max-trials bounds search trials; a --worker --stage final runs none (it was ignored)."""
    code, out, err = run_cli(["bench", str(REPO / "configs" / "bench_quick.yaml"), "--out", str(tmp_path / "b"),
                              "--data-root", str(tmp_path / "no-data"), "--worker", "--stage", "final",
                              "--max-trials", "2"])
    assert code == 2 and out == "" and "--max-trials" in err and "not found" not in err


def test_train_malformed_local_rank_is_one_error_line(run_cli, tmp_path, monkeypatch):
    """A LOCAL_RANK that is not a number raised a ValueError traceback (WORLD_SIZE's own check
    already gave one line)."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
                        "LOCAL_RANK": "x"}.items():
        monkeypatch.setenv(name, value)
    code, out, err = run_cli(["train", str(REPO / "configs" / "quickstart.yaml"), "--run-dir",
                              str(tmp_path / "run"), "-q"])
    assert code == 2 and out == "" and "LOCAL_RANK='x'" in err and "Traceback" not in err


def test_a_relative_data_root_is_recorded_absolute(tmp_path, monkeypatch):
    """`train --data-root dlink` recorded `data.root: dlink` in the run's config.yaml, so
    `dmlkit embed RUN` from another directory looked for the data in the wrong place."""
    from dmlkit.config import load_config
    from dmlkit.training.data_root import with_data_root

    monkeypatch.chdir(tmp_path)
    config = load_config(REPO / "configs" / "quickstart.yaml", [])
    assert config.data.root is None
    recorded = with_data_root(config, "dlink").data.root
    assert recorded == str(tmp_path / "dlink")
    assert with_data_root(config, None).data.root is None  # $DMLKIT_DATA still applies
