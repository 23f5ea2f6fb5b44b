"""The visual search service: API against a real trained run, bad input, fuzzing, loopback load."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from dmlkit.cli import app as cli

pytest.importorskip("fastapi")
pytest.importorskip("faiss")
from fastapi.testclient import TestClient

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps.service import ServiceConfig, create_app, start_background_server

TINY_RUN = {
    "name": "search-test", "seed": 0,
    "data": {"dataset": "att_faces", "split": {"kind": "default", "val_fraction": 0.2},
             "transform": "grayscale", "image_size": 32},
    "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 16, "in_channels": 1},
    "loss": {"name": "contrastive", "params": {}}, "miner": None,
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 3},
    "optimizer": {"name": "adam", "trunk_lr": 1e-3, "embedder_lr": 1e-3},
    "training": {"epochs": 1, "eval_every_epochs": 1, "log_every": 1},
}


def trained_run(tmp_path_factory, data_root) -> Path:
    """One tiny real run per test session (shared by the search, export and service tests)."""
    run = tmp_path_factory.getbasetemp() / "dmlkit-search-run"
    if (run / "embeddings" / "test.npz").exists():
        return run
    config = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_RUN))
    res = CliRunner().invoke(cli, ["train", str(config), "--run-dir", str(run), "--data-root", str(data_root), "--quiet"])
    assert res.exit_code == 0, res.output
    return run


@pytest.fixture(scope="module")
def served(tmp_path_factory, data_root):
    run = trained_run(tmp_path_factory, data_root)
    base = tmp_path_factory.mktemp("serve")
    runner = CliRunner()
    res = runner.invoke(cli, ["index", str(run / "embeddings" / "test.npz"), "-o", str(base / "index"), "--kind", "hnsw",
                              "--target-recall", "0.95", "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["verify", str(run / "embeddings" / "test.npz"), "--pairs", "400", "--json"])
    assert res.exit_code == 0, res.output
    (base / "verify.json").write_text(res.stdout)  # not res.output: warnings go to stderr
    config = ServiceConfig(index=base / "index", model=run, verification=base / "verify.json", data_root=data_root,
                           max_upload_bytes=2**20, max_k=50)
    return {"app": create_app(config), "run": run, "base": base, "data_root": Path(data_root),
            "threshold": json.loads(res.stdout)["threshold"]}


@pytest.fixture(scope="module")
def client(served):
    return TestClient(served["app"])


def _image(served, item_id: str) -> bytes:
    return (served["data_root"] / item_id).read_bytes()


def test_health_info_and_openapi(client, served):
    h = client.get("/api/health").json()
    idx = served["app"].state.index
    assert h == {"status": "ok", "items": len(idx), "dim": 16, "kind": "hnsw", "distance": "cosine",
                 "model": "torch", "verification": True}
    info = client.get("/api/info").json()
    assert info["index"]["recall"]["recall"] >= 0.95 and info["threshold"] == pytest.approx(served["threshold"])
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/api/health", "/api/info", "/api/metrics", "/api/query/embedding", "/api/query/id",
              "/api/query/image", "/api/verify", "/api/items/{item_id}", "/api/items/{item_id}/thumbnail"):
        assert p in paths, p
    page = client.get("/")
    assert page.status_code == 200 and 'id="query-file"' in page.text
    assert client.get("/static/app.js").status_code == 200


def test_query_by_image_finds_the_indexed_file_itself(client, served):
    idx = served["app"].state.index
    for item_id in idx.ids[[0, 57, 123]]:
        r = client.post("/api/query/image", files={"file": ("q.pgm", _image(served, item_id))}, data={"k": "5"})
        assert r.status_code == 200, r.text
        top = r.json()["results"]
        assert len(top) == 5 and top[0]["id"] == item_id and top[0]["score"] == pytest.approx(1.0, abs=1e-4)
        assert top[0]["label"] == int(idx.labels[idx.positions([item_id])[0]])
        thumb = client.get(top[1]["thumbnail"])
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/png"
        assert thumb.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_query_by_embedding_and_by_id_match_the_index(client, served):
    idx: EmbeddingIndex = served["app"].state.index
    vec = idx.embeddings[10]
    r = client.post("/api/query/embedding", json={"embedding": vec.tolist(), "k": 6}).json()
    expect = idx.search(vec, 6)
    assert [x["id"] for x in r["results"]] == expect.ids[0].tolist()
    np.testing.assert_allclose([x["score"] for x in r["results"]], expect.scores[0], rtol=1e-5)
    r = client.post("/api/query/id", json={"id": idx.ids[10], "k": 5}).json()
    assert [x["id"] for x in r["results"]] == expect.ids[0, 1:].tolist()  # itself excluded
    r = client.post("/api/query/id", json={"id": idx.ids[10], "k": 5, "exclude_self": False}).json()
    assert r["results"][0]["id"] == idx.ids[10]
    item = client.get(f"/api/items/{idx.ids[10]}").json()
    assert item["label"] == int(idx.labels[10])


def test_verify_uses_the_calibrated_threshold(client, served):
    idx = served["app"].state.index
    same_img = _image(served, idx.ids[0])
    r = client.post("/api/verify", files={"image1": ("a.pgm", same_img), "image2": ("b.pgm", same_img)}).json()
    assert r["same"] is True and r["score"] == pytest.approx(1.0, abs=1e-4)
    assert r["threshold"] == pytest.approx(served["threshold"])
    far = idx.search(idx.embeddings[0], len(idx), exact=True).ids[0, -1]  # the least similar item
    r = client.post("/api/verify", files={"image1": ("a.pgm", same_img), "image2": ("b.pgm", _image(served, far))}).json()
    assert r["score"] < served["threshold"] and r["same"] is False


def test_bad_input_gets_a_clear_4xx_and_the_service_keeps_serving(client, served):
    cases = [
        (client.post("/api/query/image", files={"file": ("x.jpg", b"not an image")}), 400, "not an image"),
        (client.post("/api/query/image", files={"file": ("x.jpg", b"")}), 400, "empty"),
        (client.post("/api/query/embedding", json={"embedding": [0.1] * 3}), 422, "16-d"),
        (client.post("/api/query/embedding", content=b'{"embedding": [NaN, 1.0]}',
                     headers={"content-type": "application/json"}), 422, "finite"),
        (client.post("/api/query/embedding", json={"embedding": [0.1] * 16, "k": 51}), 422, "limit of 50"),
        (client.post("/api/query/embedding", json={"embedding": [0.1] * 16, "k": 0}), 422, "k"),
        (client.post("/api/query/id", json={"id": "no/such/file.pgm"}), 404, "not in the index"),
        (client.get("/api/items/no/such/file.pgm/thumbnail"), 404, "not in the index"),
        (client.post("/api/query/image", files={"file": ("big.png", b"\0" * (2**20 + 10))}), 413, "exceeds the limit"),
        (client.post("/api/query/image", data={"k": "3"}), 422, "file"),
        (client.post("/api/query/embedding", content=b"{not json", headers={"content-type": "application/json"}), 422, ""),
    ]
    for response, status, words in cases:
        assert response.status_code == status, (status, response.text)
        assert words in response.json()["detail"], response.json()
    assert client.get("/api/health").status_code == 200
    metrics = client.get("/api/metrics").json()
    assert metrics["status"]["4xx"] >= 8 and "5xx" not in metrics["status"]


def test_a_service_without_model_or_threshold_says_what_to_do(served):
    bare = TestClient(create_app(ServiceConfig(index=served["base"] / "index")))
    img = _image(served, served["app"].state.index.ids[0])
    r = bare.post("/api/query/image", files={"file": ("a.pgm", img)})
    assert r.status_code == 409 and "--model" in r.json()["detail"]
    r = bare.get(f"/api/items/{served['app'].state.index.ids[0]}/thumbnail")
    assert r.status_code == 200  # the index recorded its data root
    no_threshold = TestClient(create_app(ServiceConfig(index=served["base"] / "index", model=served["run"])))
    r = no_threshold.post("/api/verify", files={"image1": ("a.pgm", img), "image2": ("b.pgm", img)})
    assert r.status_code == 409 and "--threshold" in r.json()["detail"]


def test_fuzz_the_openapi_endpoints(client):
    """Property-based: arbitrary JSON and bytes never produce a 5xx or a non-JSON error (bounded)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=30)
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=20) | st.dictionaries(st.text(max_size=10), c, max_size=5),
                          max_leaves=40)
    bodies = st.fixed_dictionaries({}, optional={"embedding": values | st.lists(st.floats(), min_size=16, max_size=16),
                                                 "k": values, "id": values, "exclude_self": values}) | values
    ok = {200, 400, 404, 409, 413, 422}

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/api/query/embedding", "/api/query/id"]), body=bodies)
    def json_endpoints(path, body):
        r = client.post(path, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
        assert r.status_code in ok, (path, body, r.status_code, r.text)
        assert r.status_code == 200 or isinstance(r.json()["detail"], str)

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.binary(max_size=2048), k=st.text(max_size=6), item=st.text(min_size=1, max_size=40))
    def upload_and_item_endpoints(data, k, item):
        r = client.post("/api/query/image", files={"file": ("f", data)}, data={"k": k})
        assert r.status_code in ok and r.status_code != 200, (r.status_code, r.text)
        r = client.get(f"/api/items/{quote(item, safe='')}/thumbnail")
        assert r.status_code in ok | {405}, (item, r.status_code, r.text)

    t0 = time.perf_counter()
    json_endpoints()
    upload_and_item_endpoints()
    assert time.perf_counter() - t0 < 120


def test_running_server_on_loopback_under_a_bounded_load(served, tmp_path):
    """A real uvicorn server on 127.0.0.1: p50/p99 latency and throughput of 200 queries."""
    import httpx

    server, thread, url = start_background_server(served["app"])
    try:
        assert url.startswith("http://127.0.0.1:")
        idx = served["app"].state.index
        img = _image(served, idx.ids[3])
        bodies = [idx.embeddings[i % len(idx)].tolist() for i in range(200)]

        def one(i: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            if i % 10 == 0:
                r = http.post(f"{url}/api/query/image", files={"file": ("q.pgm", img)}, data={"k": "8"})
            else:
                r = http.post(f"{url}/api/query/embedding", json={"embedding": bodies[i], "k": 8})
            return time.perf_counter() - t0, r.status_code

        with httpx.Client(timeout=30) as http:  # keep-alive connections, as a real client would
            assert http.get(f"{url}/api/health").status_code == 200
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=4) as pool:
                out = list(pool.map(one, range(200)))
        wall = time.perf_counter() - t0
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    latencies = np.array([t for t, _ in out]) * 1000
    statuses = {s for _, s in out}
    report = {"requests": len(out), "concurrency": 4, "p50_ms": float(np.percentile(latencies, 50)),
              "p99_ms": float(np.percentile(latencies, 99)), "throughput_rps": len(out) / wall}
    (tmp_path / "load.json").write_text(json.dumps(report))
    print(f"\nloopback load test: {report}")
    assert statuses == {200}
    assert report["p99_ms"] < 10_000 and report["throughput_rps"] > 1
    assert not thread.is_alive()


def test_cli_serve_refuses_a_missing_index(tmp_path):
    res = CliRunner().invoke(cli, ["serve", "--index", str(tmp_path / "nope")])
    from dmlkit.exceptions import DataNotFoundError

    assert isinstance(res.exception, DataNotFoundError)


def test_thumbnails_stay_inside_the_data_root(served, tmp_path):
    secret = tmp_path / "secret.png"
    shutil.copy(served["data_root"] / served["app"].state.index.ids[0], secret)
    x = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    idx = EmbeddingIndex(x, ids=["../../../../../../" + str(secret).lstrip("/"), "ok.png"], info={"data_root": str(tmp_path / "root")})
    (tmp_path / "root").mkdir()
    c = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    r = c.get(f"/api/items/{quote(idx.ids[0], safe='')}/thumbnail")
    assert r.status_code == 404 and "outside the data root" in r.json()["detail"]


def test_a_model_that_does_not_fit_the_index_is_refused(served, tmp_path):
    from dmlkit.exceptions import ConfigError

    x = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    EmbeddingIndex(x).save(tmp_path / "idx8")
    with pytest.raises(ConfigError, match="16-d embeddings but the index holds 8-d"):
        create_app(ServiceConfig(index=tmp_path / "idx8", model=served["run"]))
    with pytest.raises(ConfigError, match="not both"):
        create_app(ServiceConfig(index=tmp_path / "idx8", threshold=0.5, verification=tmp_path / "v.json"))


def test_the_verification_threshold_is_used_on_its_own_distance(served, tmp_path):
    """`dmlkit verify --json` records its distance; a file without one is refused (its threshold
    is a score on some distance: judged on the index's cosine, a negated Euclidean threshold of
    -0.25 called every pair "same")."""
    from dmlkit.exceptions import DataError

    res = CliRunner().invoke(cli, ["verify", str(served["run"] / "embeddings" / "test.npz"), "--pairs", "400",
                                   "--distance", "euclidean", "--json"])
    assert res.exit_code == 0, res.output
    calibrated = json.loads(res.stdout)
    assert calibrated["distance"] == "euclidean" and calibrated["threshold"] < 0
    (tmp_path / "euclidean.json").write_text(res.stdout)
    c = TestClient(create_app(ServiceConfig(index=served["base"] / "index", model=served["run"],
                                            verification=tmp_path / "euclidean.json")))
    idx = served["app"].state.index
    img = _image(served, idx.ids[0])
    far = idx.search(idx.embeddings[0], len(idx), exact=True).ids[0, -1]
    r = c.post("/api/verify", files={"image1": ("a.pgm", img), "image2": ("b.pgm", _image(served, far))}).json()
    assert r["distance"] == "euclidean" and r["score"] < 0 and r["same"] is False
    r = c.post("/api/verify", files={"image1": ("a.pgm", img), "image2": ("b.pgm", img)}).json()
    assert r["same"] is True and r["score"] == pytest.approx(0.0, abs=1e-3)
    del calibrated["distance"]
    (tmp_path / "old.json").write_text(json.dumps(calibrated))
    with pytest.raises(DataError, match="does not say which distance"):
        create_app(ServiceConfig(index=served["base"] / "index", verification=tmp_path / "old.json"))


def test_a_16_bit_upload_is_scaled_not_clipped_to_white(client, served):
    """PIL's conversion clips a 16-bit image to solid white: the query answered with a stranger."""
    import io

    from PIL import Image

    idx = served["app"].state.index
    item_id = idx.ids[57]
    with Image.open(served["data_root"] / item_id) as img:
        deep = Image.fromarray(np.asarray(img.convert("L"), dtype=np.uint16) * 257)  # mode I;16
    buf = io.BytesIO()
    deep.save(buf, format="PNG")
    r = client.post("/api/query/image", files={"file": ("q16.png", buf.getvalue())}, data={"k": "3"})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["id"] == item_id and r.json()["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)


def test_limits_no_request_could_meet_are_refused_and_413s_are_counted(served):
    from dmlkit.exceptions import ConfigError

    for field in ("max_k", "max_upload_bytes", "max_image_pixels"):
        for value in (0, -5):
            with pytest.raises(ConfigError, match=f"{field} must be a positive integer"):
                create_app(ServiceConfig(index=served["base"] / "index", **{field: value}))
    c = TestClient(create_app(ServiceConfig(index=served["base"] / "index", max_upload_bytes=100)))
    for _ in range(3):
        assert c.post("/api/query/embedding", json={"embedding": [0.1] * 64}).status_code == 413
    assert c.post("/api/query/embedding", json={"embedding": [0.1] * 16}).status_code == 200
    assert c.get("/api/metrics").json()["status"] == {"4xx": 3, "2xx": 1}


def test_an_id_ending_in_thumbnail_is_still_an_item(tmp_path):
    x = np.random.default_rng(0).normal(size=(2, 16)).astype(np.float32)
    idx = EmbeddingIndex(x, labels=np.array([4, 7]), ids=["a", "a/thumbnail"])
    c = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    r = c.get(f"/api/items/{quote('a/thumbnail', safe='')}")
    assert r.status_code == 200 and r.json()["id"] == "a/thumbnail" and r.json()["label"] == 7
    assert c.get("/api/items/a").json()["label"] == 4
    r = c.get(f"/api/items/{quote('a/thumbnail', safe='')}/thumbnail")  # its own thumbnail route
    assert r.status_code == 404 and "no image for 'a/thumbnail'" in r.json()["detail"]


def test_cli_serve_ctrl_c_is_130_and_a_busy_port_is_one_line(served, tmp_path):
    """Ctrl-C stopped the server with exit 0 (uvicorn.run swallows it) and a port in use printed
    uvicorn's log lines with exit 3."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dmlkit", "serve", "--index", str(served["base"] / "index")]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = subprocess.run([*cmd, "--port", str(busy.getsockname()[1])], capture_output=True, text=True,
                             timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().startswith("error: cannot listen on 127.0.0.1:") and len(out.stderr.splitlines()) == 1
    # ``with``: its pipes are closed at the end (they were left open: a ResourceWarning)
    with subprocess.Popen([*cmd, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as proc:
        try:
            line = proc.stdout.readline()  # printed once the socket listens
            assert line.startswith("dmlkit serve: ") and "http://127.0.0.1:" in line, line + proc.stderr.read()
            url = line.split()[-4].rstrip("/")
            import httpx

            deadline = time.time() + 60
            while time.time() < deadline:  # serving, so the signal reaches uvicorn's handler
                try:
                    if httpx.get(f"{url}/api/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        err = proc.stderr.read()
    assert code == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "interrupted: stopped by Ctrl-C (the server is shut down)"]  # no --resume: serve has none
