"""Result files: readable by the group/world as the umask allows, strict JSON, atomic."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from dmlkit.utils import atomic_write_json, atomic_write_text


def test_result_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "a.txt", "x")
        assert path.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        path = atomic_write_json(tmp_path / "b.json", {"x": 1})
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_json_is_strict_nan_and_inf_become_null(tmp_path):
    path = atomic_write_json(tmp_path / "m.json", {
        "map_at_r": float("nan"), "p": [1.0, float("inf")], "arr": np.array([0.5, np.nan]),
        "np": np.float32("nan"), "ok": 0.25, "n": 3,
    })
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(name):  # strict parsing: the constants other JSON readers reject
        raise AssertionError(name)

    data = json.loads(text, parse_constant=refuse)
    assert data == {"map_at_r": None, "p": [1.0, None], "arr": [0.5, None], "np": None, "ok": 0.25, "n": 3}
    assert not any(isinstance(v, float) and math.isnan(v) for v in data["p"])
