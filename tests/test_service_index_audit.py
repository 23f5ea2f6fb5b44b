"""Audit of the retrieval index, the search service and their commands: each test pins one fix."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex

pytest.importorskip("faiss")


def _knn_indices(x: np.ndarray, q: np.ndarray, k: int, distance: str) -> np.ndarray:
    from dmlkit.metrics import knn

    return knn(q, x, k=k, distance=distance, exclude_self=False).indices.numpy()


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
def test_zero_rows_do_not_crowd_out_the_exact_neighbours(distance):
    """Zero embeddings (a failed image, padding) score 0; their 1/|x| overflowed float32 to inf
    and 0 * inf = NaN ranked them above every real row, so a flat index with 2k + 16 zero rows
    returned only zero rows, and the recall of approximate kinds was measured against them."""
    rng = np.random.default_rng(0)
    real = rng.normal(size=(40, 8)).astype(np.float32)
    x = np.concatenate([np.zeros((100, 8), np.float32), real])
    q = real[:5].copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no overflow / invalid value on the way
        res = EmbeddingIndex(x, distance=distance).search(q, 5)
    np.testing.assert_array_equal(res.indices[:, 0], np.arange(100, 105))  # each query finds itself
    np.testing.assert_array_equal(res.indices, _knn_indices(x, q, 5, distance))
    assert np.isfinite(res.scores).all()


@pytest.mark.parametrize(("distance", "normalize"), [("cosine", True), ("euclidean", True), ("dot", True)])
def test_many_exact_ties_are_broken_by_row(distance, normalize):
    """More than 2k + 16 equal rows: the candidate scan kept an arbitrary ``argpartition`` subset
    of them, so the first tied rows (the order of dmlkit.metrics.knn and of the docs) were lost."""
    x = np.zeros((101, 4), np.float32)
    x[:100, 0] = 1  # 100 copies of e1 (exact scores, whatever the summation order)
    x[100, 1] = 2  # one row off unit norm: the numpy scan, not faiss's
    q = np.array([[1, 0, 0, 0]], np.float32)
    res = EmbeddingIndex(x, distance=distance, normalize=normalize).search(q, 5)
    np.testing.assert_array_equal(res.indices, [[0, 1, 2, 3, 4]])


@pytest.mark.parametrize("value", ["nan", "inf", "1e-9"])
def test_cli_serve_refuses_a_non_finite_upload_limit_in_one_line(tmp_path, value):
    """``--max-upload-mb nan`` raised ``ValueError: cannot convert float NaN to integer`` (inf:
    ``OverflowError``), a traceback, before any check; a limit under one byte named a field the
    user never typed."""
    from typer.testing import CliRunner

    from dmlkit.cli import app as cli
    from dmlkit.exceptions import ConfigError

    res = CliRunner().invoke(cli, ["serve", "--index", str(tmp_path / "nope"), "--max-upload-mb", value])
    assert isinstance(res.exception, ConfigError), res.exception
    assert "--max-upload-mb" in str(res.exception)


def test_the_search_page_never_writes_result_fields_as_markup():
    """Result labels are free text (class names, e.g. folder names): the page wrote them with
    ``innerHTML``, so a class named ``<img src=x onerror=...>`` ran as script in the viewer's
    browser. Every field now goes in as text (no browser here: the script is read)."""
    from dmlkit.apps.service.app import STATIC

    script = (STATIC / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert sink not in script, sink
    assert "textContent" in script


@pytest.mark.parametrize("kind", ["hnsw", "ivf_flat"])
def test_an_empty_approximate_index_saves_and_loads(tmp_path, kind):
    """An approximate index without items has no faiss structure yet (built with ``dim=``, or an
    HNSW graph after ``dmlkit index --remove`` of every item): it saved, then its load refused it
    as "without its faiss.index file: rebuild it", so ``--add`` could not refill it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 8)).astype(np.float32)
    empty = EmbeddingIndex(None, dim=8, kind=kind)
    if kind == "hnsw":  # emptied by removal: the graph is rebuilt from no rows, i.e. dropped
        empty = EmbeddingIndex(x, kind=kind, recall_queries=6)
        empty.remove(empty.ids.copy())
    loaded = EmbeddingIndex.load(empty.save(tmp_path / "idx"))
    assert len(loaded) == 0 and loaded.kind == kind and loaded.dim == 8
    loaded.add(x, ids=[f"n{i}" for i in range(60)])
    res = loaded.search(x[:3], 1)
    np.testing.assert_array_equal(res.ids[:, 0], ["n0", "n1", "n2"])


def test_a_query_whose_id_is_not_indexed_keeps_every_neighbour():
    """``exclude_ids`` with k >= the index size cut every query to size - 1 neighbours, also a
    query whose id is not in the index (``dmlkit query --exclude-self`` on a file of which only
    some ids are indexed), which silently lost its farthest item."""
    x = np.eye(4, dtype=np.float32)[[0, 1, 2, 3, 0]] + np.float32(0.25)
    idx = EmbeddingIndex(x, ids=list("abcde"))
    res = idx.search(x[:2], 10, exclude_ids=["not-indexed", "b"])
    records = res.to_records()
    assert sorted(r["id"] for r in records[0]) == list("abcde")
    assert sorted(r["id"] for r in records[1]) == list("acde")
    assert res.indices[1, -1] == -1 and np.isnan(res.scores[1, -1])
    every = idx.search(x[:2], 10, exclude_ids=["a", "b"])  # every query drops one: size - 1 columns
    assert every.indices.shape == (2, 4) and (every.indices >= 0).all()


@pytest.fixture(scope="module")
def small_cnn_service():
    """A service whose model keeps the images' size (a run without ``image_size``): built once."""
    import torch
    from fastapi.testclient import TestClient

    from dmlkit.apps.export import ImageEmbedder, _torch_forward
    from dmlkit.apps.service import ServiceConfig, create_app
    from dmlkit.models.trunks import SmallCNN

    torch.manual_seed(0)
    embedder = ImageEmbedder(_torch_forward(SmallCNN(in_channels=1).eval(), "cpu"), None, None, 1, "torch")
    idx = EmbeddingIndex(np.random.default_rng(0).normal(size=(10, 128)).astype(np.float32))
    return TestClient(create_app(ServiceConfig(index="unused", threshold=0.5), index=idx, embedder=embedder),
                      raise_server_exceptions=False)


def test_an_image_the_model_cannot_embed_is_a_422_not_a_500(small_cnn_service):
    """A run that keeps the images' size (no ``image_size``) embeds any upload as is; one too small
    for the CNN's pooling raised torch's RuntimeError in the endpoint: HTTP 500 for a bad image."""
    import io

    from PIL import Image

    client = small_cnn_service
    before = client.get("/api/metrics").json()["status"]
    buf = io.BytesIO()
    Image.new("L", (4, 4)).save(buf, format="PNG")
    for response in (client.post("/api/query/image", files={"file": ("a.png", buf.getvalue())}),
                     client.post("/api/verify", files={"image1": ("a.png", buf.getvalue()),
                                                       "image2": ("b.png", buf.getvalue())})):
        assert response.status_code == 422, response.text
        assert "cannot embed images preprocessed to 1x4x4" in response.json()["detail"]
    after = client.get("/api/metrics").json()["status"]
    assert after.get("4xx", 0) - before.get("4xx", 0) == 2 and "5xx" not in after
    assert client.post("/api/query/image", files={"file": ("a.png", _png(32))}).status_code == 200


def _png(size: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (size, size), color=100).save(buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A tiny PNG file that declares ``width x height`` pixels (its data stop after one row)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * (1 + width)))
            + chunk(b"IEND", b""))


def test_an_image_beyond_pils_own_limit_is_a_413_too_large(small_cnn_service):
    """Images over ``max_image_pixels`` get 413 (docs); beyond twice PIL's own limit (179 Mpx)
    ``Image.open`` raised DecompressionBombError first, answered 400 "not an image PIL can read"."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's DecompressionBombWarning for the 100 Mpx one
        for side in (10_000, 20_000):  # 100 Mpx (our limit) and 400 Mpx (PIL's)
            r = small_cnn_service.post("/api/query/image", files={"file": ("big.png", _png_header(side, side))})
            assert r.status_code == 413, (side, r.text)
            assert "not an image" not in r.json()["detail"]


def test_a_thumbnail_of_an_indexed_image_too_large_to_decode_is_a_404(tmp_path):
    """PIL's DecompressionBombError is no OSError: an indexed image beyond its limit answered 500."""
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    (tmp_path / "big.png").write_bytes(_png_header(20_000, 20_000))
    idx = EmbeddingIndex(np.eye(2, dtype=np.float32), ids=["big.png", "other.png"])
    client = TestClient(create_app(ServiceConfig(index="unused", data_root=tmp_path), index=idx),
                        raise_server_exceptions=False)
    r = client.get("/api/items/big.png/thumbnail")
    assert r.status_code == 404 and "too large to decode" in r.json()["detail"], r.text


def test_a_benchmark_report_does_not_crown_a_method_without_a_value(tmp_path):
    """The method whose figures the report draws was ``max`` over concatenated MAP@R; a first
    method without one (NaN: a diverged or unfinished method) compared as never smaller, so it
    was taken as the best: here the untrained model's note went missing."""
    import json

    from dmlkit.report import ReportOptions, build_report

    def cell(mean):
        return {"mean": mean, "ci95": None, "values": [mean]}

    def sections(values):
        return {"concatenated": values, "separated": values}

    methods = {"diverged": sections({"precision_at_1": cell(0.1)}),  # no map_at_r
               "pretrained": sections({"map_at_r": cell(0.6)}),
               "contrastive": sections({"map_at_r": cell(0.5)})}
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods, "metrics": ["map_at_r"]}))
    html = build_report(tmp_path, options=ReportOptions(maps=())).read_text()
    assert "No method beat the untrained model" in html


def test_exact_rescoring_memory_is_bounded_for_a_large_k():
    """The float64 re-scoring gathered 1024 queries x (2k + 16) candidates x D at once: 260 MB
    here (Q = 256, k = 500, D = 64), 8 GB for ``dmlkit query -k 500`` on 512-d vectors."""
    import tracemalloc

    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 64)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = rng.normal(size=(256, 64)).astype(np.float32)
    idx = EmbeddingIndex(x)
    small = idx.search(q, 500)
    tracemalloc.start()
    try:
        res = idx.search(q, 500)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 * 2**20, peak / 2**20
    np.testing.assert_array_equal(res.indices, small.indices)
    np.testing.assert_array_equal(res.indices[:, :10], idx.search(q, 10).indices)


@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "hnsw"])
def test_remove_counts_an_id_given_twice_once(kind):
    """``remove(["a", "a"])`` (``dmlkit index --remove a --remove a``) reported 2 items removed."""
    x = np.random.default_rng(0).normal(size=(60, 4)).astype(np.float32)
    idx = EmbeddingIndex(x, ids=[f"i{j}" for j in range(60)], kind=kind, recall_queries=6)
    assert idx.remove(["i1", "i1", "i2"]) == 2
    assert len(idx) == 58 and "i1" not in set(idx.ids) and "i3" in set(idx.ids)
    assert idx.search(x[3:4], 1).ids[0, 0] == "i3"


@pytest.mark.parametrize("option", [("--kind", "hnsw"), ("--distance", "dot")])
def test_index_add_refuses_another_kind_or_distance_instead_of_ignoring_it(tmp_path, option):
    """``dmlkit index more.npz -o idx --add --kind hnsw`` (or ``--distance dot``) added to the
    existing flat cosine index and said nothing of the option; the same values as the index's
    own are accepted."""
    from typer.testing import CliRunner

    from dmlkit.cli import app as cli
    from dmlkit.exceptions import ConfigError

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        np.savez(tmp_path / f"{name}.npz", embeddings=rng.standard_normal((12, 4)).astype(np.float32),
                 labels=np.arange(12) % 3, ids=np.array([f"{name}{i}" for i in range(12)]))
    idx = tmp_path / "idx"
    assert CliRunner().invoke(cli, ["index", str(tmp_path / "a.npz"), "-o", str(idx)]).exit_code == 0
    res = CliRunner().invoke(cli, ["index", str(tmp_path / "b.npz"), "-o", str(idx), "--add", *option])
    assert isinstance(res.exception, ConfigError), res.output
    assert option[0] in str(res.exception)
    assert len(EmbeddingIndex.load(idx)) == 12  # untouched
    same = ("--kind", "flat") if option[0] == "--kind" else ("--distance", "cosine")
    res = CliRunner().invoke(cli, ["index", str(tmp_path / "b.npz"), "-o", str(idx), "--add", *same])
    assert res.exit_code == 0, res.output
    assert len(EmbeddingIndex.load(idx)) == 24


def test_a_flat_index_answers_a_query_alike_in_any_batch():
    """Many queries (Q x M > SMALL_EXACT) went to the blockwise kNN, whose float32 order was
    returned without the float64 re-scoring: exactly tied rows (integer vectors, equal cosines)
    came out of row order, for 143 of 900 queries, against each query searched alone."""
    from dmlkit.apps import index_exact

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (5000, 4)).astype(np.float32)
    x[~x.any(1)] = 1
    q = rng.integers(-3, 4, (900, 4)).astype(np.float32)
    q[~q.any(1)] = 1
    assert q.shape[0] * x.shape[0] > index_exact.SMALL_EXACT
    idx = EmbeddingIndex(x)
    together = idx.search(q, 10).indices
    alone = np.concatenate([idx.search(q[i:i + 8], 10).indices for i in range(0, 900, 8)])
    np.testing.assert_array_equal(together, alone)
    rows = np.tile(np.arange(5000), (900, 1))  # every row's float64 closeness, ties by row
    score = index_exact.closeness64(x, q, rows, "cosine", True)
    np.testing.assert_array_equal(together, np.lexsort((rows, -score), axis=1)[:, :10])


@pytest.mark.parametrize("distance", ["euclidean", "dot"])
@pytest.mark.parametrize("scale", [(2e19, 1.0), (1e10, 1.0), (1e-25, 1e-25)], ids=["huge", "far", "tiny"])
def test_raw_vectors_of_any_magnitude_get_their_float64_neighbours(distance, scale):
    """normalize=False: a query of 2e19 made faiss's float32 L2 scan inf (rows -1: an empty
    answer), one of 1e10 cancelled in ``|q|^2 + |x|^2 - 2 <q, x>`` (arbitrary rows), and rows near
    1e-25 underflowed (every score 0: the first rows). Now the float64 ranking, ties by row."""
    q_scale, x_scale = scale
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 8)).astype(np.float32) * np.float32(x_scale)
    q = np.zeros((2, 8), np.float32)
    q[0, 0], q[1, :2] = q_scale, (q_scale, -q_scale / 3)
    if x_scale < 1:
        q = x[:2] + np.float32(x_scale / 100)
    res = EmbeddingIndex(x, distance=distance, normalize=False).search(q, 5)
    x64, q64 = x.astype(np.float64), q.astype(np.float64)
    for i in range(2):
        s = -((q64[i] - x64) ** 2).sum(1) if distance == "euclidean" else x64 @ q64[i]
        np.testing.assert_array_equal(res.indices[i], np.lexsort((np.arange(500), -s))[:5])


def test_an_ivf_pq_index_of_one_vector_is_one_error():
    from dmlkit.exceptions import DataError

    with pytest.raises(DataError, match="ivf_pq index trains 2 codes per sub-vector on at least as many vectors, got 1"):
        EmbeddingIndex(np.ones((1, 8), np.float32), kind="ivf_pq")


def test_a_refused_add_says_nothing_was_removed(tmp_path, run_cli):
    """``--remove 1 --add`` without EMBEDDINGS printed "removed 1 item(s)", then refused, and
    saved nothing: stdout claimed a change that never happened."""
    np.savez(tmp_path / "r.npz", embeddings=np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32))
    idx = tmp_path / "ri"
    assert run_cli(["index", str(tmp_path / "r.npz"), "-o", str(idx)])[0] == 0
    code, out, err = run_cli(["index", "-o", str(idx), "--remove", "1", "--add"])
    assert (code, out) == (2, "") and "--add needs EMBEDDINGS" in err
    assert len(EmbeddingIndex.load(idx)) == 10


def test_the_service_takes_json_numbers_only_for_numbers(tmp_path):
    """``k: true`` was k = 1, ``[true, false, ...]`` a vector, ``"3"`` a k: a 422 now."""
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig
    from dmlkit.apps.service.app import create_app

    x = np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32)
    idx = EmbeddingIndex(x, ids=[f"i{j}" for j in range(20)])
    client = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    e = [0.1, -0.2, 0.3, 0.4]
    for body in ({"embedding": e, "k": True}, {"embedding": [True, False, True, False], "k": 3},
                 {"embedding": e, "k": "3"}, {"embedding": ["1", 0, 0, 0], "k": 3}):
        assert client.post("/api/query/embedding", json=body).status_code == 422, body
    for body in ({"id": "i1", "k": True}, {"id": "i1", "k": 3, "exclude_self": "yes"}):
        assert client.post("/api/query/id", json=body).status_code == 422, body
    assert client.post("/api/query/embedding", json={"embedding": [1, 0, 0, 0], "k": 3}).status_code == 200
    assert client.post("/api/query/id", json={"id": "i1", "k": 3}).status_code == 200
