"""EmbeddingIndex: exact and faiss ANN kinds, measured recall, tuning, ids, persistence, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps.index import INDEX_KINDS, recall_at_k
from dmlkit.cli import app
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, ShapeError

faiss = pytest.importorskip("faiss")

ANN = [k for k in INDEX_KINDS if k != "flat"]


pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def _blobs(n=3000, d=16, centres=30, noise=0.6, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centres, d))
    lab = rng.integers(0, centres, n)
    return (c[lab] + noise * rng.normal(size=(n, d))).astype(np.float32), lab


@pytest.fixture(scope="module")
def data():
    x, y = _blobs(n=2300)  # the last 300 rows are held out as fresh queries
    return x[:2000], y[:2000]


@pytest.fixture(scope="module")
def fresh():
    return _blobs(n=2300)[0][2000:]


@pytest.fixture(scope="module", params=ANN)
def tuned(request, data):
    x, y = data
    idx = EmbeddingIndex(x, y, kind=request.param, target_recall=0.95, recall_queries=300, seed=0)
    return idx


def test_recall_at_k_formula():
    approx = np.array([[1, 2, 3], [4, -1, 6]])
    exact = np.array([[3, 2, 9], [4, 5, 6]])
    assert recall_at_k(approx, exact, 3) == pytest.approx((2 + 2) / 6)
    assert recall_at_k(exact, exact, 3) == 1.0


def test_tuned_index_reaches_target_and_holds_on_fresh_queries(tuned, data, fresh):
    x, _ = data
    rec = tuned.recall
    # HNSW holds 10 % of the rows (200) out of the graph as its queries; IVF samples 300 rows
    assert rec["met"] is True and rec["recall"] >= 0.95
    assert rec["num_queries"] == (200 if tuned.kind == "hnsw" else 300)
    assert rec["held_out"] is (tuned.kind == "hnsw")  # 200 untrained IVF rows < 300 queries
    # the chosen setting is the first (cheapest) that reached the target
    assert all(t["recall"] < 0.95 for t in rec["tried"][:-1])
    assert [t["cost"] for t in rec["tried"]] == sorted(t["cost"] for t in rec["tried"])
    # recall re-measured on fresh queries from the same distribution, against exact search
    exact = EmbeddingIndex(x).search(fresh, 10).indices
    approx = tuned.search(fresh, 10).indices
    assert recall_at_k(approx, exact, 10) >= 0.9
    # exact=True on an approximate index equals the flat index
    np.testing.assert_array_equal(tuned.search(fresh[:20], 10, exact=True).indices, exact[:20])


def test_untuned_recall_is_measured_and_tuning_costs_more(data):
    x, _ = data
    cheap = EmbeddingIndex(x, kind="ivf_flat", nlist=64, nprobe=1, recall_queries=300)
    assert 0 < cheap.recall["recall"] < 1 and cheap.recall["target"] is None
    tuned = EmbeddingIndex(x, kind="ivf_flat", nlist=64, target_recall=0.99, recall_queries=300)
    assert tuned.params["nprobe"] > 1 and tuned.recall["recall"] >= 0.99
    # the recall of HNSW grows with ef_search
    low = EmbeddingIndex(x, kind="hnsw", hnsw_m=4, ef_search=16, recall_queries=300).recall["recall"]
    high = EmbeddingIndex(x, kind="hnsw", hnsw_m=4, ef_search=256, recall_queries=300).recall["recall"]
    assert high > low and high > 0.97


def test_hnsw_measures_recall_on_rows_kept_out_of_the_graph(data, fresh):
    x, _ = data
    built = EmbeddingIndex(x, kind="hnsw", hnsw_m=4, ef_search=16, recall_queries=150)
    rec = built.recall
    assert rec["held_out"] is True and rec["num_queries"] == 150
    assert built._graph_reserve.size == 0 and built._faiss_index.ntotal == len(x)  # joined after
    # a re-measurement now samples rows that are nodes of the graph, and says so
    assert built.measure_recall(k=10, num_queries=150)["held_out"] is False
    # built empty, then added: the reserve waits for the tuning, and the exact lists leave the
    # rows outside the graph out (an exhaustive walk then finds every exact neighbour)
    idx = EmbeddingIndex(None, dim=x.shape[1], kind="hnsw", recall_queries=100)
    idx.add(x[:1000])
    idx.add(x[1000:])
    assert idx._graph_reserve.size == 100 and idx._faiss_index.ntotal == len(x) - 100
    full = idx.tune(1.0, k=10)
    assert full["held_out"] and full["met"] and full["recall"] == 1.0
    assert idx._faiss_index.ntotal == len(x)
    # a search before any measurement puts the reserve into the graph first
    other = EmbeddingIndex(None, dim=x.shape[1], kind="hnsw", recall_queries=100)
    other.add(x)
    assert other._faiss_index.ntotal == len(x) - 100
    found = other.search(x[:3], 1)
    assert other._faiss_index.ntotal == len(x) and list(found.indices[:, 0]) == [0, 1, 2]


@pytest.mark.parametrize(("distance", "normalize"), [("euclidean", True), ("euclidean", False), ("dot", False)])
def test_ann_scores_are_exact_scores(data, distance, normalize):
    x, _ = data
    x = x[:600] * np.linspace(0.5, 2.0, 600, dtype=np.float32)[:, None]  # varied norms
    q = x[:5] + 0.01
    for kind in ANN:
        cells = {} if kind == "hnsw" else {"nlist": 8}
        idx = EmbeddingIndex(x, kind=kind, distance=distance, normalize=normalize, recall_queries=30, **cells)
        res = idx.search(q, 5)
        ref, qq = x[res.indices], q[:, None, :]
        if normalize:  # dmlkit.distances' default: L2-normalised embeddings
            ref = ref / np.linalg.norm(ref, axis=-1, keepdims=True)
            qq = qq / np.linalg.norm(qq, axis=-1, keepdims=True)
        expect = np.sqrt(((ref - qq) ** 2).sum(-1)) if distance == "euclidean" else (ref * qq).sum(-1)
        np.testing.assert_allclose(res.scores, expect, rtol=2e-3, atol=2e-3)
        order = res.scores if distance == "dot" else -res.scores
        assert np.all(np.diff(order, axis=1) <= 1e-4)


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_add_remove_get_and_round_trip(tmp_path, data, kind):
    x, y = data
    x, y = x[:900], y[:900]
    ids = np.array([f"item/{i}.jpg" for i in range(len(x))])
    meta = [{"n": i} for i in range(len(x))]
    idx = EmbeddingIndex(x[:600], y[:600], ids[:600], kind=kind, metadata=meta[:600], recall_queries=50)
    idx.add(x[600:], y[600:], ids[600:], meta[600:])
    assert len(idx) == 900
    np.testing.assert_array_equal(idx.get(["item/700.jpg"]), x[700:701])
    gone = [f"item/{i}.jpg" for i in range(0, 900, 3)]
    assert idx.remove(gone) == 300 and len(idx) == 600
    res = idx.search(x[:50], 10)
    assert not set(res.ids.ravel().tolist()) & set(gone)
    kept = res.ids[res.indices >= 0]
    assert np.all(idx.labels[idx.positions(kept)] == y[[int(s[5:-4]) for s in kept]])
    rec = res.to_records()[1][0]
    assert rec["id"] == "item/1.jpg" and rec["metadata"] == {"n": 1} and rec["label"] == y[1]
    with pytest.raises(DataError, match="not in the index"):
        idx.remove(["item/0.jpg"])
    with pytest.raises(DataError, match="already in the index"):
        idx.add(x[:1], y[:1], ["item/1.jpg"], [None])
    for path in (tmp_path / "idx", tmp_path / "idx.npz"):
        idx.save(path)
        again = EmbeddingIndex.load(path)
        back = again.search(x[:50], 10)
        np.testing.assert_array_equal(back.indices, res.indices)
        np.testing.assert_array_equal(back.ids, res.ids)
        assert again.kind == kind and again.describe()["params"] == idx.describe()["params"]
        assert again.metadata == idx.metadata and again.recall == idx.recall
    idx.save(tmp_path / "idx")  # overwrite in place
    assert EmbeddingIndex.load(tmp_path / "idx", mmap=True).search(x[:5], 3).ids.shape == (5, 3)


def test_exclude_ids_drops_only_the_query_item(data):
    x, _ = data
    idx = EmbeddingIndex(x[:500], ids=[f"i{j}" for j in range(500)])
    plain = idx.search(x[:20], 6)
    assert np.all(plain.ids[:, 0] == [f"i{j}" for j in range(20)])
    res = idx.search(x[:20], 5, exclude_ids=[f"i{j}" for j in range(20)])
    np.testing.assert_array_equal(res.indices, plain.indices[:, 1:])
    # any other id: the plain list without that id, first 5
    other = idx.search(x[:20], 5, exclude_ids=["i499"] * 20).indices
    for row, full in zip(other, plain.indices):
        np.testing.assert_array_equal(row, [i for i in full if i != 499][:5])


@pytest.mark.parametrize("kind", ["hnsw", "ivf_flat"])
def test_an_approximate_search_never_returns_a_short_list(data, kind):
    """faiss may answer with fewer than k (-1 slots: an HNSW walk on a small graph with a large
    k; IVF cells holding fewer than k): those queries are answered exactly instead."""
    x, _ = data
    settings = {"hnsw": {"hnsw_m": 4, "ef_search": 1}, "ivf_flat": {"nlist": 20, "nprobe": 1}}[kind]
    idx = EmbeddingIndex(x[:200], kind=kind, recall_queries=10, **settings)
    raw, _ = idx._ann(x[:50], 150, idx._setting())
    assert (raw < 0).any()  # the structure alone leaves slots empty here
    res = idx.search(x[:50], 150)
    assert (res.indices >= 0).all() and np.isfinite(res.scores).all() and (res.ids != "").all()
    exact = idx.search(x[:50], 150, exact=True)
    short = (raw < 0).any(axis=1)
    np.testing.assert_array_equal(res.indices[short], exact.indices[short])
    by_id = idx.search(x[:50], 150, exclude_ids=idx.ids[:50])  # k others, never k - 1
    assert (by_id.indices >= 0).all() and not (by_id.ids == idx.ids[:50, None]).any()
    numpy_k = idx.search(x[:5], np.int64(3))  # faiss's SWIG wrappers refused numpy integers
    np.testing.assert_array_equal(numpy_k.indices, idx.search(x[:5], 3).indices)


def test_index_errors(tmp_path, data):
    x, _ = data
    for name in ("nprobe", "nlist"):
        with pytest.raises(ConfigError, match=f"^{name} must be a positive integer, got 0$"):
            EmbeddingIndex(x[:100], kind="ivf_flat", **{name: 0})
    with pytest.raises(ConfigError, match="unknown index kind"):
        EmbeddingIndex(x, kind="lsh")
    with pytest.raises(ConfigError, match="must divide"):
        EmbeddingIndex(x, kind="ivf_pq", pq_m=5)
    with pytest.raises(ConfigError, match="target_recall"):
        EmbeddingIndex(x, kind="hnsw", target_recall=1.5)
    with pytest.raises(ConfigError, match="gpu"):
        EmbeddingIndex(x, kind="hnsw", gpu=True)
    with pytest.raises(DataError, match="unique"):
        EmbeddingIndex(x[:3], ids=["a", "b", "a"])
    with pytest.raises(ConfigError, match="exact"):
        EmbeddingIndex(x).measure_recall()
    idx = EmbeddingIndex(x[:100], kind="hnsw", recall_queries=20)
    with pytest.raises(ShapeError):
        idx.search(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ConfigError, match="k must"):
        idx.search(x[:2], 0)
    with pytest.raises(DataNotFoundError):
        EmbeddingIndex.load(tmp_path / "missing")
    idx.save(tmp_path / "h")
    (tmp_path / "h" / "faiss.index").unlink()
    with pytest.raises(DataError, match="faiss.index"):
        EmbeddingIndex.load(tmp_path / "h")
    (tmp_path / "junk").mkdir()
    with pytest.raises(DataError, match="not a dmlkit index"):
        EmbeddingIndex.load(tmp_path / "junk")


# -- CLI -------------------------------------------------------------------------------------
def test_cli_query_exclude_self_on_the_id_less_file_the_index_was_built_from(tmp_path, data):
    """An index built from a file without ids numbers its items from 0; querying that same file
    with --exclude-self uses the row numbers (checked: the rows equal the stored items), and a
    file whose rows are not those items is still refused."""
    x, y = data
    np.savez(tmp_path / "plain.npz", embeddings=x[:300], labels=y[:300])
    runner = CliRunner()
    res = runner.invoke(app, ["index", str(tmp_path / "plain.npz"), "-o", str(tmp_path / "idx")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), str(tmp_path / "plain.npz"), "-k", "3",
                              "--exclude-self", "-o", str(tmp_path / "out.json")])
    assert res.exit_code == 0, res.output
    written = json.loads((tmp_path / "out.json").read_text())
    assert [row["query"] for row in written] == [str(i) for i in range(300)]
    assert all(r["id"] != row["query"] for row in written for r in row["results"])
    with_self = runner.invoke(app, ["query", str(tmp_path / "idx"), str(tmp_path / "plain.npz"), "-k", "2", "--json"])
    printed = json.loads(with_self.output)  # the shape -o writes: the query's id and its results
    assert printed[4]["query"] == "4" and printed[4]["results"][0]["index"] == 4  # without the flag: itself first
    assert printed[4]["results"][1]["id"] == written[4]["results"][0]["id"]
    np.savez(tmp_path / "other.npz", embeddings=x[300:600], labels=y[300:600])
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), str(tmp_path / "other.npz"), "--exclude-self"])
    assert isinstance(res.exception, DataError) and "not the index's first items" in str(res.exception)


def test_cli_index_query_with_target_recall_exclude_self_and_bounded_output(tmp_path, data):
    x, y = data
    ids = np.array([f"p{i}" for i in range(len(x))])
    save_embeddings(tmp_path / "ref.npz", x, y, ids=ids)
    runner = CliRunner()
    res = runner.invoke(app, ["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "idx"), "--kind", "hnsw",
                              "--target-recall", "0.95", "--recall-queries", "200", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["kind"] == "hnsw" and summary["recall"]["recall"] >= 0.95 and summary["recall"]["met"]
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), str(tmp_path / "ref.npz"), "-k", "3",
                              "--exclude-self", "-o", str(tmp_path / "out.json")])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 22 and "1980 more queries not shown" in lines[-2]  # 20 shown by default
    assert "-o FILE writes" not in lines[-2]  # it did: no hint to give the option already given
    assert lines[0].startswith("query 0 (p0): ") and "p0 " not in lines[0]
    written = json.loads((tmp_path / "out.json").read_text())
    assert len(written) == len(x) and written[5]["query"] == "p5"
    assert all(r["id"] != row["query"] for row in written for r in row["results"])
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), "--id", "p7", "-k", "3", "--json"])
    assert res.exit_code == 0, res.output
    by_id = json.loads(res.stdout)[0]
    assert by_id["query"] == "p7" and by_id["results"] == written[7]["results"]
    # add and remove by id from the command line
    save_embeddings(tmp_path / "more.npz", x[:2] + 1, y[:2], ids=np.array(["new0", "new1"]))
    res = runner.invoke(app, ["index", str(tmp_path / "more.npz"), "-o", str(tmp_path / "idx"), "--add",
                              "--remove", "p0", "--remove", "p1"])
    assert res.exit_code == 0, res.output
    changed = EmbeddingIndex.load(tmp_path / "idx")
    assert len(changed) == len(x) and {"new0", "new1"} <= set(changed.ids) and "p0" not in set(changed.ids)
    assert changed.recall["stale"] is True
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), "--id", "nope"])
    assert isinstance(res.exception, DataError) and "not in the index" in str(res.exception)
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), str(tmp_path / "missing.npz")])
    assert isinstance(res.exception, DataNotFoundError)  # the CLI prints it in one line, exit 2
    res = runner.invoke(app, ["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "x"), "--kind", "annoy"])
    assert isinstance(res.exception, ConfigError) and "unknown index kind" in str(res.exception)


def test_cli_index_of_a_run_uses_the_dataset_paths_as_ids(tmp_path, data_root):
    """Issue 11.21: a run's embeddings/<split>.npz (dataset rows) maps back to files."""
    from dmlkit.data import load_dataset

    run = tmp_path / "run"
    (run / "embeddings").mkdir(parents=True)
    config = {"data": {"dataset": "att_faces", "transform": "grayscale", "image_size": 32},
              "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 8, "in_channels": 1},
              "loss": {"name": "contrastive"}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    ds = load_dataset("att_faces", root=data_root)
    rows = np.arange(0, len(ds), 7)
    emb = np.random.default_rng(0).normal(size=(len(rows), 8)).astype(np.float32)
    save_embeddings(run / "embeddings" / "test.npz", emb, ds.labels[rows], indices=rows)
    runner = CliRunner()
    res = runner.invoke(app, ["index", str(run / "embeddings" / "test.npz"), "-o", str(tmp_path / "idx"),
                              "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    idx = EmbeddingIndex.load(tmp_path / "idx")
    assert idx.info["data_root"] == str(Path(data_root).resolve()) and idx.info["run_dir"] == str(run.resolve())
    expected = [str(Path(ds.paths[r]).resolve().relative_to(Path(data_root).resolve())) for r in rows]
    assert idx.ids.tolist() == expected
    assert all((Path(data_root) / i).is_file() for i in idx.ids)
    res = runner.invoke(app, ["query", str(tmp_path / "idx"), str(run / "embeddings" / "test.npz"), "-k", "2",
                              "--exclude-self", "--json", "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    records = json.loads(res.stdout)
    assert [row["query"] for row in records] == expected
    assert all(r["id"] != expected[q] for q, row in enumerate(records) for r in row["results"])


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
def test_flat_search_equals_the_metrics_knn_with_ties_by_row(data, distance):
    from dmlkit.metrics import knn

    x, _ = data
    x = np.concatenate([x[:300], x[:50]])  # rows 300..349 duplicate rows 0..49: exact ties
    q = x[:40] + np.float32(0.05)
    res = EmbeddingIndex(x, distance=distance).search(q, 10)  # one-matmul path for few queries
    ref = knn(q, x, k=10, distance=distance, exclude_self=False)
    np.testing.assert_array_equal(res.indices, ref.indices.numpy())
    np.testing.assert_allclose(res.scores, ref.values.numpy(), rtol=1e-5, atol=1e-5)
    dup = res.indices[:, :2]
    assert np.all(dup[:, 0] < dup[:, 1]) and np.all(dup[:, 1] - dup[:, 0] == 300)


def _unit_rows(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize(("distance", "normalize"),
                         [("cosine", True), ("euclidean", True), ("dot", True), ("euclidean", False), ("dot", False)])
def test_flat_faiss_scan_equals_the_metrics_knn_and_the_numpy_path(data, monkeypatch, distance, normalize):
    """Unit-norm rows (and raw dot / euclidean) take faiss's brute-force scan; the neighbours, their
    order (ties by row) and the scores are those of dmlkit.metrics.knn and of the numpy path."""
    from dmlkit.apps import index_exact
    from dmlkit.distances import get_distance
    from dmlkit.metrics import knn

    x, _ = data
    x = _unit_rows(np.concatenate([x[:300], x[:50]]))  # rows 300..349 duplicate rows 0..49: exact ties
    q = x[:40] + np.float32(0.05)
    idx = EmbeddingIndex(x, distance=distance, normalize=normalize)
    assert index_exact._scan_metric(idx.embeddings, distance, idx._unit, idx._row_norms()) is not None
    res = idx.search(q, 10)
    ref = knn(q, x, k=10, distance=get_distance(distance, normalize_embeddings=normalize), exclude_self=False)
    np.testing.assert_array_equal(res.indices, ref.indices.numpy())
    np.testing.assert_allclose(res.scores, ref.values.numpy(), rtol=1e-5, atol=1e-5)
    dup = res.indices[:, :2]
    assert np.all(dup[:, 1] - dup[:, 0] == 300)
    monkeypatch.setattr(index_exact, "_faiss_or_none", lambda: None)  # the numpy path
    again = EmbeddingIndex(x, distance=distance, normalize=normalize).search(q, 10)
    np.testing.assert_array_equal(again.indices, res.indices)
    np.testing.assert_allclose(again.scores, res.scores, rtol=1e-6, atol=1e-6)


def test_flat_rows_off_unit_norm_are_not_scanned_by_inner_product(data):
    """Cosine over rows of varied norms cannot rank by <q, x>: the numpy path (1/|x| factors) runs."""
    from dmlkit.apps import index_exact

    x, _ = data
    x = _unit_rows(x[:400]) * np.linspace(0.5, 2.0, 400, dtype=np.float32)[:, None]
    idx = EmbeddingIndex(x)
    assert not idx._row_norms().unit_rows
    assert index_exact._scan_metric(idx.embeddings, "cosine", True, idx._row_norms()) is None
    q = x[:7] * np.float32(3.0) + np.float32(0.01)
    res = idx.search(q, 5)
    cos = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ (x / np.linalg.norm(x, axis=1, keepdims=True)).T
    np.testing.assert_array_equal(res.indices, np.argsort(-cos, axis=1, kind="stable")[:, :5])


def test_many_queries_on_the_flat_scan_are_rescored_blockwise(data, monkeypatch):
    """More queries than one re-scoring block give the same result as one query at a time."""
    from dmlkit.apps import index_exact

    x, _ = data
    x = _unit_rows(x)
    monkeypatch.setattr(index_exact, "RESCORE_BLOCK", 16)
    idx = EmbeddingIndex(x)
    q = x[:50] + np.float32(0.02)
    both = idx.search(q, 3)
    for i in (0, 17, 49):
        np.testing.assert_array_equal(idx.search(q[i], 3).indices[0], both.indices[i])


def test_normalize_rows_blocks_tiny_huge_and_zero_rows(monkeypatch):
    """One normalisation for every evaluation (:func:`dmlkit.validation.normalize_rows`):
    divided in float64 and rounded once, for a few rows, in one block or many, and on
    tensors; subnormal, huge and zero rows included."""
    import torch

    from dmlkit import validation

    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    x[0] = 0
    x[1] *= np.float32(1e-42)  # subnormal entries: 1/|x| leaves float32's range
    x[2] = np.float32(3e38) / 4
    x64 = x.astype(np.float64)
    norms = np.linalg.norm(x64, axis=1, keepdims=True)
    expect = (x64 / np.where(norms == 0, 1, norms)).astype(np.float32)  # rounded once
    for block in (8192, 7):  # one block, and many
        monkeypatch.setattr(validation, "NORMALIZE_BLOCK", block)
        for rows in (slice(0, 3), slice(None)):  # the few-rows path and the blockwise one
            out = validation.normalize_rows(x[rows])
            assert out.dtype == np.float32
            np.testing.assert_array_equal(out, expect[rows])
            np.testing.assert_array_equal(validation.normalize_rows(torch.from_numpy(x[rows])).numpy(), expect[rows])
    assert not validation.normalize_rows(x[:1]).any()


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
def test_ivf_pq_reranking_is_the_same_with_and_without_faiss_gathering(data, monkeypatch, distance):
    """IVF-PQ's exact re-ranking gathers <q, x> in faiss; the numpy gather gives the same scores."""
    from dmlkit.apps import index_exact

    x, _ = data
    x = x[:800] * np.linspace(0.5, 2.0, 800, dtype=np.float32)[:, None]
    idx = EmbeddingIndex(x, kind="ivf_pq", distance=distance, normalize=False, nlist=8, nprobe=8,
                         rerank=4, recall_queries=20)
    q = x[:9] + np.float32(0.01)
    res = idx.search(q, 5)
    calls = []
    real = index_exact._gathered_dots
    monkeypatch.setattr(index_exact, "_gathered_dots", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(index_exact, "_faiss_or_none", lambda: None)
    again = idx.search(q, 5)
    assert calls
    np.testing.assert_array_equal(again.indices, res.indices)
    np.testing.assert_allclose(again.scores, res.scores, rtol=1e-5, atol=1e-5)


def test_positions_of_faiss_keys_after_removal_and_re_adding(data):
    """Without removals faiss keys are the rows; after a removal they are looked up."""
    x, _ = data
    idx = EmbeddingIndex(x[:600], kind="ivf_flat", nlist=8, nprobe=8, recall_queries=20)
    keys = np.array([[0, 5, 599, -1]])
    np.testing.assert_array_equal(idx._rows_of_keys(keys), keys)
    idx.remove(["0", "1"])
    idx.add(x[600:610])
    np.testing.assert_array_equal(idx._rows_of_keys(np.array([[2, 599, 600, 609, -1]])), [[0, 597, 598, 607, -1]])
    res = idx.search(x[605], 1)
    assert res.ids[0, 0] == "605" and res.indices[0, 0] == 603


def test_public_names_stay_importable_from_the_index_module():
    import dmlkit.apps.index as index_module
    from dmlkit.apps import index_exact, index_tuning

    for name in ("INDEX_KINDS", "EmbeddingIndex", "SearchResult", "item_ids", "recall_at_k"):
        assert hasattr(index_module, name)
    assert index_module.recall_at_k is index_tuning.recall_at_k
    assert index_exact.exact_search.__module__ == "dmlkit.apps.index_exact"


def test_add_blocks_equals_one_add_and_grows_the_arrays_once(monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1000, 16)).astype(np.float32)
    labels = rng.integers(0, 10, 1000)
    ids = np.array([f"item{i:04d}" for i in range(1000)])
    one = EmbeddingIndex(None, dim=16, kind="ivf_flat", nlist=8)
    one.add(x, labels, ids)
    commits = []
    original = EmbeddingIndex._commit
    monkeypatch.setattr(EmbeddingIndex, "_commit", lambda self, blocks: (commits.append(len(blocks)),
                                                                         original(self, blocks))[1])
    blocks = EmbeddingIndex(None, dim=16, kind="ivf_flat", nlist=8)
    assert blocks.add_blocks(x, labels, ids, rows=128) == 1000
    assert commits == [8]  # eight blocks, one growth of the stored arrays
    np.testing.assert_array_equal(blocks.embeddings, one.embeddings)
    np.testing.assert_array_equal(blocks.ids, one.ids)
    np.testing.assert_array_equal(blocks.labels, one.labels)
    np.testing.assert_array_equal(blocks._keys, one._keys)
    q = rng.standard_normal((5, 16)).astype(np.float32)
    # (the IVF quantisers differ: each is trained on its first block)
    np.testing.assert_array_equal(blocks.search(q, 5, exact=True).ids, one.search(q, 5, exact=True).ids)
    # a clash inside the stream (block 3 repeats an id of block 1): blocks 1-2 stay added
    bad = ids.copy()
    bad[300] = ids[10]
    idx = EmbeddingIndex(None, dim=16, kind="flat")
    with pytest.raises(DataError, match="already in the index"):
        idx.add_blocks(x, labels, bad, rows=128)
    assert len(idx) == 256 and idx.ids[-1] == "item0255"
    idx.add(x[256:300], labels[256:300], ids[256:300])  # and the index keeps working
    assert len(idx) == 300


def test_memory_mapped_index_searches_like_the_loaded_one_and_reads_only_candidates(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3000, 16)).astype(np.float32) * 3  # not unit: cosine needs the norms
    idx = EmbeddingIndex(x, kind="ivf_pq", nlist=16, pq_m=4, target_recall=0.8)
    idx.save(tmp_path / "idx")
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    mapped = EmbeddingIndex.load(tmp_path / "idx", mmap=True)
    assert isinstance(mapped.embeddings, np.memmap) and not isinstance(loaded.embeddings, np.memmap)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    a, b = loaded.search(q, 5), mapped.search(q, 5)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.scores, b.scores)
    norms = mapped._inverse_norms()
    computed = ~np.isnan(norms.value)
    assert 0 < computed.sum() <= 7 * 5 * mapped.params["rerank"]  # the candidates' rows only
    np.testing.assert_allclose(norms.value[computed], 1 / np.linalg.norm(x[computed], axis=1), rtol=1e-6)


def test_hnsw_tuning_never_tries_an_exhaustive_ef_on_a_large_graph():
    from dmlkit.apps.index_tuning import EF_VALUES, search_settings

    class Fake:
        kind, dim = "hnsw", 8

        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    large = [s["ef_search"] for _, s in search_settings(Fake(1_000_000), 10)]
    assert large == [ef for ef in EF_VALUES if ef >= 11] and max(large) <= EF_VALUES[-1]
    small = [s["ef_search"] for _, s in search_settings(Fake(300), 10)]
    assert small[-1] == 300 and all(ef < 300 for ef in small[:-1])  # ef = N: an exhaustive graph walk
    assert [s["ef_search"] for _, s in search_settings(Fake(1_000_000), 5000)] == [5001]


def test_an_ivf_built_block_by_block_sizes_its_cells_for_every_row(tmp_path):
    """add_blocks trains the IVF on its first block: nlist was 4 sqrt(first block), not
    4 sqrt(N) (140k rows got 1,020 cells instead of 1,494)."""
    from dmlkit.embedding_shards import write_shards

    x, y = _blobs(n=30000, d=8, centres=40)
    shards = write_shards(tmp_path / "s", x, y, shard_rows=28000)
    blocks = EmbeddingIndex(kind="ivf_flat", dim=8, recall_queries=20)
    blocks.add_blocks(shards, rows=28000)  # the first block alone would give 4 sqrt(27980) = 669
    whole = EmbeddingIndex(x, y, kind="ivf_flat", recall_queries=20)
    assert blocks.params["nlist"] == whole.params["nlist"] == 693  # 4 sqrt(30000 - 20)
    assert blocks._planned_rows == 0  # nothing left planned after the blocks


def test_damaged_index_files_are_one_data_error(tmp_path):
    """A truncated vectors.npy or index.json, or garbage in faiss.index, is one DataError naming
    the index (numpy's ValueError, json's JSONDecodeError and faiss's RuntimeError escaped as
    tracebacks from `query` and `index --add`)."""
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.exceptions import DataError

    x = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32)
    for kind, damage in [("flat", "vectors.npy"), ("flat", "index.json"), ("hnsw", "faiss.index")]:
        if kind == "hnsw":
            pytest.importorskip("faiss")
        path = tmp_path / f"{kind}-{damage}"
        EmbeddingIndex(x, kind=kind).save(path)
        f = path / damage
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        for mmap in (False, True):
            with pytest.raises(DataError, match="damaged index.*rebuild it"):
                EmbeddingIndex.load(path, mmap=mmap)


def test_an_index_that_cannot_be_written_leaves_nothing_behind(tmp_path, monkeypatch):
    """A full disk while writing the directory: one DataError, no `.NAME.tmp-PID/` left (it was)."""
    import errno

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.exceptions import DataError

    idx = EmbeddingIndex(np.eye(4, dtype=np.float32))
    real_save = np.save

    def full(file, arr, **kwargs):
        if str(file).endswith("ids.npy"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(file, arr, **kwargs)

    monkeypatch.setattr(np, "save", full)
    with pytest.raises(DataError, match="space"):
        idx.save(tmp_path / "idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_recall_counts_a_duplicate_of_the_kth_neighbour_as_found():
    """Every vector indexed twice: the exact list keeps the first row of a tie (the smaller), an
    exhaustive IVF-Flat or a wide HNSW search may return the other copy, just as close. Counted
    by id, exhaustive IVF-Flat measured recall@5 0.878 and HNSW 0.848 (and a tuner would pay for
    more probes in vain); counted by closeness, as ANN-Benchmarks does, both are 1.0. A row that
    is not as close stays a miss."""
    from dmlkit.apps.index_tuning import _setup, as_close_as_kth, recall_at_k

    rng = np.random.default_rng(0)
    x = np.repeat(rng.standard_normal((600, 16)).astype(np.float32), 2, axis=0)
    q = rng.standard_normal((100, 16)).astype(np.float32)
    graph = EmbeddingIndex(x, kind="hnsw", ef_search=512, seed=0)  # a graph search: near, not exact
    assert graph.measure_recall(k=5, queries=q)["recall"] >= 0.98
    idx = EmbeddingIndex(x, kind="ivf_flat", nlist=8, nprobe=8, seed=0)  # every cell: exact
    assert idx.measure_recall(k=5, queries=q)["recall"] == 1.0
    qq, exact, rows, k, _ = _setup(idx, 5, q, 100)
    twin = exact.copy()
    twin[:, -1] ^= 1  # the other copy of each 5th neighbour (rows 2i and 2i + 1 are equal)
    assert recall_at_k(twin, exact, k) == pytest.approx(0.8)  # by id alone
    assert recall_at_k(twin, exact, k, as_close_as_kth(idx, qq, twin, exact, k)) == 1.0
    far = exact.copy()
    far[:, -1] = [next(r for r in range(len(x)) if r // 2 not in set(e // 2)) for e in exact]
    assert recall_at_k(far, exact, k, as_close_as_kth(idx, qq, far, exact, k)) == pytest.approx(0.8)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf_pq"])
def test_edited_index_files_that_would_answer_wrongly_are_refused(tmp_path, kind, run_cli):
    """Duplicate ids (query --id found another item's row), keys out of order (a search read
    past the vectors: IndexError), a NaN vector (never returned by flat, first by HNSW) and a
    truncated .npz (zipfile's BadZipFile) each load as one DataError, not as a wrong answer."""
    x, _ = _blobs(n=400, d=8, centres=8)
    ids = np.array([f"img{i}.png" for i in range(400)])
    EmbeddingIndex(x, ids=ids, kind=kind, recall_queries=20).save(tmp_path / "idx")

    def edited(name, change):
        import shutil

        copy = tmp_path / f"{name}-copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tmp_path / "idx", copy)
        values = np.load(copy / f"{name}.npy")
        np.save(copy / f"{name}.npy", change(values.copy()))
        return copy

    def duplicate(v):
        v[1] = v[0]
        return v

    def nan_row(v):
        v[3] = np.nan
        return v

    for name, change, message in [("ids", duplicate, "name more than one item"),
                                  ("keys", lambda v: v[::-1].copy(), "keys are not increasing"),
                                  ("vectors", nan_row, "vector 3 .*'img3.png'.* not finite")]:
        with pytest.raises(DataError, match=message):
            EmbeddingIndex.load(edited(name, change))
    if kind == "flat":  # memory-mapped: the rows a search reads are checked
        with pytest.raises(DataError, match="stored vector 3 .* not finite"):
            EmbeddingIndex.load(edited("vectors", nan_row), mmap=True).search(x[:2], 5)
    EmbeddingIndex(x, ids=ids, kind=kind, recall_queries=20).save(tmp_path / "idx.npz")
    data = (tmp_path / "idx.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) * 2 // 3])
    code, _, err = run_cli(["query", str(tmp_path / "cut.npz"), "--id", "img0.png"])
    assert code == 2 and "damaged index" in err and "Traceback" not in err, err


def test_ivf_pq_euclidean_ranks_near_duplicates_by_their_distance():
    """The re-ranking's sqrt(2 - 2 cos) in float32 put distances below ~1e-2 in steps of 3.5e-4:
    an identical row scored 3.5e-4 and rows 1e-4 apart came in either order."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(300, 16)).astype(np.float32)
    q = base[0] / np.linalg.norm(base[0])
    u = rng.normal(size=(8, 16))
    u -= np.outer(u @ q, q)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    near = (q + np.arange(8, 0, -1)[:, None] * 1e-4 * u).astype(np.float32)  # row 7 closest
    x = np.concatenate([near, base[1:]])
    idx = EmbeddingIndex(x, distance="euclidean", kind="ivf_pq", nprobe=10**6, rerank=64,
                         recall_queries=20)
    found = idx.search(base[:1], 9)
    assert found.indices[0, :8].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    near64, q64 = x[:8].astype(np.float64), base[0].astype(np.float64)
    true = np.linalg.norm(near64 / np.linalg.norm(near64, axis=1, keepdims=True)
                          - q64 / np.linalg.norm(q64), axis=1)
    np.testing.assert_allclose(found.scores[0, :8], true[::-1], rtol=1e-4)


@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
def test_flat_index_breaks_exact_ties_of_integer_embeddings_by_row(distance):
    """The float64 scores came from rows normalised in float64 and summed by numpy: integer
    embeddings whose cosines tie exactly in the metrics' float64 closeness came out an ulp
    apart (index and metrics disagreed on 4 of 40 queries). Now the same closeness as
    dmlkit.metrics settles ties with, ties by row."""
    import torch

    from dmlkit.validation import normalize_rows

    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, size=(300, 8)).astype(np.float32)
    x[~x.any(1)] = 1
    xn = torch.from_numpy(normalize_rows(x)).double()
    found = EmbeddingIndex(x, distance=distance).search(x[:40], 5).indices
    ties = 0
    for i in range(40):  # the float64 sum of the float32 rows' products, row by row
        s = (-(xn - xn[i]).pow(2).sum(1) if distance == "euclidean" else (xn * xn[i]).sum(1)).numpy()
        want = np.lexsort((np.arange(300), -s))[:5]
        ties += len(np.unique(s[want])) < 5
        assert found[i].tolist() == want.tolist()
    assert ties > 5  # the data do tie exactly
