"""Security audit s42, file handling: what dmlkit removes, extracts, writes and loads stays inside
the folder it works on, and hostile JSON is one error line.

* F1: ``track build-data OUT`` removed whatever ``OUT/meta.json`` listed (``../x``, absolute
  paths): only plain names inside OUT are removed now, anything else is refused first.
* F2: the Cars196 / SOP downloads were extracted by torchvision's ``tarfile.extractall`` with no
  filter: ``../``, absolute and link members wrote outside the data root.
* F3: ``atomic_write_bytes`` wrote through a symbolic link planted in a run directory
  (``report.html -> ~/.bashrc``), ``log.jsonl`` was appended through one, and a lock file
  (``train.lock``, ``build.lock``) was truncated through one.
* F5: a checkpoint's ``trunk_file`` was joined unchecked (an absolute path loaded any file).
* F8: JSON nested 100,000 deep raised ``RecursionError`` (a traceback) where corrupt JSON is one
  ``DataError`` line.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dmlkit.exceptions import CheckpointError, ConfigError, DataError

DEEP = '{"a":' * 100_000 + "1" + "}" * 100_000


# -- F1: build-data removes only its own sequences -------------------------------------------
def _planted_build(tmp_path: Path) -> tuple[Path, list[Path]]:
    """An OUT whose meta.json names a ``../`` folder, an absolute folder and an absolute file."""
    rel = tmp_path / "VICTIM_REL"
    (rel / "sub").mkdir(parents=True)
    (rel / "sub" / "thesis.tex").write_text("years of work")
    absolute = tmp_path / "VICTIM_ABS"
    absolute.mkdir()
    (absolute / "notes.txt").write_text("keep")
    afile = tmp_path / "VICTIM_FILE.txt"
    afile.write_text("keep")
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "test").mkdir()
    (out / "meta.json").write_text(json.dumps({"train": {"../../VICTIM_REL": {}, str(afile): {}},
                                               "test": {str(absolute): {}}}))
    return out, [rel / "sub" / "thesis.tex", absolute / "notes.txt", afile]


def test_build_data_refuses_a_meta_json_naming_paths_outside_out(tmp_path, run_cli):
    out, victims = _planted_build(tmp_path)
    code, stdout, err = run_cli(["track", "build-data", str(out), "--train", "1", "--test", "1",
                                 "--frames", "2", "--size", "96x96"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not a plain folder name" in err and "nothing was removed" in err
    assert all(v.exists() for v in victims)
    assert (out / "meta.json").exists()  # nothing of OUT removed either


@pytest.mark.parametrize("name", ["..", "", "a/b"])
def test_build_data_refuses_each_non_plain_name(tmp_path, name):
    from dmlkit.apps.tracking.offline import _clear_earlier_build

    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "test").mkdir()
    (out / "meta.json").write_text(json.dumps({"train": {name: {}}, "test": {}}))
    with pytest.raises(ConfigError, match="not a plain folder name"):
        _clear_earlier_build(out)
    assert (out / "train").is_dir() and (out / "meta.json").exists()


def test_build_data_clears_a_listed_link_not_its_target(tmp_path):
    """A listed sequence that is a symbolic link loses the link; a train/ that is a link out of
    OUT is refused before anything is removed."""
    from dmlkit.apps.tracking.offline import _clear_earlier_build

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "test").mkdir()
    (out / "train" / "seq1").symlink_to(victim, target_is_directory=True)
    (out / "meta.json").write_text(json.dumps({"train": {"seq1": {}}, "test": {}}))
    _clear_earlier_build(out)
    assert not (out / "train" / "seq1").is_symlink() and (victim / "keep.txt").exists()

    out2 = tmp_path / "out2"
    out2.mkdir()
    (out2 / "test").mkdir()
    (out2 / "train").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere" / "seq1").mkdir(parents=True)
    (out2 / "meta.json").write_text(json.dumps({"train": {"seq1": {}}, "test": {}}))
    with pytest.raises(ConfigError, match="outside"):
        _clear_earlier_build(out2)
    assert (tmp_path / "elsewhere" / "seq1").is_dir() and (out2 / "meta.json").exists()


def test_build_data_rebuild_still_replaces_its_own_build(tmp_path):
    from dmlkit.apps.tracking import build_offline_dataset

    out = tmp_path / "d"
    build_offline_dataset(out, num_train=2, num_test=1, train_frames=2, test_frames=2, frame_size=(96, 96))
    build_offline_dataset(out, num_train=1, num_test=1, train_frames=2, test_frames=2, frame_size=(96, 96))
    assert len(list((out / "train").iterdir())) == 1


# -- F2: archive extraction stays inside the root --------------------------------------------
def _add(tar: tarfile.TarFile, name: str, payload: bytes = b"x", **attrs) -> None:
    info = tarfile.TarInfo(name)
    for key, value in attrs.items():
        setattr(info, key, value)
    if info.type == tarfile.REGTYPE:
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    else:
        tar.addfile(info)


def _hostile_tgz(path: Path, outside: Path, kind: str) -> None:
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "car_ims/000001.jpg", b"\xff\xd8")
        if kind == "dotdot":
            _add(tar, "../../OUTSIDE/dotdot.txt")
        elif kind == "absolute":
            _add(tar, str(outside / "abs.txt"))
        else:  # a link out of the root, then a file written through it
            _add(tar, "link_out", type=tarfile.SYMTYPE, linkname=str(outside))
            _add(tar, "link_out/via_link.txt")


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_hostile_tar_is_refused_before_anything_is_extracted(tmp_path, kind):
    from dmlkit.data.datasets import extract_archive

    outside = tmp_path / "OUTSIDE"
    outside.mkdir()
    root = tmp_path / "data" / "cars196"
    root.mkdir(parents=True)
    _hostile_tgz(tmp_path / "car_ims.tgz", outside, kind)
    with pytest.raises(DataError, match="outside") as refused:
        extract_archive(tmp_path / "car_ims.tgz", root)
    assert "\n" not in str(refused.value)
    assert list(outside.iterdir()) == [] and list(root.iterdir()) == []


def test_cars196_download_extracts_safely(tmp_path, monkeypatch):
    """The download path itself (torchvision's fetch replaced by a local copy: no network): the
    archive is extracted by dmlkit, which refuses it; nothing lands outside the data root."""
    import shutil

    import torchvision.datasets.utils as tv_utils

    import dmlkit.data.retrieval_benchmarks as rb

    outside = tmp_path / "OUTSIDE"
    outside.mkdir()
    served = tmp_path / "srv"
    served.mkdir()
    _hostile_tgz(served / "car_ims.tgz", outside, "symlink")
    (served / "cars_annos.mat").write_bytes(b"not a mat")

    def fake_download_url(url, root, filename=None, md5=None, **kw):
        Path(root).mkdir(parents=True, exist_ok=True)
        shutil.copy(served / Path(url).name, Path(root) / (filename or Path(url).name))

    monkeypatch.setattr(tv_utils, "download_url", fake_download_url)
    with pytest.raises(DataError) as refused:
        rb.load_cars196(root=tmp_path / "data", download=True)
    assert list(outside.iterdir()) == []  # was: via_link.txt, written through the link member
    assert "outside" in str(refused.value)
    assert not (tmp_path / "data" / "cars196" / "link_out").is_symlink()
    assert rb.CARS_URL.startswith("https://") and rb.CARS_ANNOS_URL.startswith("https://")


def test_tar_without_the_data_filter_is_refused(tmp_path, monkeypatch):
    from dmlkit.data.datasets import extract_archive

    with tarfile.open(tmp_path / "a.tgz", "w:gz") as tar:
        _add(tar, "d/ok.txt")
    monkeypatch.delattr(tarfile, "data_filter")
    with pytest.raises(DataError, match="cannot extract .* safely.*3.11.4"):
        extract_archive(tmp_path / "a.tgz", tmp_path / "root")
    assert not (tmp_path / "root" / "d").exists()


def test_safe_archives_extract(tmp_path):
    from dmlkit.data.datasets import extract_archive

    with tarfile.open(tmp_path / "a.tgz", "w:gz") as tar:
        _add(tar, "d/ok.txt", b"tar")
        _add(tar, "d/inner_link", type=tarfile.SYMTYPE, linkname="ok.txt")  # a link inside: kept
    extract_archive(tmp_path / "a.tgz", tmp_path / "t")
    assert (tmp_path / "t" / "d" / "ok.txt").read_bytes() == b"tar"
    assert (tmp_path / "t" / "d" / "inner_link").read_bytes() == b"tar"
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        zf.writestr("Stanford_Online_Products/Ebay_train.txt", "zip")
    extract_archive(tmp_path / "a.zip", tmp_path / "z")
    assert (tmp_path / "z" / "Stanford_Online_Products" / "Ebay_train.txt").read_text() == "zip"


@pytest.mark.parametrize("name", ["../escape.txt", "/abs/escape.txt", "a/../../escape.txt"])
def test_zip_member_outside_the_root_is_refused(tmp_path, name):
    from dmlkit.data.datasets import extract_archive

    with zipfile.ZipFile(tmp_path / "a.zip", "w") as zf:
        zf.writestr("ok.txt", "ok")
        zf.writestr(zipfile.ZipInfo(name), "bad")
    root = tmp_path / "r" / "root"
    with pytest.raises(DataError, match="outside"):
        extract_archive(tmp_path / "a.zip", root)
    assert list(root.iterdir()) == []


# -- F3: writes inside a run directory never go through a link out of it ----------------------
def test_a_link_out_of_its_folder_is_not_written_through(tmp_path):
    from dmlkit.utils import atomic_write_figure, atomic_write_text

    victim = tmp_path / "victim_bashrc"
    victim.write_text("# my shell settings\n")
    run = tmp_path / "run"
    (run / "figures").mkdir(parents=True)
    (run / "report.html").symlink_to(victim)
    (run / "figures" / "curves.png").symlink_to(tmp_path / "victim.png")  # dangling: made, not written
    with pytest.raises(DataError, match="symbolic link .* outside its folder") as refused:
        atomic_write_text(run / "report.html", "<!DOCTYPE html>\n  touch PWNED\n")
    assert "\n" not in str(refused.value)
    assert victim.read_text() == "# my shell settings\n" and (run / "report.html").is_symlink()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    try:
        with pytest.raises(DataError, match="outside its folder"):
            atomic_write_figure(fig, run / "figures" / "curves.png")
    finally:
        plt.close(fig)
    assert not (tmp_path / "victim.png").exists()


def test_a_link_inside_its_folder_is_still_written_through(tmp_path):
    from dmlkit.utils import atomic_write_text

    (tmp_path / "real.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to("real.txt")
    atomic_write_text(tmp_path / "link.txt", "new")
    assert (tmp_path / "link.txt").is_symlink() and (tmp_path / "real.txt").read_text() == "new"


def test_shard_manifest_is_not_written_through_a_planted_link(tmp_path):
    from dmlkit.embedding_shards import write_shards

    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "manifest.json").symlink_to(victim)
    with pytest.raises(DataError, match="outside its folder"):
        write_shards(tmp_path / "shards", np.zeros((4, 3), np.float32), np.arange(4), overwrite=True)
    assert victim.read_text() == "keep"


def test_run_log_is_not_appended_through_a_planted_link(tmp_path):
    from dmlkit.training.runlog import RunLogger

    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").symlink_to(victim)
    logger = RunLogger(run)
    with pytest.raises(DataError, match="outside its folder"):
        logger.log({"event": "train", "step": 1})
    assert victim.read_text() == "keep\n"
    (run / "log.jsonl").unlink()
    logger.log({"event": "train", "step": 1})  # a plain log.jsonl appends as before
    logger.close()
    assert json.loads((run / "log.jsonl").read_text())["step"] == 1


def test_a_lock_file_planted_as_a_link_is_not_truncated(tmp_path, run_cli):
    """``directory_lock`` opened ``RUN/train.lock`` (``build.lock``, ``bench.lock``, ...) with
    ``open("a+")`` and wrote its ``PID HOST`` over whatever a planted link named."""
    from dmlkit.utils import directory_lock

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "build.lock").symlink_to(victim)
    code, _, err = run_cli(["track", "build-data", str(out), "--train", "1", "--test", "1",
                            "--frames", "2", "--size", "96x96"])
    assert code == 2 and "outside its folder" in err and len(err.strip().splitlines()) == 1, err
    assert victim.read_text() == "precious\n"
    with directory_lock(tmp_path / "run", "train.lock", "busy"):  # a plain lock names its holder
        assert (tmp_path / "run" / "train.lock").read_text().startswith(f"{os.getpid()} ")


# -- F5: a checkpoint's trunk_file is a plain name beside it ----------------------------------
def _checkpoint(path: Path, trunk_file: str) -> Path:
    from dmlkit.training.checkpoint import CHECKPOINT_FORMAT, content_digest

    payload = {"format": CHECKPOINT_FORMAT, "model": {"head.weight": torch.ones(2)},
               "trunk_file": trunk_file, "step": 1}
    payload["digest"] = content_digest(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_trunk_file_outside_the_checkpoint_folder_is_refused(tmp_path, how):
    from dmlkit.training.checkpoint import read_checkpoint

    outside = tmp_path / "OUTSIDE_secret.pt"
    name = str(outside) if how == "absolute" else "../../OUTSIDE_secret.pt"
    ckpt = _checkpoint(tmp_path / "run" / "checkpoints" / "best.pt", name)
    messages = []
    for exists in (True, False):  # the same error whether the outside file exists or not
        if exists:
            torch.save({"trunk": {"w": torch.zeros(1)}}, outside)
        else:
            outside.unlink()
        with pytest.raises(CheckpointError, match="not a file name beside it") as refused:
            read_checkpoint(ckpt)
        messages.append(str(refused.value))
    assert messages[0] == messages[1] and "\n" not in messages[0]


def test_trunk_file_beside_the_checkpoint_still_loads(tmp_path):
    from dmlkit.training.checkpoint import read_checkpoint

    ckpt = _checkpoint(tmp_path / "checkpoints" / "best.pt", "trunk.pt")
    torch.save({"trunk": {"w": torch.zeros(1)}}, tmp_path / "checkpoints" / "trunk.pt")
    assert set(read_checkpoint(ckpt)["model"]) == {"trunk.w", "head.weight"}


# -- F8: deeply nested JSON is one error line -----------------------------------------------
def test_read_json_of_deeply_nested_json_is_a_data_error(tmp_path):
    from dmlkit.utils import read_json

    (tmp_path / "m.json").write_text(DEEP)
    with pytest.raises(DataError, match="is not a valid metrics file: nested too deeply"):
        read_json(tmp_path / "m.json", "metrics file")


def test_compare_of_deeply_nested_results_is_one_line(tmp_path, run_cli):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "results.json").write_text(DEEP)
    code, _, err = run_cli(["compare", str(tmp_path / "bench")])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "is not a results file" in err


def test_deeply_nested_shard_manifest_is_a_data_error(tmp_path):
    from dmlkit.embedding_shards import open_shards, write_shards

    write_shards(tmp_path / "s", np.zeros((4, 3), np.float32), np.arange(4))
    (tmp_path / "s" / "manifest.json").write_text(DEEP)
    with pytest.raises(DataError, match="cannot read"):
        open_shards(tmp_path / "s")
    # an overwrite reads the old manifest too: an unreadable one lists no files of its own
    write_shards(tmp_path / "s", np.ones((2, 3), np.float32), np.arange(2), overwrite=True)
    assert len(open_shards(tmp_path / "s")) == 2


def test_deeply_nested_log_line_and_build_meta(tmp_path):
    from dmlkit.apps.tracking.offline import _clear_earlier_build
    from dmlkit.training.runlog import read_log

    (tmp_path / "log.jsonl").write_text(DEEP + "\n" + json.dumps({"event": "train", "step": 2}) + "\n")
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [2]
    out = tmp_path / "out"
    out.mkdir()
    (out / "meta.json").write_text(DEEP)
    with pytest.raises(ConfigError, match="earlier build-data did not"):
        _clear_earlier_build(out)
    assert os.path.exists(out / "meta.json")
