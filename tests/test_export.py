"""Export to ONNX / TorchScript with numerical and retrieval parity on real images."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dmlkit.apps.export import export_model, load_embedder, parity_report
from dmlkit.cli import app as cli
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_root):
    from test_service import trained_run

    return trained_run(tmp_path_factory, data_root)


@pytest.fixture(scope="module")
def onnx_export(run, data_root, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    out = tmp_path_factory.mktemp("export") / "model.onnx"
    return export_model(run, "onnx", out, parity_samples=120, data_root=data_root)


def test_onnx_export_has_numerical_and_retrieval_parity(onnx_export, run):
    p = onnx_export["parity"]
    assert p["passed"] and p["num_samples"] == 120 and p["split"] == "test"
    assert p["max_abs_diff"] <= 1e-4
    assert p["top10_identical"] >= 0.99 and p["top10_overlap"] >= 0.99
    assert abs(p["map_at_r_torch"] - p["map_at_r_export"]) <= 1e-3
    manifest = json.loads(Path(onnx_export["parity_file"]).read_text())
    assert manifest["preprocessing"] == {"transform": "grayscale", "image_size": 32, "in_channels": 1,
                                         "input_shape": [1, 32, 32]}
    assert manifest["runtime"] == "onnxruntime" and manifest["embedding_size"] == 16


def test_exported_embedder_matches_the_run_on_real_image_files(onnx_export, run, data_root):
    from PIL import Image

    from dmlkit.data import load_dataset

    ds = load_dataset("att_faces", root=data_root)
    images = [Image.open(ds.paths[i]) for i in (0, 55, 210, 399)]
    torch_emb = load_embedder(run)(images)
    onnx = load_embedder(onnx_export["output"])
    assert onnx.runtime == "onnxruntime"
    np.testing.assert_allclose(onnx(images), torch_emb, atol=1e-4)
    assert torch_emb.shape == (4, 16)


def test_cli_torchscript_export_and_serving_an_export(run, data_root, tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    out = tmp_path / "model.pt"
    res = CliRunner().invoke(cli, ["export", str(run), "--format", "torchscript", "-o", str(out),
                                   "--parity-samples", "60", "--data-root", str(data_root), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["parity"]["passed"] and report["parity"]["max_abs_diff"] <= 1e-5
    assert (tmp_path / "model.pt.json").exists()
    res = CliRunner().invoke(cli, ["index", str(run / "embeddings" / "test.npz"), "-o", str(tmp_path / "idx"),
                                   "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    client = TestClient(create_app(ServiceConfig(index=tmp_path / "idx", model=out)))
    assert client.get("/api/health").json()["model"] == "torchscript"
    item = client.app.state.index.ids[7]
    r = client.post("/api/query/image", files={"file": ("q.pgm", (data_root / item).read_bytes())}, data={"k": "3"})
    assert r.status_code == 200 and r.json()["results"][0]["id"] == item


def test_parity_report_detects_a_mismatch():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(60, 8)).astype(np.float32)
    labels = np.repeat(np.arange(12), 5)
    same = parity_report(a, a.copy(), labels)
    assert same["passed"] and same["max_abs_diff"] == 0 and same["top10_identical"] == 1.0
    off = parity_report(a, a + rng.normal(scale=0.5, size=a.shape).astype(np.float32), labels)
    assert not off["passed"] and off["max_abs_diff"] > 0.1 and off["top10_identical"] < 0.5
    with pytest.raises(DataError, match="shape"):
        parity_report(a, a[:, :4], labels)


def test_export_errors(run, tmp_path):
    with pytest.raises(ConfigError, match="unknown export format"):
        export_model(run, "tflite")
    with pytest.raises(ConfigError, match="parity_samples"):
        export_model(run, "onnx", parity_samples=5)
    with pytest.raises(DataNotFoundError):
        load_embedder(tmp_path / "missing.onnx")
    (tmp_path / "bare.onnx").write_bytes(b"x")
    with pytest.raises(DataError, match="manifest"):
        load_embedder(tmp_path / "bare.onnx")


def test_parity_rows_draw_two_or_more_images_of_each_class():
    from dmlkit.apps.export import _parity_rows

    # Omniglot's test split: 659 classes of 20 images; evenly spread rows would give one image a
    # class (MAP@R NaN, parity "failed")
    labels = np.repeat(np.arange(659), 20)
    rows = _parity_rows(labels, 256)
    _, sizes = np.unique(labels[rows], return_counts=True)
    assert rows.size == 256 and sizes.min() >= 2 and np.unique(rows).size == rows.size
    few = _parity_rows(np.repeat(np.arange(3), [40, 1, 30]), 60)  # a single-image class is skipped
    assert set(np.unique(np.repeat(np.arange(3), [40, 1, 30])[few])) == {0, 2} and few.size == 60
    singles = _parity_rows(np.arange(50), 20)  # no class with two images: rows spread over the split
    assert singles.size == 20 and singles[0] == 0 and singles[-1] == 49


def test_parity_report_passes_when_both_map_at_r_are_undefined():
    a = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    report = parity_report(a, a.copy(), np.arange(20))  # no same-class pair: MAP@R NaN on both sides
    assert report["passed"] and np.isnan(report["map_at_r_torch"])


def test_cli_export_at_an_unsupported_opset_is_one_line(run, data_root, tmp_path, capfd):
    """Nothing on stdout, not even from torch's C++ side: at opset 7 its exporter printed the
    model's whole IR graph (65 lines) to file descriptor 1 before failing. An opset outside the
    range torch's exporter supports is refused before the checkpoint is read."""
    from test_bad_inputs import _run, check_one_error

    pytest.importorskip("onnx")
    for opset, message in (("99", "--opset must be an integer from 7 to"), ("5", "--opset must be an integer from 7 to"),
                           ("7", "ONNX export at opset 7 failed")):
        capfd.readouterr()
        code, out, err = _run(["export", str(run), "--opset", opset, "-o", str(tmp_path / "m.onnx"),
                               "--parity-samples", "12", "--data-root", str(data_root)])
        assert code == 2, out + err
        assert message in check_one_error(code, out, err)
        native = capfd.readouterr().out
        assert native == "", native[:300]
    assert not list(tmp_path.iterdir())  # no partial model left behind


def test_a_model_replaced_after_its_manifest_is_refused_and_disk_errors_are_one_line(run, data_root, tmp_path):
    """The manifest records the model's SHA-256: a model file that is not the one described (an
    export killed between replacing the model and writing its manifest used to leave the new
    model under the old manifest, read with the old preprocessing) is refused. A read-only
    output folder is one DataError, with no temporary file left (torch's own writer raised, or
    aborted the interpreter on a full disk)."""
    from dmlkit.exceptions import DataError

    out = tmp_path / "m.pt"
    manifest = export_model(run, "torchscript", out, parity_samples=24, data_root=data_root)
    assert len(manifest["sha256"]) == 64
    assert load_embedder(out).runtime == "torchscript"
    out.write_bytes(out.read_bytes() + b"\0")
    with pytest.raises(DataError, match="not the model its manifest"):
        load_embedder(out)
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode: a path under a file instead
            target = out / "x.pt"
        else:
            target = locked / "x.pt"
        with pytest.raises(DataError):
            export_model(run, "torchscript", target, parity_samples=24, data_root=data_root)
    finally:
        locked.chmod(0o755)
    assert not [p for p in tmp_path.rglob(".*tmp*")]


@pytest.mark.parametrize("damage, words", [
    ({"format": None}, "format None"),
    ({"preprocessing": None}, "no 'preprocessing' object"),
    ({"preprocessing": {"transform": "grayscale", "image_size": 32}}, "in_channels None"),
    ({"preprocessing": {"transform": "grayscale", "image_size": "abc", "in_channels": 1}}, "image_size 'abc'"),
    ({"preprocessing": {"transform": "sepia", "image_size": 32, "in_channels": 1}}, "transform 'sepia'"),
])
def test_a_damaged_manifest_is_one_clear_error(onnx_export, tmp_path, damage, words):
    """A hand-edited or damaged manifest gave KeyError / TypeError tracebacks at load."""
    import shutil

    model = tmp_path / "m.onnx"
    shutil.copy(onnx_export["output"], model)
    manifest = json.loads(Path(str(onnx_export["output"]) + ".json").read_text())
    manifest.update(damage)
    (tmp_path / "m.onnx.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"is damaged \\([^)]*{re.escape(words)}"):
        load_embedder(model)
