"""Small audit fixes: LFW hidden files, fractional class folds, a NaN seed in the CSV, and the
report's bold cells when no method is ranked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmlkit.data.pairs import load_lfw
from dmlkit.data.splits import kfold_class_partitions
from dmlkit.embeddings import load_embeddings
from dmlkit.exceptions import ConfigError, NonFiniteError
from dmlkit.protocol.results import render_csv
from dmlkit.report.builder import ReportOptions, build_report


def _photo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), color=(10, 20, 30)).save(path)


def test_lfw_skips_hidden_files_at_every_level(tmp_path):
    root = tmp_path / "lfw"
    for name in ("Alice", "Bob"):
        _photo(root / name / f"{name}_0001.jpg")
        _photo(root / name / f"{name}_0002.jpg")
    (root / "Alice" / "._Alice_0001.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # a macOS stub
    _photo(root / "Bob" / ".ipynb_checkpoints" / "Bob_0001.jpg")  # a notebook's copy
    data = load_lfw(root)
    assert sorted(data.class_names.values()) == ["Alice", "Bob"]
    assert len(data) == 4


def test_fractional_class_folds_are_refused():
    with pytest.raises(ConfigError, match="k must be an integer of at least 2"):
        kfold_class_partitions(range(8), 2.5)
    assert len(kfold_class_partitions(range(8), 2)) == 2


def test_a_nan_seed_is_nan_in_the_csv_read_back():
    cell = {"mean": None, "ci95": None, "n": 2, "values": [0.5, None]}
    results = {"metrics": ["map_at_r"], "methods": {"ms": {"concatenated": {"map_at_r": cell},
                                                           "separated": {"map_at_r": cell}}}}
    lines = render_csv(results).splitlines()
    assert lines[1].endswith("0.500000 nan")


def test_no_bold_cell_when_only_the_untrained_row_is_shown(tmp_path):
    cell = {"mean": 0.5, "ci95": 0.01, "values": [0.5]}
    metrics = ("precision_at_1", "r_precision", "map_at_r")
    methods = {"pretrained": {mode: {m: cell for m in metrics} for mode in ("concatenated", "separated")}}
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods}))
    html = build_report(tmp_path, options=ReportOptions(maps=())).read_text()
    assert "50.00 ± 1.00" in html and 'class="best"' not in html


@pytest.mark.parametrize("value, message", [(1e39, "beyond float32's range"), (float("nan"), "NaN or infinity")])
def test_load_embeddings_refuses_values_float32_cannot_hold(tmp_path, value, message):
    path = tmp_path / "e.npz"
    np.savez(path, embeddings=np.array([[value, 0.0], [1.0, 1.0]]), labels=np.array([0, 1]))
    with pytest.raises(NonFiniteError, match=message):  # 1e39 was cast to inf with a numpy warning
        load_embeddings(path)
