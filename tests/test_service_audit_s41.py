"""Audit s41 of ``dmlkit serve`` under bad and concurrent requests: each test pins one fix.

Loopback only; every wait is bounded by a deadline and none depends on the machine's speed
(the concurrent tests hold the model inside its forward with an :class:`threading.Event`).
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("faiss")
import httpx
from fastapi.testclient import TestClient

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps.export import ImageEmbedder
from dmlkit.apps.service import ServiceConfig, create_app, start_background_server
from dmlkit.exceptions import ConfigError

DIM = 4
WAIT = 30.0  # the longest any step may take (a bound, never a figure to meet)


def _png(size: int = 8, value: int = 100) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (size, size), color=value).save(buf, format="PNG")
    return buf.getvalue()


class HeldModel:
    """A forward that, once ``armed``, waits inside for ``release`` (so a request can be held
    in the model for as long as a test needs); counts how many run at once."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if self.armed:
                self.entered.release()
                assert self.release.wait(WAIT), "the test never released the model"
            return np.tile(np.arange(1, DIM + 1, dtype=np.float32), (len(x), 1))
        finally:
            with self.lock:
                self.running -= 1


def _index(n: int = 20, **kw) -> EmbeddingIndex:
    x = np.random.default_rng(0).normal(size=(n, DIM)).astype(np.float32)
    return EmbeddingIndex(x, ids=kw.pop("ids", [f"i{j}" for j in range(n)]), **kw)


def _app(model: HeldModel | None = None, **config):
    embedder = None if model is None else ImageEmbedder(model, None, 8, 1, "torch")
    return create_app(ServiceConfig(index="unused", threshold=0.5, **config), index=_index(), embedder=embedder)


class _Served:
    """A real uvicorn server on 127.0.0.1 in a thread; stops it (and frees the model) on exit."""

    def __init__(self, app, model: HeldModel | None = None) -> None:
        self.app, self.model = app, model

    def __enter__(self):
        self.server, self.thread, self.url = start_background_server(self.app)
        return self

    def __exit__(self, *exc):
        if self.model is not None:
            self.model.release.set()
        self.server.should_exit = True
        self.thread.join(timeout=WAIT)
        return False


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _post_image(url: str, path: str = "/api/query/image", **files) -> httpx.Response:
    files = files or {"file": ("q.png", _png())}
    return httpx.post(url + path, files=files, timeout=WAIT)


# -- F1: image work off the event loop, bounded ---------------------------------------------------

def test_health_and_json_queries_answer_while_an_image_is_being_embedded():
    """The image endpoints decoded and embedded inside ``async def`` (on the event loop): while
    one ran every other request waited (six 40 Mpx uploads: /api/health 78 ms -> 11.9 s)."""
    model = HeldModel()
    app = _app(model, image_workers=2)  # both held in the model at once, whatever the CPU count
    model.armed = True
    with _Served(app, model) as s, ThreadPoolExecutor(2) as pool:
        image = pool.submit(_post_image, s.url)
        verify = pool.submit(_post_image, s.url, "/api/verify",
                             image1=("a.png", _png()), image2=("b.png", _png()))
        for _ in range(2):  # both requests are inside the model now
            assert model.entered.acquire(timeout=WAIT)
        try:  # a blocked event loop answers nothing until the model is released: a timeout here
            assert httpx.get(s.url + "/api/health", timeout=10).status_code == 200
            r = httpx.post(s.url + "/api/query/embedding", json={"embedding": [1, 0, 0, 0], "k": 3}, timeout=10)
            assert r.status_code == 200 and len(r.json()["results"]) == 3
        finally:
            model.release.set()
        assert image.result().status_code == 200 and verify.result().status_code == 200
        assert verify.result().json()["same"] is True


def test_image_work_runs_a_bounded_number_at_once_and_503s_beyond_the_queue():
    """``image_workers`` run at once and ``image_queue`` wait; one more gets 503 with
    Retry-After at once (nothing bounded the image work: each 40 Mpx decode is ~120 MB)."""
    model = HeldModel()
    app = _app(model, image_workers=1, image_queue=1)
    work = app.state.image_work
    model.armed = True
    with _Served(app, model) as s, ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post_image, s.url)
        assert model.entered.acquire(timeout=WAIT)
        second = pool.submit(_post_image, s.url)
        _wait_until(lambda: work.pending == 2, "the second image request to queue")
        busy = _post_image(s.url)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["detail"]
        model.release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
    assert model.most == 1 and work.pending == 0


@pytest.mark.parametrize(("field", "value"), [("image_workers", 0), ("image_queue", -1), ("image_workers", 1.5)])
def test_image_limits_are_checked_at_start(field, value):
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match=field):
        ServiceConfig(index="unused", **{field: value})


# -- F2: the JSON queries' own body limit -----------------------------------------------------------

def test_json_queries_have_a_body_limit_of_their_own_derived_from_the_index():
    """They shared --max-upload-mb (8 MiB), parsed whole on the event loop before the 65,536
    values check: 8 concurrent bad bodies delayed a good query 8.6 s and took ~650 MiB."""
    from dmlkit.apps.service.middleware import json_body_limit

    c = TestClient(_app(HeldModel()))
    limit = json_body_limit(DIM, 8 * 2**20)
    assert limit == 64 * 2**10 + 64 * DIM
    padded = json.dumps({"embedding": [1.0, 0.0, 0.0, 0.0], "k": 3, "pad": "x" * limit}).encode()
    for path in ("/api/query/embedding", "/api/query/id"):
        r = c.post(path, content=padded, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert f"limit of {limit} bytes" in r.json()["detail"] and "JSON query" in r.json()["detail"]
        chunked = c.post(path, content=iter([padded[:40_000], padded[40_000:]]),  # no Content-Length
                         headers={"content-type": "application/json"})
        assert chunked.status_code == 413, chunked.text
    # a body at full float64 precision, pretty-printed, fits; an upload may still be larger
    vec = np.random.default_rng(1).normal(size=DIM) * 1e-5
    body = json.dumps({"embedding": vec.tolist(), "k": 3}, indent=8).encode()
    assert c.post("/api/query/embedding", content=body, headers={"content-type": "application/json"}).status_code == 200
    r = c.post("/api/query/image", files={"file": ("big.bin", b"\0" * (2 * limit))})
    assert r.status_code == 400 and "not an image" in r.json()["detail"]


def test_the_json_limit_grows_with_the_dimension_and_never_passes_the_upload_limit():
    from dmlkit.apps.service.middleware import json_body_limit

    dim = 4096
    idx = EmbeddingIndex(np.random.default_rng(0).normal(size=(8, dim)).astype(np.float32))
    c = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    vec = -np.abs(np.random.default_rng(2).normal(size=dim)) * 1.2345678901234567e-5
    body = json.dumps({"embedding": vec.tolist(), "k": 2}, indent=4).encode()
    assert len(body) > 64 * 2**10  # more than the slack alone: the per-value allowance lets it in
    r = c.post("/api/query/embedding", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert json_body_limit(dim, 1000) == 1000


# -- F3: a client that hangs up mid-body ------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback():
    """``BaseHTTPMiddleware`` raised ``RuntimeError: No response returned`` when the body limit
    answered nothing to a client that had left: uvicorn logged "Exception in ASGI application"."""
    app = create_app(ServiceConfig(index="unused"), index=_index())
    logs = _Records()
    with _Served(app) as s:
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addHandler(logs)
        try:
            port = int(s.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
                sock.sendall(b"POST /api/query/embedding HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            metrics = app.state.metrics
            _wait_until(lambda: logs.records or getattr(metrics, "disconnected", 0), "the server to see the hang-up")
            assert httpx.get(s.url + "/api/health", timeout=WAIT).status_code == 200
        finally:
            uvicorn_log.removeHandler(logs)
    assert [r.getMessage() for r in logs.records] == []
    snapshot = app.state.metrics.snapshot()
    assert snapshot["disconnected"] == 1 and snapshot["status"] == {"2xx": 1}


def test_an_unhandled_error_is_still_counted_as_a_500():
    app = create_app(ServiceConfig(index="unused"), index=_index())

    @app.get("/api/boom")
    def boom() -> None:
        raise ZeroDivisionError("boom")

    c = TestClient(app, raise_server_exceptions=False)
    assert c.get("/api/boom").status_code == 500
    assert c.get("/api/metrics").json()["status"] == {"5xx": 1}


# -- F5 and F6: thumbnails and /api/info name no server path ----------------------------------------

@pytest.fixture
def files(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.png").write_bytes(_png(12))
    (root / "text.png").write_text("not an image")
    outside = tmp_path / "outside.png"
    outside.write_bytes(_png(12))
    return root, outside


def test_thumbnail_errors_name_the_id_not_the_servers_files(files, caplog):
    """404s read ``the image of 'missing.png' is not at /tmp/.../missing.png`` and PIL's
    ``cannot identify image file '/tmp/...'``; the path now goes to the log only."""
    root, _ = files
    idx = _index(3, ids=["ok.png", "missing.png", "text.png"])
    c = TestClient(create_app(ServiceConfig(index="unused", data_root=root), index=idx))
    assert c.get("/api/items/ok.png/thumbnail").status_code == 200
    with caplog.at_level(logging.WARNING, logger="dmlkit.service"):
        for item in ("missing.png", "text.png", "missing.png"):
            r = c.get(f"/api/items/{item}/thumbnail")
            assert r.status_code == 404 and f"no image for {item!r}" in r.json()["detail"], r.text
            assert str(root) not in r.text and "/tmp" not in r.text
    logged = [r.getMessage() for r in caplog.records if r.name == "dmlkit.service"]
    assert len(logged) == 2 and all(str(root) in m for m in logged)  # once per item, with the path


def test_api_info_sends_no_server_folder(files):
    root, _ = files
    info = {"run_dir": str(root.parent / "run"), "run": "b8e382e74b3da30b", "data_root": str(root),
            "dataset": "att_faces", "source": str(root.parent / "run" / "embeddings" / "test.npz"),
            "source_sha256": "ab" * 32}
    c = TestClient(create_app(ServiceConfig(index="unused"), index=_index(info=info)))
    body = c.get("/api/info")
    assert body.status_code == 200 and str(root.parent) not in body.text
    got = body.json()
    assert got["index"]["info"] == {"run": "b8e382e74b3da30b", "dataset": "att_faces", "source": "test.npz",
                                    "source_sha256": "ab" * 32}
    assert got["max_k"] == 100  # what the web page reads (static/app.js)


def test_a_metadata_path_follows_the_rule_of_ids(files):
    """``item_file`` took an item's metadata ``path`` as it was: an absolute one outside the data
    root was served (``{"path": "/etc/shadow"}`` was opened), contrary to docs/search.md."""
    root, outside = files
    ids = ["a", "b", "c", "d"]
    meta = [{"path": str(outside)}, {"path": "ok.png"}, {"path": str(root / "ok.png")}, {"path": "../outside.png"}]
    idx = EmbeddingIndex(np.eye(4, DIM, dtype=np.float32) + 0.1, ids=ids, metadata=meta)
    c = TestClient(create_app(ServiceConfig(index="unused", data_root=root), index=idx))
    r = c.get("/api/items/a/thumbnail")
    assert r.status_code == 404 and "outside the data root" in r.json()["detail"] and str(outside) not in r.text
    assert c.get("/api/items/b/thumbnail").status_code == 200  # relative, under the root
    assert c.get("/api/items/c/thumbnail").status_code == 200  # absolute, under the root
    assert c.get("/api/items/d/thumbnail").status_code == 404  # a ``..`` part
    # an absolute path that is an indexed id is served, as the id itself or as another item's path
    idx2 = EmbeddingIndex(np.eye(2, DIM, dtype=np.float32) + 0.1, ids=["a", str(outside)],
                          metadata=[{"path": str(outside)}, None])
    c2 = TestClient(create_app(ServiceConfig(index="unused", data_root=root), index=idx2))
    assert c2.get(f"/api/items/{quote(str(outside), safe='')}/thumbnail").status_code == 200
    assert c2.get("/api/items/a/thumbnail").status_code == 200


# -- F7: one rule for k, one part per name ----------------------------------------------------------

def test_the_upload_forms_k_follows_the_json_rule():
    """The form's k took ``"2.0"`` and ``" 3"`` while JSON refused ``2.0`` and ``"3"``."""
    c = TestClient(_app(HeldModel(), max_k=50))
    png = _png()
    for k in ("2.0", " 3", "3 ", "+3", "03", "1e1", "three", "0", "-1", "51", "9" * 40):
        r = c.post("/api/query/image", files={"file": ("q.png", png)}, data={"k": k})
        assert r.status_code == 422, (k, r.text)
        assert isinstance(r.json()["detail"], str) and "k" in r.json()["detail"]
    for k, n in (("3", 3), ("50", 50), ("", 10)):
        r = c.post("/api/query/image", files={"file": ("q.png", png)}, data={"k": k})
        assert r.status_code == 200 and len(r.json()["results"]) == min(n, 20), (k, r.text)
    assert len(c.post("/api/query/image", files={"file": ("q.png", png)}).json()["results"]) == 10
    for k in (2.0, "3", True):
        assert c.post("/api/query/embedding", json={"embedding": [1, 0, 0, 0], "k": k}).status_code == 422


def test_two_parts_of_one_name_are_refused():
    """Two ``file`` parts: the last was used without a word."""
    c = TestClient(_app(HeldModel()))
    a, b = _png(8, 10), _png(8, 200)
    r = c.post("/api/query/image", files=[("file", ("a.png", a)), ("file", ("b.png", b))])
    assert r.status_code == 422 and "2 'file' parts" in r.json()["detail"]
    r = c.post("/api/query/image", files={"file": ("a.png", a)}, data={"k": ["3", "4"]})
    assert r.status_code == 422 and "'k'" in r.json()["detail"]
    r = c.post("/api/verify", files=[("image1", ("a.png", a)), ("image2", ("b.png", b)), ("image1", ("c.png", b))])
    assert r.status_code == 422 and "2 'image1' parts" in r.json()["detail"]
    assert c.post("/api/verify", files={"image1": ("a.png", a), "image2": ("b.png", b)}).status_code == 200


# -- F4: what the docs say of tied references --------------------------------------------------------

def test_raw_integer_ties_and_exact_duplicates_come_by_row_as_the_docs_say():
    """docs/search.md said ties of "integer or quantised embeddings" come by row on every flat
    index; on the normalised distances they come in the order of their float64 closeness
    (``index_exact.closeness64``, as ``dmlkit.metrics.knn``), ulps apart. What does hold: raw
    distances of integer rows, and exact duplicates on any distance."""
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, size=(120, 6)).astype(np.float32)
    x[np.all(x == 0, axis=1)] = 1
    q = rng.integers(-2, 3, size=(10, 6)).astype(np.float32)
    q[np.all(q == 0, axis=1)] = 1
    xi, qi = x.astype(np.int64), q.astype(np.int64)
    for distance in ("euclidean", "dot"):
        got = EmbeddingIndex(x, distance=distance, normalize=False).search(q, 40).indices
        for j in range(len(q)):  # integer arithmetic: the exact order, ties by row
            exact = ((xi - qi[j]) ** 2).sum(axis=1) if distance == "euclidean" else -(xi @ qi[j])
            assert got[j].tolist() == np.lexsort((np.arange(len(x)), exact))[:40].tolist(), (distance, j)
    dup = np.repeat(x[:5], 3, axis=0)  # rows 3i, 3i+1, 3i+2 equal
    for distance in ("cosine", "euclidean", "dot"):
        res = EmbeddingIndex(dup, distance=distance).search(dup[::3], 3).indices
        np.testing.assert_array_equal(res, np.arange(15).reshape(5, 3))
    text = (Path(__file__).resolve().parents[1] / "docs" / "search.md").read_text()
    flat = " ".join(text.split())
    assert "(duplicates, integer or quantised embeddings) come by row" not in flat
    assert re.search(r"raw-\*|normalize=False", flat) and "float64 value" in flat


# -- the Host header: no DNS rebinding of a loopback server -------------------------------------
def test_allowed_hosts_refuse_a_foreign_host_header():
    """A page of another site that re-points its name at 127.0.0.1 sends that name as Host; a
    loopback server answered it (the audit's F7 note). With ``allowed_hosts`` it gets 400."""
    from dmlkit.apps.service.config import LOOPBACK_HOSTS

    c = TestClient(_app(allowed_hosts=(*LOOPBACK_HOSTS, "Proxy.Example")), base_url="http://127.0.0.1:8000")
    assert c.get("/api/health").status_code == 200
    for host in ("localhost:8000", "[::1]:8000", "proxy.example", "127.0.0.1"):
        assert c.get("/api/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example:8000", "127.0.0.1.evil.example", "", "[::1"):
        assert c.get("/api/health", headers={"host": host}).status_code == 400, host
    anyone = TestClient(_app(allowed_hosts=("*",)))  # base_url http://testserver
    assert anyone.get("/api/health").status_code == 200
    assert TestClient(_app()).get("/api/health").status_code == 200  # None: the app alone checks nothing
    for bad in ((), ("",), (" x",), (3,), ("*foo",), ("a*b",), ("proxy.lan:8080",), ("[::1",)):
        with pytest.raises(ConfigError, match="allowed_hosts"):
            ServiceConfig(index="unused", allowed_hosts=bad)


def test_cli_serve_on_loopback_answers_loopback_names_and_allowed_hosts_only(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    _index().save(tmp_path / "index")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dmlkit", "serve", "--index", str(tmp_path / "index"),
                             "--port", "0", "--allowed-host", "proxy.example"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # printed once the socket listens
        assert line.startswith("dmlkit serve: "), line + proc.stderr.read()
        url = line.split()[-4].rstrip("/")
        port = url.rsplit(":", 1)[1]
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/api/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        codes = {host: httpx.get(f"{url}/api/health", headers={"host": f"{host}:{port}"}, timeout=10).status_code
                 for host in ("127.0.0.1", "localhost", "proxy.example", "evil.example")}
        assert codes == {"127.0.0.1": 200, "localhost": 200, "proxy.example": 200, "evil.example": 400}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()


def test_every_loopback_address_gets_the_host_check():
    """127.0.0.2 is loopback too (the check covered three spellings only); off loopback: none."""
    from dmlkit.apps.service.app import loopback_hosts

    assert loopback_hosts("127.0.0.2") == ("127.0.0.1", "localhost", "[::1]", "127.0.0.2")
    assert loopback_hosts("::1") == loopback_hosts("LOCALHOST") == ("127.0.0.1", "localhost", "[::1]")
    assert loopback_hosts("0.0.0.0") == loopback_hosts("192.168.1.2") == loopback_hosts("example.com") == ()


def test_cli_serve_passes_the_image_pool_and_host_options(monkeypatch, run_cli):
    import dmlkit.apps.service as service

    seen = {}
    monkeypatch.setattr(service, "run_server", lambda config, host, port: seen.update(config=config, host=host))
    code, _, err = run_cli(["serve", "--index", "idx", "--image-workers", "2", "--image-queue", "0",
                            "--allowed-host", "proxy.lan", "--host", "127.0.0.2"])
    assert code == 0, err
    config = seen["config"]
    assert (config.image_workers, config.image_queue) == (2, 0)
    assert config.allowed_hosts == ("127.0.0.1", "localhost", "[::1]", "127.0.0.2", "proxy.lan")
    assert run_cli(["serve", "--index", "idx", "--image-workers", "0"])[0] == 2
