"""Query rows that also sit in a separate reference set retrieve their own copy first, at
distance 0: a silent inflation of every retrieval metric unless it is said. The whole-set case
(reference = query) has its own warning (tests/test_workflow_newuser.py); these are the partial
ones - a gallery that was built from query and gallery images together, say."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dmlkit.embeddings import save_embeddings
from dmlkit.metrics import evaluate
from dmlkit.metrics._validation import row_hashes, shared_rows_warning
from dmlkit.metrics.streaming import evaluate_streaming


def _data(n: int = 300, d: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, 10, size=n)


def test_row_hashes_are_equal_exactly_for_identical_rows():
    x, _ = _data(5000, 33)
    x[4000:] = x[:1000]  # 1,000 exact copies
    x[10, 3] = np.nextafter(x[10, 3], np.float32(np.inf))  # one bit away from its copy at 4010
    h = row_hashes(torch.from_numpy(x), rows=700)  # blocks of 700 rows: the same hash per row
    assert h.dtype == torch.int64 and h.shape == (5000,)
    same = (h[4000:] == h[:1000]).numpy()
    assert same.sum() == 999 and not same[10]
    assert torch.unique(h[:4000]).numel() == 4000  # no collision among the distinct rows
    np.testing.assert_array_equal(row_hashes(torch.from_numpy(x[:1000])), h[:1000])
    assert row_hashes(torch.empty(0, 4)).shape == (0,)


def test_evaluate_warns_when_some_query_rows_are_in_the_reference_set():
    x, y = _data()
    q, ql = x[:100], y[:100]
    r, rl = x[60:], y[60:]  # 40 of the 100 queries are also references
    with pytest.warns(UserWarning, match=r"^40 of the 100 query embeddings also appear, identical, in the "
                                         r"reference set"):
        inflated = evaluate(q, ql, r, rl, metrics=["precision_at_1"])["precision_at_1"]
    assert inflated > evaluate(q, ql, x[100:], y[100:], metrics=["precision_at_1"])["precision_at_1"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disjoint sets, and a self-search: no warning
        evaluate(q, ql, x[100:], y[100:], metrics=["precision_at_1"])
        evaluate(x, y, metrics=["precision_at_1"])
    assert shared_rows_warning(row_hashes(torch.from_numpy(q)), row_hashes(torch.from_numpy(x[100:]))) is None


def test_streaming_evaluation_warns_alike(tmp_path):
    x, y = _data()
    np.save(tmp_path / "r.npy", x[60:])
    r = np.load(tmp_path / "r.npy", mmap_mode="r")
    with pytest.warns(UserWarning, match="^40 of the 100 query embeddings also appear"):
        evaluate_streaming(x[:100], y[:100], r, y[60:], metrics=["precision_at_1"], block_rows=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate_streaming(x[:100], y[:100], x[100:], y[100:], metrics=["precision_at_1"], block_rows=16)


def test_cli_prints_the_shared_rows_warning_as_one_line(run_cli, tmp_path):
    x, y = _data()
    save_embeddings(tmp_path / "q.npz", x[:100], y[:100])
    save_embeddings(tmp_path / "r.npz", x[90:], y[90:])
    code, out, err = run_cli(["evaluate", str(tmp_path / "q.npz"), "-r", str(tmp_path / "r.npz"),
                              "-m", "precision_at_1", "--json"])
    assert code == 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith("warning: 10 of the 100 query embeddings also appear")
