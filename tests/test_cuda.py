"""The CUDA paths agree with the CPU paths: every loss (value, gradient, bfloat16 autocast; the
blocked ones in the GPU's larger blocks),
the kNN, every retrieval metric (``map`` included) through the API and ``dmlkit evaluate
--device cuda``, a channels-last convolutional model, and a training run on the GPU whose
checkpoint embeds identically on the CPU.

These tests need a CUDA device and skip without one (CI has none); run them on a GPU machine
with ``pytest tests/test_cuda.py``. The CPU paths they compare against are tested everywhere.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dmlkit.metrics import evaluate, knn
from test_losses_trust import LABELS, NAMES, embeddings, make, value_and_grad
from test_metrics import clustered_with_ties
from test_near_ties import METRICS, _brute, _check, _near_duplicates
from test_preflight import make_folder, user_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: run on a GPU machine (pytest tests/test_cuda.py)")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_float32_products():
    """TF32 would round matrix-product inputs to 10 mantissa bits: the comparisons below are of
    float32 arithmetic on both devices (the metrics set full float32 themselves; the losses
    follow the user's setting)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("name", NAMES)
def test_loss_on_cuda_equals_cpu(name):
    labels = torch.tensor(LABELS["several"])
    x = embeddings(len(labels), 1.0)
    ref_value, ref_grad = value_and_grad(make(name), x, labels)
    value, grad = (t.cpu() for t in value_and_grad(make(name).to(CUDA), x.to(CUDA), labels.to(CUDA)))
    torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-5, msg=name)
    tol = 1e-4 * float(ref_grad.abs().max()) + 1e-7
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=tol, msg=name)


@pytest.mark.parametrize("name", ["angular", "triplet"])
def test_blocked_loss_on_cuda_in_one_block_equals_the_cpus_blocks(name):
    """At B = 2048 the CPU splits angular's 12.6M (pair, negative) entries into 4 checkpointed
    blocks; a GPU takes them in one (:func:`dmlkit.losses._pairs.block_elements`)."""
    from dmlkit.losses import get_loss
    from dmlkit.losses._pairs import CPU_BLOCK_ELEMENTS, block_elements

    assert block_elements(CUDA) > CPU_BLOCK_ELEMENTS
    labels = torch.arange(2048) // 4
    x = embeddings(len(labels), 1.0)
    ref_value, ref_grad = value_and_grad(get_loss(name), x, labels)
    value, grad = (t.cpu() for t in value_and_grad(get_loss(name).to(CUDA), x.to(CUDA), labels.to(CUDA)))
    torch.testing.assert_close(value, ref_value, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-4 * float(ref_grad.abs().max()) + 1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_loss_computes_in_float32_under_cuda_autocast(name):
    labels = torch.tensor(LABELS["several"], device=CUDA)
    x = embeddings(len(labels), 1.0).to(CUDA)
    loss = make(name).to(CUDA)
    expected = loss(x, labels)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = loss(x, labels)
    assert got.dtype == torch.float32, name
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("distance", ["cosine", "euclidean", "dot"])
def test_retrieval_metrics_on_cuda_equal_cpu(distance):
    x, y = clustered_with_ties()
    metrics = ["precision_at_1", "recall_at_k", "r_precision", "map_at_r", "map"]
    cpu = evaluate(x, y, metrics=metrics, distance=distance, k_values=(1, 5, 10))
    gpu = evaluate(x.to(CUDA), y.to(CUDA), metrics=metrics, distance=distance, k_values=(1, 5, 10))
    assert cpu.keys() == gpu.keys()
    for key, value in cpu.items():
        if isinstance(value, float):
            assert gpu[key] == pytest.approx(value, abs=1e-12), (distance, key)


def test_query_reference_map_on_cuda_equals_cpu():
    x, y = clustered_with_ties(seed=1)
    q, ql, r, rl = x[:500], y[:500], x[500:], y[500:]
    cpu = evaluate(q, ql, r, rl, metrics=["map", "map_at_r"])
    gpu = evaluate(q.to(CUDA), ql.to(CUDA), r.to(CUDA), rl.to(CUDA), metrics=["map", "map_at_r"])
    assert gpu["map"] == pytest.approx(cpu["map"], abs=1e-12)
    assert gpu["map_at_r"] == pytest.approx(cpu["map_at_r"], abs=1e-12)


def test_shared_rows_warning_on_cuda_equals_cpu():
    """The row hashes of the query-in-reference check are the CPU's on the GPU (int64 wrapping
    sums), so a partly shared reference set warns with the same count."""
    from dmlkit.metrics._validation import row_hashes

    x = torch.randn(300, 24, generator=torch.Generator().manual_seed(0))
    y = torch.arange(300) % 7
    assert torch.equal(row_hashes(x.to(CUDA)).cpu(), row_hashes(x))
    for dev in ("cpu", CUDA):
        with pytest.warns(UserWarning, match="^40 of the 100 query embeddings also appear"):
            evaluate(x[:100].to(dev), y[:100].to(dev), x[60:].to(dev), y[60:].to(dev), metrics=["precision_at_1"])


def test_cli_evaluate_on_cuda_equals_cpu(tmp_path, capsys):
    """``dmlkit evaluate --device cuda``: every kind of metric (k-means on the CPU) and the
    per-class table, as on the CPU."""
    from dmlkit.cli import main
    from dmlkit.embeddings import save_embeddings

    x, y = clustered_with_ties()
    save_embeddings(tmp_path / "e.npz", x.numpy(), y.numpy())
    out = {}
    for device in ("cpu", "cuda"):
        main(["evaluate", str(tmp_path / "e.npz"), "--json", "--device", device, "-m",
              "precision_at_1,r_precision,map_at_r,map,nmi,pos_neg_js",
              "--per-class", str(tmp_path / f"{device}.json")])
        out[device] = json.loads(capsys.readouterr().out)
    for key, value in out["cpu"].items():
        assert out["cuda"][key] == pytest.approx(value, abs=1e-12), key
    per_class = [json.loads((tmp_path / f"{d}.json").read_text()) for d in ("cpu", "cuda")]
    assert per_class[0].keys() == per_class[1].keys()
    for c, row in per_class[0].items():
        for key, value in row.items():
            assert per_class[1][c][key] == pytest.approx(value, abs=1e-12), (c, key)


def test_normalize_rows_on_cuda_equals_cpu():
    """The one normalisation of every evaluation gives the same float32 rows on both devices
    (float64 quotient rounded once), zero, subnormal and huge rows included."""
    from dmlkit.validation import normalize_rows

    g = torch.Generator().manual_seed(4)
    x = torch.randn(20000, 96, generator=g)
    x[0] = 0
    x[1] *= 1e-42
    x[2] *= 1e37
    torch.testing.assert_close(normalize_rows(x.to(CUDA)).cpu(), normalize_rows(x), rtol=0, atol=0)


def test_knn_on_cuda_equals_cpu():
    g = torch.Generator().manual_seed(2)
    x = torch.nn.functional.normalize(torch.randn(2000, 64, generator=g), dim=1)
    cpu = knn(x, None, 20, distance="cosine", backend="torch")
    gpu = knn(x.to(CUDA), None, 20, distance="cosine")
    assert gpu.indices.device.type == "cuda"
    assert torch.equal(gpu.indices.cpu(), cpu.indices)  # no near-ties in random Gaussian data
    torch.testing.assert_close(gpu.values.cpu(), cpu.values, rtol=0, atol=1e-6)


def test_conv_model_on_cuda_is_channels_last_with_the_cpu_outputs():
    """``to_device`` stores a CUDA convolutional model channels-last (faster under cuDNN:
    benchmarks/bench_memory_format.py --device cuda) and it computes what the CPU model does."""
    from dmlkit.models import SmallCNN, to_device

    torch.manual_seed(0)
    reference = SmallCNN(1, bn_neck=True).eval()
    placed = to_device(SmallCNN(1, bn_neck=True).eval(), "cuda")
    placed.load_state_dict(reference.state_dict())
    convs = [m.weight for m in placed.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_cuda and w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert not any(w.is_contiguous() for w in convs[1:])  # (one input channel: either layout)
    x = torch.randn(6, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(placed(x.to(CUDA)).cpu(), reference(x), rtol=1e-4, atol=1e-4)


def test_training_on_cuda_embeds_like_the_cpu(tmp_path):
    from dmlkit.cli import main
    from dmlkit.config import config_from_dict
    from dmlkit.training import train

    root = make_folder(tmp_path / "animals")
    config = user_config(root, sampler={"classes_per_batch": 2, "samples_per_class": 4,
                                        "batches_per_epoch": 4},
                         training={"epochs": 2, "device": "cuda", "eval_batch_size": 64})
    config["data"]["split"] = {"val_fraction": 0.4}
    run = tmp_path / "run"
    result = train(config_from_dict(config), run, progress=False)
    assert result.steps == 8
    metrics = json.loads((run / "metrics.json").read_text())
    assert math.isfinite(metrics["val"]["map_at_r"]) and math.isfinite(metrics["test"]["map_at_r"])
    with np.load(run / "embeddings" / "test.npz") as npz:  # the GPU model's
        on_gpu, labels = npz["embeddings"], npz["labels"]
    out = tmp_path / "cpu.npz"
    main(["embed", str(run), "--device", "cpu", "-o", str(out), "--quiet"])
    with np.load(out) as npz:
        np.testing.assert_array_equal(npz["labels"], labels)
        np.testing.assert_allclose(npz["embeddings"], on_gpu, rtol=0, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_near_ties_on_cuda_follow_the_float64_ranking(seed):
    """Long runs of float32-equal neighbours are settled on the GPU as on the CPU, also when
    the caller allows TF32 products (the metrics multiply in full float32 anyway)."""
    from dmlkit.distances import CosineSimilarity

    x, labels = _near_duplicates(seed)
    want = _brute(x, labels, CosineSimilarity())
    torch.set_float32_matmul_precision("high")
    try:
        got = evaluate(torch.from_numpy(x).to(CUDA), torch.from_numpy(labels).to(CUDA), metrics=METRICS)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    _check(got, want)
