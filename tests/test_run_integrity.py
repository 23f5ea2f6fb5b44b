"""A run directory stays what its ``metrics.json`` describes.

* ``dmlkit embed RUN/checkpoints/last.pt`` (no ``-o``) writes ``embeddings/test-last.npz``:
  it used to replace ``embeddings/test.npz``, the best checkpoint's test embeddings that
  ``metrics.json`` describes and ``evaluate``/``compare``/``report`` read.
* A refused ``dmlkit train`` leaves nothing: ``--resume`` into a missing directory left
  ``train.lock`` (and the directory) behind; a resume refused for another number of processes
  removed ``metrics.json`` and ``embeddings/test.npz`` and rewrote ``config.yaml`` first.
* A relative ``data.root`` in a config file is stored absolute (from the working directory,
  as ``--data-root``) in the run's ``config.yaml``: it stayed relative, and ``dmlkit embed``
  from another directory read another root.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from _reference import omniglot_run_config

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(tmp_path: Path, **data: object) -> Path:
    """A one-step Omniglot run (4 x 4 batch, 10 test classes), written to ``tmp_path``."""
    return omniglot_run_config(
        tmp_path, "integrity", train=range(0, 12), val=range(12, 16), data=data,
        sampler={"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 1},
        training={"epochs": 1, "device": "cpu"})


def _files(run: Path) -> dict[Path, tuple[int, bytes]]:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}


@pytest.fixture
def trained_run(tmp_path, data_root, run_cli) -> Path:
    run = tmp_path / "run"
    code, out, err = run_cli(["train", str(_config(tmp_path)), "--run-dir", str(run), "--data-root",
                              str(data_root), "--quiet"])
    assert code == 0, err
    assert (run / "checkpoints" / "last.pt").is_file() and (run / "embeddings" / "test.npz").is_file()
    return run


def test_embedding_another_checkpoint_keeps_the_runs_test_embeddings(trained_run, run_cli):
    run = trained_run
    best = run / "embeddings" / "test.npz"
    before = (best.stat().st_mtime_ns, best.stat().st_ino, best.read_bytes())
    code, out, err = run_cli(["embed", str(run / "checkpoints" / "last.pt"), "--quiet"])
    assert code == 0, err
    written = run / "embeddings" / "test-last.npz"
    assert written.is_file() and f"wrote {written}" in " ".join(out.split())
    assert (best.stat().st_mtime_ns, best.stat().st_ino, best.read_bytes()) == before
    # another split of another checkpoint: named after both
    code, out, err = run_cli(["embed", str(run / "checkpoints" / "last.pt"), "--split", "val", "--quiet"])
    assert code == 0, err
    assert (run / "embeddings" / "val-last.npz").is_file() and not (run / "embeddings" / "val.npz").exists()
    # shards of another checkpoint: their own directory too
    code, out, err = run_cli(["embed", str(run / "checkpoints" / "last.pt"), "--format", "shards", "--quiet"])
    assert code == 0, err
    assert (run / "embeddings" / "test-last-shards").is_dir()
    # the best checkpoint (or the run directory) embeds what metrics.json describes: test.npz
    code, out, err = run_cli(["embed", str(run), "--quiet"])
    assert code == 0, err
    assert f"wrote {best}" in " ".join(out.split())


def test_a_refused_resume_leaves_nothing(tmp_path, data_root, run_cli):
    new = tmp_path / "deep" / "new"
    code, out, err = run_cli(["train", str(_config(tmp_path)), "--run-dir", str(new), "--data-root",
                              str(data_root), "--quiet", "--resume"])
    assert code == 2 and "nothing to resume" in err
    assert not (tmp_path / "deep").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = run_cli(["train", str(_config(tmp_path)), "--run-dir", str(empty), "--data-root",
                              str(data_root), "--quiet", "--resume"])
    assert code == 2 and "nothing to resume" in err
    assert empty.is_dir() and list(empty.iterdir()) == []


def test_a_resume_refused_for_another_world_size_leaves_the_run_untouched(trained_run, data_root, run_cli,
                                                                          tmp_path):
    from dmlkit.training.checkpoint import read_checkpoint, save_checkpoint

    run = trained_run
    last = run / "checkpoints" / "last.pt"
    payload = read_checkpoint(last)
    payload.pop("digest", None)
    payload["world_size"] = 2  # as if two processes had trained it
    save_checkpoint(payload, last)
    before = _files(run)
    code, out, err = run_cli(["train", str(_config(tmp_path)), "--run-dir", str(run), "--data-root",
                              str(data_root), "--quiet", "--resume", "--set", "training.epochs=2"])
    assert code == 2 and "2 process(es)" in err
    assert _files(run) == before  # metrics.json and embeddings/test.npz still there, config.yaml as it was


def test_a_relative_data_root_in_a_config_file_is_stored_absolute(tmp_path, data_root, run_cli, monkeypatch):
    (tmp_path / "dlink").symlink_to(Path(data_root).resolve(), target_is_directory=True)
    config = _config(tmp_path, root="dlink")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DMLKIT_DATA", raising=False)  # the root comes from the config alone
    code, out, err = run_cli(["train", str(config), "--run-dir", "run", "--quiet"])
    assert code == 0, err
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["data"]["root"]
    assert stored == str(tmp_path / "dlink")  # absolute, from the working directory (links kept)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(["embed", str(tmp_path / "run"), "--split", "val", "--quiet"])
    assert code == 0, err
    assert os.path.isfile(tmp_path / "run" / "embeddings" / "val.npz")


def test_a_failed_locked_block_removes_only_what_the_lock_created(tmp_path):
    """The shared mechanism under train's and bench's refusals (``dmlkit.utils.directory_lock``)."""
    from dmlkit.utils import directory_lock

    new = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError), directory_lock(new, "x.lock", "busy"):
        raise RuntimeError("refused")
    assert not (tmp_path / "a").exists()  # lock file and both folders it made
    with pytest.raises(RuntimeError), directory_lock(new, "x.lock", "busy"):
        (new / "out.txt").write_text("written")
        raise RuntimeError("failed after writing")
    assert sorted(p.name for p in new.iterdir()) == ["out.txt"]  # the block's file keeps its folder
    (new / "x.lock").touch()
    with pytest.raises(RuntimeError), directory_lock(new, "x.lock", "busy"):
        raise RuntimeError("refused")
    assert (new / "x.lock").exists()  # not this call's: left alone
    with directory_lock(tmp_path / "c", "x.lock", "busy"):
        pass
    assert (tmp_path / "c" / "x.lock").exists()  # a run that ends well keeps its lock file
