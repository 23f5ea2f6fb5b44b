"""Serving what an export takes, the service's default k, held-out recall, loaded indexes' metric,
and export options that do not apply: each once answered wrongly without an error."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from dmlkit.apps import EmbeddingIndex
from dmlkit.cli import app as cli
from dmlkit.exceptions import ConfigError, DataError

pytest.importorskip("fastapi")
pytest.importorskip("faiss")
from fastapi.testclient import TestClient

from dmlkit.apps.export import ImageEmbedder, export_model, load_embedder
from dmlkit.apps.service import ServiceConfig, create_app, start_background_server

# a one-epoch run need not beat its untrained model: these tests are about serving it
pytestmark = pytest.mark.filterwarnings("ignore:training did not beat the untrained model")

#: A run without ``data.image_size`` (and no transform): the model sees binary_alphadigits'
#: own 20x16 images, and its ONNX export takes 1x20x16 only.
SIZELESS_RUN = {
    "name": "sizeless", "seed": 0,
    "data": {"dataset": "binary_alphadigits", "split": {"kind": "default", "val_fraction": 0.2},
             "transform": None, "image_size": None},
    "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 16, "in_channels": 1},
    "loss": {"name": "contrastive", "params": {}}, "miner": None,
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 3},
    "optimizer": {"name": "adam", "trunk_lr": 1e-3, "embedder_lr": 1e-3},
    "training": {"epochs": 1, "eval_every_epochs": 1, "log_every": 1},
}


@pytest.fixture(scope="module")
def sizeless_run(tmp_path_factory, data_root) -> Path:
    run = tmp_path_factory.mktemp("sizeless") / "run"
    config = run.parent / "sizeless.yaml"
    config.write_text(yaml.safe_dump(SIZELESS_RUN))
    res = CliRunner().invoke(cli, ["train", str(config), "--run-dir", str(run), "--data-root", str(data_root), "--quiet"])
    assert res.exit_code == 0, res.output
    return run


@pytest.fixture(scope="module")
def sizeless_export(sizeless_run, data_root) -> Path:
    pytest.importorskip("onnxruntime")
    out = sizeless_run.parent / "export" / "model.onnx"
    report = export_model(sizeless_run, "onnx", out, parity_samples=24, data_root=data_root)
    assert report["parity"]["passed"] and report["preprocessing"]["input_shape"] == [1, 20, 16]
    return out


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


class _FixedForward:
    """A model that takes 1x20x16 only, as onnxruntime runs a fixed-size export: any other size
    is a RuntimeError (which :class:`ImageEmbedder` reports as the model's failure)."""

    def __init__(self, dim: int = 8) -> None:
        self.w = np.random.default_rng(0).normal(size=(20 * 16, dim)).astype(np.float32)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if tuple(x.shape[1:]) != (1, 20, 16):
            raise RuntimeError(f"Got invalid dimensions for input: images, got {x.shape}, expected 1x20x16")
        return x.reshape(len(x), -1) @ self.w


def _fixed_embedder() -> ImageEmbedder:
    return ImageEmbedder(_FixedForward(), None, None, 1, "onnxruntime", input_shape=(1, 20, 16))


def _any_size_embedder() -> ImageEmbedder:
    """A model that embeds images of any size (8-d: the mean intensity, shifted per entry)."""
    def forward(x: np.ndarray) -> np.ndarray:
        return x.mean(axis=(1, 2, 3))[:, None] + np.arange(8, dtype=np.float32)

    return ImageEmbedder(forward, None, None, 1, "torch")


# 1. a fixed-size export of a run without data.image_size is served


def test_a_fixed_size_export_without_image_size_embeds_its_size_and_refuses_others():
    from PIL import Image

    embedder = _fixed_embedder()
    assert embedder.reference_size == (20, 16)
    assert embedder([Image.new("L", (16, 20), color=200)]).shape == (1, 8)  # was EmbedderFailure (a 500)
    with pytest.raises(DataError, match=r"preprocessed to 1x64x64 .*it takes 1x20x16"):
        embedder([Image.new("L", (64, 64))])
    idx = EmbeddingIndex(np.random.default_rng(1).normal(size=(6, 8)).astype(np.float32))
    client = TestClient(create_app(ServiceConfig(index="unused"), index=idx, embedder=embedder))  # was refused
    r = client.post("/api/query/image", files={"file": ("q.png", _png(Image.new("L", (16, 20), color=90)))})
    assert r.status_code == 200 and len(r.json()["results"]) == 6, r.text


def test_an_onnx_export_of_a_run_without_image_size_is_served(sizeless_run, sizeless_export, data_root, tmp_path):
    from PIL import Image

    from dmlkit.data import load_dataset

    res = CliRunner().invoke(cli, ["index", str(sizeless_run / "embeddings" / "test.npz"), "-o", str(tmp_path / "idx")])
    assert res.exit_code == 0, res.output
    embedder = load_embedder(sizeless_export)
    assert embedder.input_shape == (1, 20, 16) and embedder.image_size is None
    client = TestClient(create_app(ServiceConfig(index=tmp_path / "idx", model=sizeless_export)),
                        raise_server_exceptions=False)
    item = str(client.app.state.index.ids[5])  # dataset row numbers: binary_alphadigits has no files
    x = load_dataset("binary_alphadigits", root=data_root)[int(item)][0]
    image = Image.fromarray((np.asarray(x).squeeze(0) * 255).round().astype(np.uint8), mode="L")
    assert image.size == (16, 20)
    np.testing.assert_allclose(embedder([image]), client.app.state.index.get([item]), atol=1e-4)
    r = client.post("/api/query/image", files={"file": ("q.png", _png(image))}, data={"k": "3"})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["id"] == item
    wrong = client.post("/api/query/image", files={"file": ("q.png", _png(Image.new("L", (32, 32))))})
    assert wrong.status_code == 422 and "it takes 1x20x16" in wrong.json()["detail"], wrong.text


# 2. a max_k below 10: requests without k take the service's limit


def test_requests_without_k_get_at_most_max_k():
    from PIL import Image

    rng = np.random.default_rng(2)
    idx = EmbeddingIndex(rng.normal(size=(12, 8)).astype(np.float32), ids=[f"i{n}" for n in range(12)])
    client = TestClient(create_app(ServiceConfig(index="unused", max_k=5), index=idx, embedder=_any_size_embedder()))
    for r in (client.post("/api/query/id", json={"id": "i0"}),
              client.post("/api/query/embedding", json={"embedding": rng.normal(size=8).tolist()}),
              client.post("/api/query/image", files={"file": ("q.png", _png(Image.new("L", (16, 20), 40)))})):
        assert r.status_code == 200, r.text  # was 422: "k=10 is larger than this service's limit of 5"
        assert r.json()["k"] == 5 and len(r.json()["results"]) == 5
    assert client.post("/api/query/id", json={"id": "i0", "k": 6}).status_code == 422  # the limit still holds
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert schema["IdQuery"]["properties"]["k"]["default"] == 5
    assert schema["EmbeddingQuery"]["properties"]["k"]["default"] == 5
    roomy = TestClient(create_app(ServiceConfig(index="unused", max_k=50), index=idx))
    assert roomy.post("/api/query/id", json={"id": "i0"}).json()["k"] == 10  # 10 where the limit allows


@pytest.mark.browser
@pytest.mark.skipif(shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
                    reason="headless Chromium is not installed (apt-get install chromium)")
def test_the_page_takes_its_k_limit_from_the_service(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    from PIL import Image

    idx = EmbeddingIndex(np.random.default_rng(3).normal(size=(12, 8)).astype(np.float32))
    app = create_app(ServiceConfig(index="unused", max_k=5), index=idx, embedder=_any_size_embedder())
    query = tmp_path / "query.png"
    Image.new("L", (16, 20), color=70).save(query)
    srv, thread, url = start_background_server(app)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or shutil.which("chromium-browser"),
                                         args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
            try:
                page = browser.new_page()
                page.goto(url + "/")
                # predicates as functions: Playwright evals a polled string in the page, which the
                # service's Content-Security-Policy (no 'unsafe-eval') refuses
                page.wait_for_function("() => document.getElementById('k').max === '5'", timeout=20000)
                assert page.get_attribute("#k", "max") == "5" and page.input_value("#k") == "5"  # was max 100, value 8
                page.set_input_files("#query-file", str(query))
                page.wait_for_function("() => document.getElementById('query-message').textContent.includes('nearest')"
                                       " || document.getElementById('query-message').className === 'error'",
                                       timeout=30000)
                assert page.inner_text("#query-message").startswith("5 nearest items"), page.inner_text("#query-message")
                assert page.eval_on_selector_all("#results .card", "els => els.length") == 5
            finally:
                browser.close()
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# 3. recall on the caller's queries: indexed rows are not held out


def test_recall_on_queries_that_are_indexed_rows_is_not_held_out():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, 16)).astype(np.float32)
    fresh = rng.normal(size=(40, 16)).astype(np.float32)
    for kind, settings in (("hnsw", {"hnsw_m": 4, "ef_construction": 8, "ef_search": 16}), ("ivf_flat", {})):
        idx = EmbeddingIndex(x, kind=kind, recall_queries=40, **settings)
        assert idx.measure_recall(queries=fresh)["held_out"] is True
        assert idx.measure_recall(queries=x[:40])["held_out"] is False  # was True: self matches counted
        one = fresh.copy()
        one[7] = x[123]  # a single indexed row among new queries
        assert idx.measure_recall(queries=one)["held_out"] is False
        assert idx.tune(0.9, queries=x[100:140])["held_out"] is False
        near = x[:40].copy()
        near[:, 0] = np.nextafter(near[:, 0], np.float32(np.inf))  # not bit-identical: new queries
        assert idx.measure_recall(queries=near)["held_out"] is True


# 4. a loaded index's faiss structure must be built for the distance index.json names


@pytest.mark.parametrize("kind", ["hnsw", "ivf_flat"])
def test_a_hand_edited_distance_is_a_damaged_index(kind, tmp_path):
    x = np.random.default_rng(4).normal(size=(400, 8)).astype(np.float32)
    EmbeddingIndex(x, kind=kind, distance="cosine").save(tmp_path / "idx")
    assert EmbeddingIndex.load(tmp_path / "idx").distance == "cosine"
    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    meta["distance"] = "euclidean"
    (tmp_path / "idx" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"is a damaged index .*euclidean.*rebuild it"):
        EmbeddingIndex.load(tmp_path / "idx")  # loaded, and searched the inner product's neighbours
    # the other way round: an L2 structure named cosine
    EmbeddingIndex(x, kind=kind, distance="euclidean").save(tmp_path / "l2")
    meta = json.loads((tmp_path / "l2" / "index.json").read_text())
    meta["distance"] = "dot"
    (tmp_path / "l2" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="damaged index"):
        EmbeddingIndex.load(tmp_path / "l2")


# 5. --opset applies to ONNX exports only


def test_opset_with_a_torchscript_export_is_refused(sizeless_run, tmp_path, capsys):
    from dmlkit.cli import main

    with pytest.raises(ConfigError, match="--opset applies to ONNX exports only"):
        export_model(sizeless_run, "torchscript", tmp_path / "m.pt", opset=9)
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(sizeless_run), "--format", "torchscript", "--opset", "9", "-o", str(tmp_path / "cli.pt")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--opset applies to ONNX exports only" in err, err
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "cli.pt").exists()  # was exported, opset ignored
