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

import json
from pathlib import Path

import pytest

from dmlkit.exceptions import ConfigError

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
