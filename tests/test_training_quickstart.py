"""The quickstart's claim, tested: ``configs/quickstart.yaml``'s settings learn a real embedding.

The shipped config is loaded as a user would (``load_config`` with ``--set``-style overrides
that only shorten the run), trained for a few dozen steps on a small real Omniglot slice, and
compared with the untrained network (same seed, same model) on unseen evaluation classes.
It also checks that the trained embedding is not squeezed into a narrow cone (the failure of
the earlier batch-hard setup: all test cosine similarities in [0.995, 1]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dmlkit.metrics import evaluate
from dmlkit.training import build_model, load_config, train
from dmlkit.training.trainer import build_datasets, embed_split
from dmlkit.utils import seed_everything

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
STEPS = 40
SHORT_RUN = [  # only the run length and device change; model, loss, miner, optimiser as shipped
    "training.epochs=1",
    f"sampler.batches_per_epoch={STEPS}",
    "training.device=cpu",
    "training.log_every=10",
]


pytestmark = pytest.mark.usefixtures("one_thread")


def _first_classes(dataset, n: int):
    return dataset.subset_classes(np.unique(np.asarray(dataset.labels))[:n])


def _metrics(emb: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    out = evaluate(emb, labels, metrics=["precision_at_1", "map_at_r"])
    return {k: float(out[k]) for k in ("precision_at_1", "map_at_r")}


def _negative_cosines(emb: np.ndarray, labels: np.ndarray) -> np.ndarray:
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    sim = e @ e.T
    return sim[labels[:, None] != labels[None, :]]


def test_bn_neck_centres_the_pooled_features():
    from dmlkit.models import SmallCNN, build_trunk

    torch.manual_seed(0)
    x = torch.rand(64, 1, 28, 28)
    plain, _ = build_trunk("small_cnn", in_channels=1, widths=(8, 16))
    neck, dim = build_trunk("small_cnn", in_channels=1, widths=(8, 16), bn_neck=True)
    assert isinstance(neck, SmallCNN) and dim == 16
    # default off: the state dict (and old checkpoints) are unchanged
    assert not any(k.startswith("neck.") for k in plain.state_dict())
    assert {"neck.weight", "neck.bias", "neck.running_mean"} <= set(neck.state_dict())
    f_plain, f_neck = plain(x), neck(x)  # training mode: batch statistics
    assert f_plain.min() >= 0 and f_plain.mean(0).abs().min() > 0  # post-ReLU: one-signed
    assert torch.allclose(f_neck.mean(0), torch.zeros(16), atol=1e-5)
    cos = torch.nn.functional.cosine_similarity(f_neck[:32], f_neck[32:])
    assert cos.mean() < 0.5 < torch.nn.functional.cosine_similarity(f_plain[:32], f_plain[32:]).mean()


def test_quickstart_config_uses_triplet_with_a_miner_and_the_bn_neck():
    config = load_config(CONFIG)
    assert config.loss.name == "triplet" and config.miner is not None
    assert config.model.trunk == "small_cnn" and config.model.trunk_options.get("bn_neck") is True
    assert config.model.embedding_size == 64 and not config.model.freeze_batchnorm


@pytest.mark.slow
def test_quickstart_settings_beat_the_untrained_network(tmp_path, data_root):
    config = load_config(CONFIG, [*SHORT_RUN, f"data.root={data_root}"])
    assert config.loss.name == "triplet" and config.miner is not None
    sets = build_datasets(config, ("train", "val", "test"))
    train_set = _first_classes(sets["train"], 200)
    val_set = _first_classes(sets["val"], 20)
    test_set = _first_classes(sets["test"], 100)  # 100 unseen evaluation characters x 20

    seed_everything(config.seed)
    untrained = build_model(config).eval()
    emb0, lab0 = embed_split(untrained, test_set, config, "cpu")
    before = _metrics(emb0, lab0)

    result = train(config, tmp_path / "run", train_set=train_set, val_set=val_set,
                   test_set=test_set, progress=False)
    assert result.steps == STEPS
    after = result.test_metrics
    assert after is not None
    # What the method guarantees, with margin, on any CPU (float rounding differs between AMD
    # EPYC and Intel Xeon with AMX, so a bound beside one machine's value is not a test).
    # Measured on AMD EPYC, seeds 0-4 (benchmarks/quickstart_spread.py runs this body): MAP@R
    # 0.08-0.11 -> 0.30-0.34 (x2.9-4.2), P@1 0.33-0.42 -> 0.70-0.74 (+0.30-0.41). The earlier
    # setup without the BN neck reached only x1.8 (and +0.17): it fails the MAP@R check.
    assert after["map_at_r"] > 2.0 * before["map_at_r"], (before, after)
    assert after["precision_at_1"] > before["precision_at_1"] + 0.15, (before, after)

    test_npz = np.load(tmp_path / "run" / "embeddings" / "test.npz")
    neg = _negative_cosines(test_npz["embeddings"], test_npz["labels"])
    # a spread-out embedding, not a narrow cone: median cosine of different characters
    # measured 0.64-0.76 over seeds 0-4 (the collapsed earlier setup: 0.999, all in [0.998, 1])
    assert np.median(neg) < 0.9, np.percentile(neg, [1, 50, 99])

    # the trained checkpoint also does one-shot classification on the official Omniglot runs;
    # this exercises `dmlkit oneshot`'s image path end to end. Chance is 95 % error. Each run
    # has only 20 test images (per-run errors 10-70 %), so all 20 runs are used: their mean
    # measured 42-47 % over seeds 0-4 here (an Intel Xeon gave 51 % on the first 5 runs alone);
    # 75 % is far below chance and far above that spread.
    from dmlkit.apps import load_omniglot_one_shot_runs, omniglot_one_shot_error
    from dmlkit.apps.fewshot import checkpoint_image_embedder

    runs = load_omniglot_one_shot_runs(data_root)
    assert len(runs) == 20
    one_shot = omniglot_one_shot_error(checkpoint_image_embedder(tmp_path / "run"), runs)
    assert one_shot["error_percent"] < 75, one_shot
