"""Audit findings on the re-id data side: each test failed before its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmlkit.cli import main
from dmlkit.data.reid import _scan, load_att_faces_reid, parse_reid_name
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError, DataError


def test_junk_named_minus_one_is_junk_when_identities_are_names(tmp_path, capsys):
    """Identities saved as names: the junk rule compared codes 0..C-1 with -1, so the junk
    image identical to the query ranked first as a wrong match (Rank-1 0, mAP 0.5)."""
    emb = np.array([[0, 0], [0, 0], [1, 0], [3, 0]], np.float32)  # query, junk, positive, distractor
    cams, groups = np.array([0, 0, 1, 2]), np.array(["query", "gallery", "gallery", "gallery"])
    for name, ids in (("ints", np.array([10, -1, 10, 0])), ("names", np.array(["0010", "-1", "0010", "0000"]))):
        path = tmp_path / f"{name}.npz"
        save_embeddings(path, emb, ids, cams=cams, groups=groups)
        try:
            main(["reid", str(path), "--json", "--examples", "1", "--out", str(tmp_path / f"{name}.json")])
        except SystemExit as exc:
            assert not exc.code
        result = json.loads(capsys.readouterr().out)
        assert (result["rank_1"], result["map"]) == (1.0, 1.0), name
        stored = json.loads((tmp_path / f"{name}.json").read_text())
        assert stored["examples"][0]["status"][:2] == ["junk", "positive"], name


def test_a_missing_run_folder_is_not_called_an_embeddings_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["reid", str(tmp_path / "no_such_run"), "--data-root", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "neither a run directory nor an embeddings file" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"pictures_per_camera": 2.5}, "pictures_per_camera must be a positive integer"),
    ({"query_pictures": [1.5, 6.7]}, "query_pictures must be a positive integer"),
    ({"query_pictures": "2,7"}, "query_pictures must be a list"),
])
def test_att_faces_reid_options_must_be_integers(tmp_path, options, message):
    """2.5 cameras' pictures gave 4 cameras, [1.5, 6.7] pictures 1 and 6, '2,7' a traceback."""
    with pytest.raises(ConfigError, match=message):
        load_att_faces_reid(tmp_path, **options)


def test_a_badly_named_image_names_its_folder_and_camera_zero_is_refused(tmp_path):
    (tmp_path / "query").mkdir()
    (tmp_path / "query" / "c1s1_001061_01.jpg").write_bytes(b"")
    with pytest.raises(DataError, match="query: file name 'c1s1_001061_01.jpg'"):
        _scan(tmp_path / "query")
    with pytest.raises(DataError, match="numbered from c1"):
        parse_reid_name("0014_c0s1_000001_00.jpg")
    assert parse_reid_name("0014_c1s1_000001_00.jpg") == (14, 0)
