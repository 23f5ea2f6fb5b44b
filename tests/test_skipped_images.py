"""``skip_corrupt=true`` names every image it left out: ``dmlkit train`` (``dmlkit bench``)
writes them all, with the reason of each, to ``RUN_DIR/skipped.txt`` (``BENCH_DIR/skipped.txt``)
and its warning says where (the warning named one of six, and the others were in ``ds.skipped``
only, in Python)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from _reference import tiny_sections
from dmlkit.data import load_dataset
from dmlkit.data.skipped import SkippedImagesWarning, holding_skip_warnings, record_skipped
from dmlkit.exceptions import DataError
from test_bench_preflight import bench_dict
from test_preflight import NAMES, make_folder

pytestmark = pytest.mark.usefixtures("one_thread")

BAD = {"a/bad0.png": b"not a png", "a/bad1.png": b"", "d/bad2.jpg": b"\xff\xd8\xff\xe0 truncated"}


def _folder(root: Path) -> Path:
    """Four classes of three readable 16 x 16 PNGs, and three unreadable files in two of them."""
    rng = np.random.default_rng(0)
    for i, name in enumerate("abcd"):
        (root / name).mkdir(parents=True)
        for j in range(3):
            img = np.clip(40 + 50 * i + rng.normal(0, 20, (16, 16)), 0, 255).astype(np.uint8)
            Image.fromarray(img, mode="L").save(root / name / f"{j}.png")
    for rel, data in BAD.items():
        (root / rel).write_bytes(data)
    return root


def _listed(path: Path) -> dict[str, str]:
    """``{file: reason}`` of a ``skipped.txt`` (its comment line left out)."""
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# 3 unreadable image(s) skipped by skip_corrupt=true")
    return dict(line.split("\t", 1) for line in lines[1:])


def test_train_lists_every_skipped_image_with_its_reason_in_the_run_dir(tmp_path, run_cli):
    data = _folder(tmp_path / "data")
    config = {"name": "skips", "seed": 0,
              "data": {"dataset": "image_folder", "transform": "grayscale", "image_size": 16,
                       "options": {"skip_corrupt": True}},
              **tiny_sections(),
              "sampler": {"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 1},
              "training": {"epochs": 1, "device": "cpu"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    code, _, err = run_cli(["train", str(tmp_path / "c.yaml"), "--data-root", str(data), "--run-dir", str(run), "-q"])
    assert code == 0, err
    listed = _listed(run / "skipped.txt")
    assert sorted(listed) == sorted(str(data / rel) for rel in BAD)
    assert all(reason.strip() and reason != "unreadable" for reason in listed.values())
    assert "cannot identify image file" in listed[str(data / "a" / "bad0.png")]
    # one warning, naming the list; not the dataset's own as well
    said = [line for line in " ".join(err.split()).split("warning: ") if "unreadable" in line]
    assert len(said) == 1 and f"listed in {run / 'skipped.txt'}" in said[0] and "skipped 3 unreadable" in said[0]


def test_bench_lists_the_skipped_images_in_the_bench_dir(tmp_path, run_cli, monkeypatch):
    def broken_train(*args, **kwargs):  # the search then ends at once (exit 2)
        raise RuntimeError("out of memory")

    folder = make_folder(tmp_path / "f")
    (folder / NAMES[0] / "bad.png").write_bytes(b"not a png")
    data = bench_dict(folder)
    data["protocol"].update(folds=2, trials=1)
    data["fixed"]["sampler"] = {"classes_per_batch": 2, "samples_per_class": 4}
    data["fixed"]["data"]["options"] = {"skip_corrupt": True}
    data["methods"] = data["methods"][:1]
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setattr("dmlkit.protocol.stages.train", broken_train)
    out = tmp_path / "out"
    code, _, err = run_cli(["bench", str(tmp_path / "bench.yaml"), "-o", str(out), "--stage", "search"])
    assert code == 2 and "every search trial failed" in err
    lines = (out / "skipped.txt").read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"{folder / NAMES[0] / 'bad.png'}\tcannot identify image file")
    said = [line for line in " ".join(err.split()).split("warning: ") if "unreadable" in line]
    assert len(said) == 1 and f"listed in {out / 'skipped.txt'}" in said[0]


def test_a_failed_command_gives_the_held_warning_as_it_was(tmp_path):
    data = _folder(tmp_path / "data")
    with pytest.warns(SkippedImagesWarning, match=r"skipped 3 unreadable image\(s\).*ds\.skipped lists them all"):
        with pytest.raises(DataError, match="refused"), holding_skip_warnings():
            load_dataset("image_folder", root=data, skip_corrupt=True)
            raise DataError("refused")


def test_record_skipped_writes_the_list_and_clears_only_its_own_stale_one(tmp_path):
    data = _folder(tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    with holding_skip_warnings():
        ds = load_dataset("image_folder", root=data, skip_corrupt=True)
    with pytest.warns(SkippedImagesWarning, match=f"listed in {out / 'skipped.txt'}"):
        assert record_skipped(ds, out) == out / "skipped.txt"
    assert sorted(_listed(out / "skipped.txt")) == sorted(ds.skipped)
    for rel in BAD:  # the data fixed: the old list would be stale
        (data / rel).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert record_skipped(load_dataset("image_folder", root=data, skip_corrupt=True), out) is None
    assert not (out / "skipped.txt").exists()
    (out / "skipped.txt").write_text("my own notes\n")  # a user's file of that name stays
    record_skipped(load_dataset("image_folder", root=data, skip_corrupt=True), out)
    assert (out / "skipped.txt").read_text() == "my own notes\n"
