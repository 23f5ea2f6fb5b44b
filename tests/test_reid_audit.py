"""Audit of the re-id application: re-ranking with exactly tied distances, float64 scores,
the VehicleID options of ``dmlkit reid`` and its one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dmlkit.apps.reid import (
    draw_gallery,
    evaluate_reid,
    evaluate_reid_scores,
    k_reciprocal_distances,
    vehicleid_protocol,
)
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError


def authors_rerank(q, g, k1, k2, lam):
    """Zhong et al.'s re_ranking on dense matrices (their code's steps), ties by index."""
    x = np.concatenate([q, g]).astype(np.float64)
    n, n_q = len(x), len(q)
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    d = d / np.where(d.max(1, keepdims=True) > 0, d.max(1, keepdims=True), 1.0)
    rank = np.argsort(d, axis=1, kind="stable")

    def recip(i, k):
        fwd = rank[i, : k + 1]
        return fwd[[i in rank[j, : k + 1] for j in fwd]]

    v = np.zeros((n, n))
    for i in range(n):
        r = recip(i, k1)
        exp = list(r)
        for c in r:
            rc = recip(c, int(np.around(k1 / 2)))
            if len(np.intersect1d(rc, r)) > 2 / 3 * len(rc):
                exp += list(rc)
        idx = np.unique(np.asarray(exp, dtype=np.int64))
        if idx.size:
            w = np.exp(-d[i, idx])
            v[i, idx] = w / w.sum()
    if k2 > 1:
        v = np.stack([v[rank[i, :k2]].mean(0) for i in range(n)])
    m = np.minimum(v[:n_q, None, :], v[None, n_q:, :]).sum(-1)
    return (1 - lam) * (1 - m / (2 - m)) + lam * d[:n_q, n_q:]


def test_rerank_an_item_outside_its_own_neighbours_does_not_crash():
    # 6 identical items, k1 = 1: items 2.. are not among their own 2 nearest (ties by index),
    # so their k-reciprocal sets are empty; the last one's used to crash the encoding
    q = np.ones((1, 2), dtype=np.float32)
    g = np.ones((5, 2), dtype=np.float32)
    got = k_reciprocal_distances(q, g, k1=1, k2=1, lambda_value=0.3)
    np.testing.assert_allclose(got, authors_rerank(q, g, 1, 1, 0.3), atol=1e-6)


def test_rerank_neighbours_tied_at_the_kth_distance_are_taken_by_index():
    # integer features: many exactly tied distances at the k-th neighbour (exact in float32)
    rng = np.random.default_rng(0)
    q = rng.integers(0, 4, (15, 2)).astype(np.float32)
    g = rng.integers(0, 4, (60, 2)).astype(np.float32)
    g[-1] = [9, 9]  # a far last item: its reciprocal set holds itself
    for k1, k2 in [(3, 1), (5, 3)]:
        want = authors_rerank(q, g, k1, k2, 0.3)
        got = k_reciprocal_distances(q, g, k1=k1, k2=k2, lambda_value=0.3, memory_budget=4000)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_float64_scores_are_ranked_in_float64():
    # the positive (index 0) is farther by 1e-9: a negative ranks first, AP = 1/2
    d = np.array([[1.0 + 1e-9, 1.0]])
    assert evaluate_reid_scores(d, [5], [5, 6]).ap[0] == 0.5
    assert evaluate_reid_scores(torch.tensor(d), [5], [5, 6]).ap[0] == 0.5
    big = np.array([[100_000_001, 100_000_000]])  # integers that float32 cannot tell apart
    assert evaluate_reid_scores(big, [5], [5, 6]).first_hit[0] == 1
    assert evaluate_reid_scores(torch.tensor(big), [5], [5, 6]).first_hit[0] == 1
    # float32 input: ranked as given (ties by index)
    assert evaluate_reid_scores(d.astype(np.float32), [5], [5, 6]).ap[0] == 1.0


def _vehicle_file(tmp_path):
    rng = np.random.default_rng(1)
    ids = np.repeat(np.arange(20), 5)
    emb = (rng.normal(size=(20, 6))[ids] + 1.0 * rng.normal(size=(100, 6))).astype(np.float32)
    save_embeddings(tmp_path / "v.npz", emb, ids, groups=np.full(100, "test"))
    return emb, ids


def test_vehicleid_honours_ap_mode(tmp_path, run_cli):
    emb, ids = _vehicle_file(tmp_path)
    res = vehicleid_protocol(emb, ids, repeats=2, seed=3, ap_mode="trapezoid")
    want = []
    for r in range(2):
        gal = draw_gallery(ids, np.random.default_rng([3, r]))
        want.append(evaluate_reid(emb[~gal], emb[gal], ids[~gal], ids[gal],
                                  ap_mode="trapezoid").mAP)
    assert res.map_values == pytest.approx(want)
    standard = vehicleid_protocol(emb, ids, repeats=2, seed=3)
    assert standard.map_values != pytest.approx(want)
    code, out, _ = run_cli(["reid", str(tmp_path / "v.npz"), "--repeats", "2", "--seed", "3",
                        "--ap-mode", "trapezoid", "--json"])
    assert code in (0, None)
    assert json.loads(out)["map"]["values"] == pytest.approx(want)


def test_vehicleid_refuses_rerank_in_one_line(tmp_path, run_cli):
    _vehicle_file(tmp_path)
    code, out, err = run_cli(["reid", str(tmp_path / "v.npz"), "--rerank"])
    assert code == 2 and "--rerank" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_negative_seed_is_one_line_error(tmp_path, run_cli):
    emb, ids = _vehicle_file(tmp_path)
    with pytest.raises(ConfigError, match="seed"):
        vehicleid_protocol(emb, ids, repeats=1, seed=-1)
    groups = np.where(np.arange(100) % 5 == 0, "query", "gallery")
    save_embeddings(tmp_path / "m.npz", emb, ids, groups=groups)
    for name in ("v.npz", "m.npz"):  # VehicleID draws; the example queries of a Market file
        code, _, err = run_cli(["reid", str(tmp_path / name), "--seed", "-1"])
        assert code == 2 and "--seed" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1


def test_vehicleid_has_no_junk_id():
    # VehicleID has no junk: an identity numbered -1 is drawn and queried like any other
    ids = np.array([-1, -1, -1, 4, 4, 7, 7])
    emb = np.array([[0], [1], [2], [10], [11], [20], [21]], dtype=np.float32)
    res = vehicleid_protocol(emb, ids, repeats=3, seed=0, ks=(1,))
    assert res.num_queries == 4 and res.values[1] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(("name", "value"), [("cams", np.array(3)), ("groups", np.array("query")),
                                             ("groups", None)])
def test_row_arrays_that_are_not_1d_are_one_line_errors(tmp_path, run_cli, name, value):
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(6), 4)
    fields = {"cams": np.tile(np.arange(2), 12),
              "groups": np.where(np.arange(24) % 4 == 0, "query", "gallery")}
    fields[name] = np.stack([fields[name]] * 2, 1) if value is None else value  # 0-D or 2-D
    np.savez(tmp_path / "bad.npz", embeddings=rng.normal(size=(24, 4)).astype(np.float32),
             labels=ids, **fields)
    code, out, err = run_cli(["reid", str(tmp_path / "bad.npz")])
    assert code == 2 and name in err and "Traceback" not in err  # was a TypeError / IndexError
    assert out == "" and len(err.strip().splitlines()) == 1
