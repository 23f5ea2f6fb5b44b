"""``dmlkit verify``'s distances and pair count (audit s40_apps, F3 and F4).

F3: ``verify --distance euclidean`` is the Euclidean distance of L2-normalised embeddings (the
library's default, as ``dmlkit evaluate``, the index and ``serve`` use it), so it gave cosine's
accuracy, AUC and EER, while ``fewshot --distance euclidean`` and ``reid --metric euclidean``
compare raw embeddings, and neither the docs nor ``--help`` said so. ``euclidean`` keeps its
meaning (a saved threshold of it stays valid) and says so; ``raw-euclidean`` (and ``raw-dot``)
compare the embeddings as they are, and a result records that name, which ``dmlkit serve
--verification`` scores pairs with.
F4: ``verify --pairs 41`` silently scored 40 pairs.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from dmlkit.apps.verification import make_pairs, pair_scores, verify
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError


def _scaled_classes(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """8 classes told apart by their norm only: one direction (with a little noise) times a class
    scale, so raw Euclidean separates them and a comparison of directions (cosine) does not."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(8), 12)
    d = np.ones((len(y), 6)) + 0.05 * rng.normal(size=(len(y), 6))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return (d * (1.0 + 1.5 * y)[:, None]).astype(np.float32), y


def test_raw_euclidean_scores_the_raw_distance_and_euclidean_the_normalised_one():
    x, y = _scaled_classes()
    i, j, same = make_pairs(y, 400, seed=3)
    raw = -np.sqrt(((x[i].astype(np.float64) - x[j]) ** 2).sum(1))  # the oracle, in float64
    xn = x / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    unit = -np.sqrt(((xn[i] - xn[j]) ** 2).sum(1))
    np.testing.assert_allclose(pair_scores(x, i, j, "raw-euclidean"), raw, rtol=1e-5)
    np.testing.assert_allclose(pair_scores(x, i, j, "euclidean"), unit, atol=1e-5)  # as saved thresholds mean
    np.testing.assert_allclose(pair_scores(x, i, j, "raw-dot"), (x[i].astype(np.float64) * x[j]).sum(1), atol=1e-4)

    results = {d: verify(x, y, num_pairs=400, seed=3, distance=d) for d in ("cosine", "euclidean", "raw-euclidean")}
    assert results["raw-euclidean"].roc_auc == pytest.approx(roc_auc_score(same, raw), abs=1e-12)
    assert results["raw-euclidean"].roc_auc > 0.9 > results["cosine"].roc_auc + 0.2
    # euclidean of unit rows ranks as cosine: the same accuracy, AUC and EER (another threshold
    # scale), on rows whose directions differ (these near-collinear ones leave near ties to rounding)
    rng = np.random.default_rng(1)
    spread = (rng.normal(size=(96, 6)) + np.repeat(rng.normal(size=(8, 6)), 12, axis=0)).astype(np.float32)
    by = {d: verify(spread, y, num_pairs=400, seed=3, distance=d) for d in ("cosine", "euclidean", "raw-euclidean")}
    for key in ("accuracy", "roc_auc", "eer"):
        assert getattr(by["euclidean"], key) == pytest.approx(getattr(by["cosine"], key), abs=1e-12)
    assert by["raw-euclidean"].roc_auc != pytest.approx(by["cosine"].roc_auc, abs=1e-3)
    assert results["raw-euclidean"].distance == "raw-euclidean"
    assert verify(x, y, num_pairs=40, seed=3, distance="RAW_Euclidean").distance == "raw-euclidean"
    assert verify(x, y, num_pairs=40, seed=3, distance="lp").distance == "euclidean"  # one name, one record
    assert results["euclidean"].distance == "euclidean"
    from dmlkit.apps.verification import VERIFY_DISTANCES

    assert set(VERIFY_DISTANCES) >= {"cosine", "euclidean", "dot", "snr", "raw-euclidean", "raw-dot"}


def test_the_cli_records_the_raw_distance_and_says_what_euclidean_is(tmp_path, run_cli):
    x, y = _scaled_classes()
    save_embeddings(tmp_path / "e.npz", x, y)
    code, out, err = run_cli(["verify", str(tmp_path / "e.npz"), "--pairs", "400", "--seed", "3",
                              "--distance", "raw-euclidean", "--json"])
    assert code == 0, err
    result = json.loads(out)
    i, j, same = make_pairs(y, 400, seed=3)
    raw = -np.sqrt(((x[i].astype(np.float64) - x[j]) ** 2).sum(1))
    assert result["distance"] == "raw-euclidean"
    assert result["roc_auc"] == pytest.approx(roc_auc_score(same, raw), abs=1e-12)
    code, out, err = run_cli(["verify", str(tmp_path / "e.npz"), "--distance", "manhattan"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "raw-euclidean" in err
    code, out, _ = run_cli(["verify", "--help"])
    assert code == 0 and "L2-normalised" in " ".join(out.split()) and "raw-euclidean" in out


class _MeanColour:
    """A stand-in model: an image's raw mean colour (its brightness is in the norm)."""

    mode = "RGB"
    reference_size = (8, 8)

    def __call__(self, images):
        return np.stack([np.asarray(im.convert("RGB"), np.float32).reshape(-1, 3).mean(0) for im in images])


def _verify_client(tmp_path, index_normalize: bool = True, **config):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.service import ServiceConfig, create_app

    idx = EmbeddingIndex(np.eye(3, dtype=np.float32), ids=["a", "b", "c"], distance="euclidean",
                         normalize=index_normalize)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the start-up model check has no files to compare here
        return TestClient(create_app(ServiceConfig(index="unused", **config), index=idx, embedder=_MeanColour()))


def _two_uploads(tmp_path):
    from PIL import Image

    files = {}
    for name, colour in (("image1", (200, 30, 30)), ("image2", (100, 15, 15))):  # one direction, two norms
        path = tmp_path / f"{name}.png"
        Image.new("RGB", (8, 8), colour).save(path)
        files[name] = (path.name, path.read_bytes(), "image/png")
    return files


@pytest.mark.parametrize("normalize, distance", [(False, "raw-euclidean"), (True, "euclidean")])
def test_serve_threshold_alone_scores_pairs_as_the_index_compares_them(tmp_path, normalize, distance):
    """``--threshold T`` without a verification file takes the index's distance: an index of raw
    embeddings scored the pair on normalised rows (score 0 for this pair, "same")."""
    client = _verify_client(tmp_path, index_normalize=normalize, threshold=-50.0)
    r = client.post("/api/verify", files=_two_uploads(tmp_path))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["distance"] == distance
    want = -np.linalg.norm([100, 15, 15]) if not normalize else 0.0
    assert body["score"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert body["same"] is (normalize is True)


def test_serve_judges_a_raw_euclidean_threshold_on_the_raw_distance(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"threshold": -50.0, "distance": "raw-euclidean"}))
    client = _verify_client(tmp_path, verification=tmp_path / "v.json")
    r = client.post("/api/verify", files=_two_uploads(tmp_path))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["distance"] == "raw-euclidean"
    assert body["score"] == pytest.approx(-np.linalg.norm([100, 15, 15]), rel=1e-5)  # cosine: identical
    assert body["same"] is False


@pytest.mark.parametrize("pairs", [41, 3])
def test_an_odd_number_of_pairs_is_refused(tmp_path, run_cli, pairs):
    x, y = _scaled_classes()
    with pytest.raises(ConfigError, match=f"must be even.*got {pairs}: use {pairs - 1} or {pairs + 1}"):
        make_pairs(y, pairs)
    save_embeddings(tmp_path / "e.npz", x, y)
    code, out, err = run_cli(["verify", str(tmp_path / "e.npz"), "--pairs", str(pairs), "--folds", "2"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "must be even" in err
    assert verify(x, y, num_pairs=pairs + 1, folds=2).num_pairs == pairs + 1
