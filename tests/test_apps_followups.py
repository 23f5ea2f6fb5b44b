"""Follow-ups in the applications: IVF-PQ's stored recall, re-id API argument errors, export statuses."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dmlkit.apps import EmbeddingIndex
from dmlkit.apps.index_tuning import recall_at_k, recall_sample
from test_index import _blobs

faiss = pytest.importorskip("faiss")
pytestmark = pytest.mark.usefixtures("one_faiss_thread")


def _without(index: EmbeddingIndex, item: str) -> EmbeddingIndex:
    """A copy of ``index`` (same trained quantiser and codes) without the item ``item``."""
    out = copy.copy(index)
    out.__dict__ = dict(index.__dict__)
    out._faiss_index = faiss.clone_index(index._faiss_index)
    out.remove([item])
    return out


def test_ivf_pq_stored_recall_is_what_an_outside_query_gets():
    """The stored recall of held-in queries equals the recall of the public search of each query
    on the index without its own row (an outside query: ``rerank * k`` candidates), with coarse
    codes where searching ``rerank * (k + 1)`` candidates finds more."""
    x, _ = _blobs(n=2000)
    k, rerank = 1, 4  # 4 candidates per outside query; the old count searched 8
    idx = EmbeddingIndex(x, kind="ivf_pq", nlist=8, nprobe=8, pq_m=8, rerank=rerank, recall_k=k,
                         recall_queries=100, seed=0)
    rows = recall_sample(idx, 100, idx.params["seed"])
    assert idx.recall["held_out"] and idx.recall["num_queries"] == rows.size
    exact, _ = idx._exact(x[rows], k + 1)
    exact = np.array([[j for j in e if j != r][:k] for e, r in zip(exact, rows)])
    outside = np.array([[int(i) for i in _without(idx, idx.ids[r]).search(x[r], k).ids[0]] for r in rows])
    assert idx.recall["recall"] == pytest.approx(recall_at_k(outside, exact, k))
    # the data shows the difference: rerank * (k + 1) candidates (the old count) find more
    generous, _ = idx._ann(x[rows], k + 1, idx._setting())
    generous = np.array([[j for j in g if j != r][:k] for g, r in zip(generous, rows)])
    assert recall_at_k(generous, exact, k) > idx.recall["recall"] + 0.1


# -- re-id: malformed rerank= and junk_ids= are one ConfigError line ---------------------------
def _reid_data():
    rng = np.random.default_rng(0)
    q, g = rng.normal(size=(6, 8)).astype(np.float32), rng.normal(size=(20, 8)).astype(np.float32)
    return q, g, np.arange(6) % 3, np.arange(20) % 4


@pytest.mark.parametrize(("rerank", "says"), [
    ({"k1": "20"}, r"rerank\['k1'\] must be a positive integer, got '20'"),
    ({"k": 20}, r"rerank got unknown key\(s\) 'k': it accepts k1, k2, lambda_value"),
    ({"k2": 2.5}, r"rerank\['k2'\] must be a positive integer, got 2.5"),
    ({"lambda_value": "0.3"}, r"rerank\['lambda_value'\] must be a number in \[0, 1\], got '0.3'"),
    ("yes", r"rerank must be True, False, None or a dict of k1, k2, lambda_value, got 'yes'"),
])
def test_reid_malformed_rerank_is_a_config_error(rerank, says):
    from dmlkit.apps.reid import evaluate_reid
    from dmlkit.exceptions import ConfigError

    with pytest.raises(ConfigError, match=says) as err:
        evaluate_reid(*_reid_data(), rerank=rerank)
    assert "\n" not in str(err.value)


def test_reid_rerank_settings_of_the_right_types_still_rank():
    from dmlkit.apps.reid import evaluate_reid, k_reciprocal_blocks
    from dmlkit.exceptions import ConfigError

    data = _reid_data()
    plain = evaluate_reid(*data, rerank={"k1": np.int64(5), "k2": 2, "lambda_value": 1})
    assert plain.mAP == pytest.approx(evaluate_reid(*data, rerank=False).mAP)  # lambda 1: d' only
    assert evaluate_reid(*data, rerank={}).mAP == plain.mAP  # an empty dict re-ranks nothing
    with pytest.raises(ConfigError, match="k1 must be a positive integer, got '5'"):
        next(k_reciprocal_blocks(data[0], data[1], k1="5"))


@pytest.mark.parametrize("junk", [5, "-1", (1.5,), None])
def test_reid_junk_ids_that_are_no_sequence_of_ids_are_a_config_error(junk):
    from dmlkit.apps.reid import evaluate_reid, evaluate_reid_scores, ranked_examples
    from dmlkit.exceptions import ConfigError

    q, g, qi, gi = _reid_data()
    says = r"junk_ids must be a sequence of integer ids such as \(-1,\), or \(\) for none, got "
    with pytest.raises(ConfigError, match=says):
        evaluate_reid(q, g, qi, gi, junk_ids=junk)
    with pytest.raises(ConfigError, match=says):
        evaluate_reid_scores(np.zeros((6, 20)), qi, gi, junk_ids=junk)
    with pytest.raises(ConfigError, match=says):
        ranked_examples(q, g, qi, gi, queries=[0], junk_ids=junk)
    assert evaluate_reid(q, g, qi, gi, junk_ids=np.array([3])).num_queries == 6


# -- export/service: the image's fault is a 4xx before the model runs, the model's a logged 500 -------
class _Switch:
    """A SmallCNN forward that records the inputs it sees (shape, any non-zero) and fails (as a runtime out of
    memory would) while ``fail`` is set."""

    def __init__(self):
        import torch

        from dmlkit.apps.export import _torch_forward
        from dmlkit.models.trunks import SmallCNN

        torch.manual_seed(0)
        self.inner = _torch_forward(SmallCNN(in_channels=1).eval(), "cpu")
        self.fail, self.seen = False, []

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.seen.append((x.shape, bool(x.any())))  # blank probes hold zeros only
        if self.fail:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (/srv/secret/weights.pt)")
        return self.inner(x)


def _service(embedder):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    idx = EmbeddingIndex(np.random.default_rng(0).normal(size=(10, 128)).astype(np.float32))
    return TestClient(create_app(ServiceConfig(index="unused", threshold=0.5), index=idx, embedder=embedder),
                      raise_server_exceptions=False)


def test_a_model_failure_is_a_logged_500_and_a_bad_image_a_422_before_the_model_runs(caplog):
    from dmlkit.apps.export import ImageEmbedder
    from dmlkit.exceptions import DataError
    from test_service_index_audit import _png

    forward = _Switch()
    client = _service(ImageEmbedder(forward, None, None, 1, "torch"))
    assert client.post("/api/query/image", files={"file": ("a.png", _png(32))}).status_code == 200
    forward.fail = True
    with caplog.at_level("ERROR", logger="dmlkit.service"):
        response = client.post("/api/query/image", files={"file": ("a.png", _png(32))})
        verify = client.post("/api/verify", files={"image1": ("a.png", _png(32)), "image2": ("b.png", _png(32))})
    for r in (response, verify):
        assert r.status_code == 500, r.text
        assert "server error" in r.json()["detail"]
        assert "memory" not in r.text and "secret" not in r.text  # nothing internal leaks
    logged = [r.getMessage() for r in caplog.records if r.name == "dmlkit.service"]
    assert len(logged) == 2 and all("CUDA out of memory" in m for m in logged)  # the cause, on the server
    assert logged[0].startswith("POST /api/query/image") and logged[1].startswith("POST /api/verify")
    assert client.get("/api/metrics").json()["status"].get("5xx") == 2
    # an image too small for the CNN's pooling is still the client's 422, found before the model runs
    forward.fail = False
    forward.seen.clear()
    tiny = client.post("/api/query/image", files={"file": ("a.png", _png(4))})
    assert tiny.status_code == 422 and "smallest input side is" in tiny.json()["detail"], tiny.text
    assert not any(image for _, image in forward.seen)  # the model never saw the image (blank probes at most)
    # the Python API: the model's failure is no DataError (the image's fault) but EmbedderFailure
    from PIL import Image

    from dmlkit.apps.export import EmbedderFailure

    forward.fail = True
    embedder = ImageEmbedder(forward, None, 32, 1, "torch")
    with pytest.raises(EmbedderFailure, match="out of memory") as err:
        embedder([Image.new("L", (32, 32))])
    assert not isinstance(err.value, DataError)


def test_a_fixed_size_model_refuses_another_size_without_running():
    from PIL import Image

    from dmlkit.apps.export import ImageEmbedder
    from dmlkit.exceptions import DataError

    forward = _Switch()
    embedder = ImageEmbedder(forward, None, None, 1, "onnxruntime", input_shape=(1, 32, 32))
    with pytest.raises(DataError, match=r"preprocessed to 1x40x40 .*: it takes 1x32x32"):
        embedder([Image.new("L", (40, 40))])
    assert forward.seen == []
    assert embedder([Image.new("L", (32, 32))]).shape == (1, 128)


def test_a_model_that_fails_at_start_up_is_one_config_error():
    from dmlkit.apps.export import ImageEmbedder
    from dmlkit.exceptions import ConfigError

    forward = _Switch()
    forward.fail = True
    with pytest.raises(ConfigError, match="cannot embed a blank image at start-up: .*out of memory"):
        _service(ImageEmbedder(forward, None, 32, 1, "torch"))
