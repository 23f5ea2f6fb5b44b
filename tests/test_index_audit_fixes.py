"""Audit fixes of the index, its recall measurement, its files and its inputs: IVF-PQ's score
of a zero row, zero queries and bad settings of the recall measurement, fsync of a saved
index, the order of exact ties in approximate results, non-integer settings, and float64
input that float32 cannot hold."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex, index_tuning
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError, DataError, NonFiniteError
from dmlkit.validation import check_embeddings

faiss = pytest.importorskip("faiss")


pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def _emb(n: int = 400, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


@pytest.mark.filterwarnings("ignore:nprobe=999 is more than")
@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "hnsw", "ivf_pq"])
def test_a_zero_row_is_at_distance_one_from_every_query_in_every_kind(kind):
    """Normalised Euclidean: a zero row stays zero, |q/|q| - 0| = 1 (IVF-PQ's re-ranking said
    sqrt(2) and ranked it behind every row at less than 90 degrees)."""
    x = _emb()
    x[7] = 0
    q = _emb(3, seed=1)
    settings = {"ivf_flat": {"nprobe": 999}, "hnsw": {"ef_search": 999}, "ivf_pq": {"nprobe": 999, "rerank": 999}}
    idx = EmbeddingIndex(x, distance="euclidean", kind=kind, recall_queries=20, **settings.get(kind, {}))
    res = idx.search(q, 400)
    flat = EmbeddingIndex(x, distance="euclidean").search(q, 400)
    at = res.indices == 7
    np.testing.assert_allclose(res.scores[at], 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.argwhere(at), np.argwhere(flat.indices == 7))



@pytest.mark.parametrize("method", ["measure_recall", "tune"])
def test_the_recall_measurement_refuses_zero_queries_as_search_does(method):
    """All-zero queries on a cosine index measured a perfect, held-out recall (every item as
    close as any other), so tune() kept the cheapest setting as meeting any target."""
    x = _emb(2000, 16)
    idx = EmbeddingIndex(x, kind="ivf_flat", recall_queries=100)
    zeros = np.zeros((50, 16), np.float32)
    with pytest.raises(DataError, match=r"^query row 0 is all zeros \(50 such row\(s\)\): a cosine index"):
        getattr(idx, method)(queries=zeros)
    with pytest.raises(DataError, match=r"^query row 0 is all zeros"):
        idx.search(zeros, 5)
    raw = EmbeddingIndex(x, kind="ivf_flat", distance="dot", normalize=False, recall_queries=100)
    assert raw.measure_recall(queries=zeros)["num_queries"] == 50  # raw dot products: zero is a vector


def test_the_recall_sample_leaves_out_zero_rows_of_a_cosine_index():
    x = _emb(2000, 16)
    x[::3] = 0
    idx = EmbeddingIndex(x, kind="ivf_flat", recall_queries=200)
    rows = index_tuning.recall_sample(idx, 200, 0)
    assert rows.size == 200 and x[rows].any(axis=1).all()
    assert idx.recall["num_queries"] == 200


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"k": 2.5}, r"^recall_k must be a positive integer \(the k of recall@k: --recall-k.*got 2\.5$"),
    ({"k": 0}, r"^recall_k must be a positive integer .*got 0$"),
    ({"k": True}, r"^recall_k must be a positive integer .*got True$"),
    ({"num_queries": 0}, r"^recall_queries must be a positive integer \(queries sampled .*got 0$"),
    ({"num_queries": -5}, r"^recall_queries must be a positive integer .*got -5$"),
])
def test_recall_settings_are_checked_in_one_place(kwargs, message):
    idx = EmbeddingIndex(_emb(600, 8), kind="ivf_flat", recall_queries=50)
    for call in (idx.measure_recall, lambda **kw: idx.tune(0.9, **kw)):
        with pytest.raises(ConfigError, match=message):
            call(**kwargs)
    built = {"recall_k": kwargs["k"]} if "k" in kwargs else {"recall_queries": kwargs["num_queries"]}
    with pytest.raises(ConfigError, match=message):
        EmbeddingIndex(_emb(600, 8), kind="ivf_flat", **built)


@pytest.mark.parametrize(("option", "name"), [("--recall-queries", "recall_queries"), ("--recall-k", "recall_k")])
def test_cli_retune_after_remove_refuses_bad_recall_settings_in_one_line(tmp_path, run_cli, option, name):
    """The --add/--remove path skips the constructor: 0 queries was a ValueError traceback, k 0
    blamed the index size."""
    save_embeddings(tmp_path / "ref.npz", _emb(500, 16), np.arange(500) % 5)
    code, _, err = run_cli(["index", str(tmp_path / "ref.npz"), "-o", str(tmp_path / "ivf"), "--kind", "ivf_flat"])
    assert code == 0, err
    code, out, err = run_cli(["index", "-o", str(tmp_path / "ivf"), "--remove", "1", "--target-recall", "0.9",
                              option, "0"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and f"{name} must be a positive integer" in err


def test_saving_a_directory_flushes_every_file_and_folder_around_the_renames(tmp_path, monkeypatch):
    """Each file and the temporary folder are fsynced before the rename that makes them the
    index, and the parent folder after it (nothing was: a power loss could leave index.json
    beside empty vectors, the old index deleted)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(Path(b).resolve()))),
                                                    real_rename(a, b))[1])
    target = (tmp_path / "idx").resolve()
    idx = EmbeddingIndex(_emb(300, 8), np.arange(300) % 3, kind="ivf_flat", recall_queries=20,
                         metadata=[{"i": i} for i in range(300)])
    for _ in range(2):  # a new index, then one replacing it
        events.clear()
        idx.save(target)
        into_place = events.index(("rename", str(target)))
        flushed = {Path(p).name for kind, p in events[:into_place] if kind == "fsync"}
        written = {p.name for p in target.iterdir()} - {"index.json"} | {".index.json.part"}  # renamed after
        assert len(written) == 8 and written <= flushed
        tmp_flush = [i for i, (kind, p) in enumerate(events) if kind == "fsync" and Path(p).name.startswith(".idx.tmp-")]
        assert tmp_flush and tmp_flush[-1] < into_place
        assert ("fsync", str(tmp_path.resolve())) in events[into_place:]
    assert EmbeddingIndex.load(target).search(_emb(2, 8), 3).indices.shape == (2, 3)


@pytest.mark.filterwarnings("ignore:nprobe=")
@pytest.mark.parametrize(("kind", "settings"), [
    ("ivf_flat", {"nprobe": 10**6}), ("hnsw", {"ef_search": 3000}), ("ivf_pq", {"nprobe": 10**6, "rerank": 1000}),
])
def test_approximate_kinds_order_exact_ties_by_row_as_flat_does(kind, settings):
    """Rows 1000..1099 duplicate rows 0..99: the smaller row first (faiss's order put the later
    copy first for nearly every query, IVF-PQ after its exact re-ranking too)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1000, 16)).astype(np.float32)
    x = np.concatenate([x, x[:100]])
    q = x[:100] + np.float32(0.001) * rng.normal(size=(100, 16)).astype(np.float32)
    flat = EmbeddingIndex(x).search(q, 4)
    res = EmbeddingIndex(x, kind=kind, recall_queries=50, **settings).search(q, 4)
    np.testing.assert_array_equal(res.indices[:, :2], flat.indices[:, :2])
    assert (res.indices[:, 1] - res.indices[:, 0] == 1000).all()


@pytest.mark.parametrize(("settings", "message"), [
    ({"kind": "ivf_flat", "nprobe": 1.7}, r"^nprobe must be a positive integer, got 1\.7$"),
    ({"kind": "hnsw", "hnsw_m": 2.9}, r"^hnsw_m must be a positive integer, got 2\.9$"),
    ({"kind": "ivf_flat", "nlist": 2.5}, r"^nlist must be a positive integer, got 2\.5$"),
    ({"kind": "ivf_pq", "pq_m": 2.0}, r"^pq_m must be a positive integer, got 2\.0$"),
    ({"kind": "hnsw", "ef_search": "abc"}, r"^ef_search must be a positive integer, got 'abc'$"),
    ({"kind": "ivf_pq", "rerank": True}, r"^rerank must be a positive integer, got True$"),
    ({"kind": "hnsw", "target_recall": "high"}, r"^target_recall must be a number in \(0, 1\], got 'high'$"),
    ({"kind": "flat", "target_recall": 0.99}, r"^target_recall does not apply to flat indexes \(exact search"),
])
def test_settings_must_be_whole_numbers_and_apply_to_the_kind(settings, message):
    """nprobe=1.7 was stored and reported while faiss searched 1 cell, hnsw_m=2.9 built M = 2,
    nlist=2.5 / pq_m=2.0 were SWIG TypeErrors, and a flat index ignored its target_recall."""
    with pytest.raises(ConfigError, match=message):
        EmbeddingIndex(_emb(600, 8), recall_queries=20, **settings)


def test_numpy_integer_settings_are_whole_numbers():
    idx = EmbeddingIndex(_emb(600, 8), kind="ivf_pq", pq_m=np.int64(2), nprobe=np.int32(4), recall_queries=20)
    assert idx.params["pq_m"] == 2 and idx.params["nprobe"] == 4 and type(idx.params["nprobe"]) is int


def test_float64_rows_below_float32s_normal_range_are_refused_not_changed():
    """Queries at 1e-43 (float64) became subnormal float32 (other neighbours), at 1e-300 zero
    ("all zeros"); a row whose largest value is normal converts within float32's rounding and
    passes, whatever its tiny entries, and so does a tiny row that float32 holds exactly."""
    x = _emb(200, 8)
    q = np.random.default_rng(1).normal(size=(20, 8))
    idx = EmbeddingIndex(x)
    for scale in (1e-40, 1e-43, 1e-300):
        with pytest.raises(NonFiniteError, match=r"^queries hold 20 float64 row\(s\) below float32's smallest "
                                                 r"normal number \(1\.2e-38\) that float32 cannot hold, first row 0: "):
            idx.search(q * scale, 5)
    assert (idx.search(q * 1e-30, 5).indices == idx.search(q, 5).indices).all()
    mixed = q.copy()
    mixed[:, 1:] = 1e-320  # subnormal entries beside a normal one: within float32's rounding of the row
    mixed[3] = 0.0  # a zero row stays exactly zero (refused by the cosine index as all zeros, not here)
    mixed[4] = [2.0**-133, -(2.0**-140), 0, 0, 0, 0, 0, 0]  # subnormal, but exact in float32
    out = check_embeddings(mixed).numpy()
    assert (out[:, 0] == mixed[:, 0].astype(np.float32)).all() and (out[4] == mixed[4]).all()
    with pytest.raises(NonFiniteError, match=r"\(s\) below .* first row 7:"):
        check_embeddings(np.where(np.arange(20)[:, None] == 7, q * 1e-39, q), "queries")


def test_the_service_says_which_float32_limit_an_embedding_passes():
    """JSON numbers above 3.4e38 were cast to inf here and blamed on NaN ("check the model
    output"); the search's own check now names float32's range, above and below."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    idx = EmbeddingIndex(_emb(20, 4), ids=[f"i{j}" for j in range(20)])
    client = TestClient(create_app(ServiceConfig(index="unused"), index=idx))
    for embedding, words in (([1e39, 0.5, 0.5, 0.5], "beyond float32's range"),
                             ([1e-300, -2e-300, 0.0, 5e-301], "below float32's smallest normal number")):
        r = client.post("/api/query/embedding", json={"embedding": embedding, "k": 3})
        assert r.status_code == 422 and words in r.json()["detail"], r.text
    assert client.post("/api/query/embedding", json={"embedding": [1e-30, 0, 0, 0], "k": 3}).status_code == 200


def test_an_atomic_write_flushes_its_folder_after_the_rename(tmp_path, monkeypatch):
    """The file was flushed and renamed into place, but the folder never: after a power loss the
    new name (a checkpoint's, an index .npz's) could be missing. A folder that cannot be flushed
    (some network file systems) leaves the write standing."""
    from dmlkit.utils import atomic_write_bytes

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    target = tmp_path / "out.bin"
    atomic_write_bytes(target, b"data")
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"] and events[-1][1] == str(tmp_path.resolve())

    def refuse_folders(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(22, "Invalid argument")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", refuse_folders)
    atomic_write_bytes(target, b"more")
    assert target.read_bytes() == b"more"


@pytest.mark.parametrize(("kind", "settings", "named"), [
    ("hnsw", {"nprobe": 16}, "nprobe=16"),
    ("flat", {"hnsw_m": 8, "rerank": 2}, "hnsw_m=8, rerank=2"),
    ("ivf_flat", {"pq_nbits": 4}, "pq_nbits=4"),
    ("hnsw", {"gpu": True}, "gpu=True"),
])
def test_the_api_refuses_settings_the_kind_does_not_use(kind, settings, named):
    """EmbeddingIndex(kind="hnsw", nprobe=16) built a graph and ignored nprobe (the CLI refused
    the same options)."""
    with pytest.raises(ConfigError, match=f"{named} do(es)? not apply to {kind} indexes"):
        EmbeddingIndex(_emb(300, 8), np.arange(300) % 3, kind=kind, **settings)
    # the settings of the kind itself, and defaults passed explicitly, are accepted
    EmbeddingIndex(_emb(300, 8), np.arange(300) % 3, kind="ivf_pq", nprobe=4, rerank=2, pq_nbits=8,
                   hnsw_m=32, recall_queries=20)
