"""Thread safety and global state (audit s42): HNSW's deferred graph insertion under concurrent
searches, faiss ids the index never issued, the report's random numbers, matplotlib's backend."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dmlkit.apps.index import EmbeddingIndex
from dmlkit.exceptions import DataError

faiss = pytest.importorskip("faiss")


# -- F1: concurrent first searches of an HNSW graph -----------------------------------------------
class _SlowAdd:
    """A faiss index whose ``add_with_ids`` takes 0.3 s: the window in which other threads search."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def add_with_ids(self, x, ids) -> None:
        time.sleep(0.3)
        self.inner.add_with_ids(x, ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_concurrent_first_searches_of_a_fresh_hnsw_graph_equal_serial_searches():
    """4 threads search a graph whose held-out rows the first search inserts: each gets what a
    serial search of the complete graph gets (the reserve was emptied before the insertion, so
    the others searched a graph without those rows: recall@10 0.86-0.93 against 0.997)."""
    x = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
    idx = EmbeddingIndex(dim=16, kind="hnsw", recall_queries=200)
    idx.add(x)
    held = idx._rows_of_keys(idx._graph_reserve)
    assert held.size == 200
    queries = x[held]  # the held-out rows themselves: each is its own nearest item
    idx._faiss_index = _SlowAdd(idx._faiss_index)
    barrier = threading.Barrier(4)
    got: dict[int, object] = {}

    def search(j: int) -> None:
        barrier.wait()
        got[j] = idx.search(queries, 5)

    threads = [threading.Thread(target=search, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    idx._faiss_index = idx._faiss_index.inner
    assert idx._graph_reserve.size == 0 and idx._faiss_index.ntotal == 2000  # inserted once
    serial = idx.search(queries, 5)
    np.testing.assert_array_equal(serial.indices[:, 0], held)
    for j in range(4):
        np.testing.assert_array_equal(got[j].indices, serial.indices)
        np.testing.assert_array_equal(got[j].scores, serial.scores)


# -- security F9: faiss ids that are no keys of the index -------------------------------------------
def test_rows_of_keys_refuses_keys_the_index_never_issued():
    from dmlkit.apps.index_faiss import rows_of_keys

    np.testing.assert_array_equal(rows_of_keys(np.arange(4), np.array([[3, 0, -1]])), [[3, 0, -1]])
    removed = np.array([2, 5, 9])  # after removals: looked up
    np.testing.assert_array_equal(rows_of_keys(removed, np.array([[9, -1, 2, 5]])), [[2, -1, 0, 1]])
    for own, bad in ((np.arange(4), 4), (np.arange(4), -5), (removed, 3), (removed, 10), (removed, -2),
                     (np.empty(0, dtype=np.int64), 0)):
        with pytest.raises(DataError, match=f"returned key {bad}, which is no item's"):
            rows_of_keys(own, np.array([[own[0] if own.size else -1, bad]]))


def _tamper_id_map(directory: Path, value: int) -> None:
    outer = faiss.deserialize_index(np.fromfile(directory / "faiss.index", dtype=np.uint8))
    ids = faiss.vector_to_array(outer.id_map)
    ids[::7] = value
    faiss.copy_array_to_vector(ids, outer.id_map)
    faiss.serialize_index(outer).tofile(directory / "faiss.index")


@pytest.mark.parametrize("value", [10**12, -5, "removed"])
def test_a_faiss_id_map_naming_other_keys_is_one_data_error(tmp_path, run_cli, value):
    x = np.random.default_rng(0).normal(size=(300, 16)).astype(np.float32)
    idx = EmbeddingIndex(x, ids=[f"i{i}" for i in range(300)], kind="hnsw", recall_queries=20)
    if value == "removed":  # keys 0-2 removed: the others are looked up, and 1 is no item's
        idx.remove(["i0", "i1", "i2"])
        value = 1
    idx.save(tmp_path / "idx")
    _tamper_id_map(tmp_path / "idx", value)
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    with pytest.raises(DataError, match=f"returned key {value}, which is no item's"):
        loaded.search(x[:50], 10)
    code, out, err = run_cli(["query", str(tmp_path / "idx"), "--id", "i10", "--id", "i20", "-k", "50"])
    assert code == 2 and "Traceback" not in err and "IndexError" not in err
    assert f"returned key {value}" in err and len(err.strip().splitlines()) == 1


def test_ivf_lists_naming_other_keys_are_one_data_error():
    x = np.random.default_rng(1).normal(size=(400, 8)).astype(np.float32)
    idx = EmbeddingIndex(x, kind="ivf_flat", nlist=4, nprobe=4, recall_queries=20)
    idx._keys = idx._keys + 1000  # the lists hold keys 0-399, which no item has now
    with pytest.raises(DataError, match="which is no item's"):
        idx.search(x[:3], 5)
