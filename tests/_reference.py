"""Reference building blocks and checks shared by the loss tests.

Pair/triplet losses (``test_losses_pair.py``, ``test_losses_triplet.py``): the label sets,
float64 batches, the distance objects under test, a loop log-sum-exp and a value + gradient
comparison. Classification/proxy losses (``test_losses_classification.py``,
``test_losses_proxy.py``): a loop dot product, the optional peer library, and the checks that
both families must pass (loop reference with parameter gradients, gradcheck, bfloat16, large
scales, API errors and empty batches). Training tests (``test_training.py``,
``test_cli_train.py``): the tiny model, loss and optimiser sections of their configs. SiamFC
training tests (``test_tracking_*.py``): a one-sequence training set and a tiny config. Distributed training tests: a grey image folder and a tiny
config that trains on it.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.func import functional_call

from dmlkit.apps.tracking.datasets import Sequence
from dmlkit.apps.tracking.offline import make_sequence, offline_specs
from dmlkit.apps.tracking.training import SiamFCTrainConfig
from dmlkit.distances import CosineSimilarity, LpDistance
from dmlkit.exceptions import ConfigError, ShapeError

# ------------------------------------------------------------------ pair / triplet losses
LABEL_SETS = {
    "several": [0, 0, 0, 1, 1, 2, 2, 2, 3, 4],  # several classes, two singletons
    "one_class": [5] * 6,
    "singletons": [0, 1, 2, 3, 4, 5],
}


def batch(labels, dim=5, seed=0, dtype=torch.float64):
    """``(len(labels), dim)`` standard-normal embeddings from a seeded generator, and labels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), dim, generator=g, dtype=dtype)
    return x, torch.tensor(labels)


def unit(v):
    """``v / |v|`` for one vector."""
    return v / v.norm()


def make_distance(kind):
    return {
        "euclidean": LpDistance(),
        "sqeuclidean": LpDistance(power=2),
        "cosine": CosineSimilarity(),
    }[kind]


def lse(values):
    """``log sum exp`` of a list of 0-d tensors, shifted by the maximum."""
    m = max(v.item() for v in values)
    return m + torch.log(sum(torch.exp(v - m) for v in values))


def value_and_grad(fn, x, *args, **kwargs):
    """``fn(x)`` (detached) and its gradient in ``x`` (zeros when ``x`` is not used)."""
    x = x.clone().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(out, x, allow_unused=True)
    return out.detach(), (torch.zeros_like(x) if grad is None else grad)


def assert_value_and_grad_match(loss_fn, reference, x):
    """``loss_fn`` and the loop ``reference`` agree in value and gradient at ``x`` (float64)."""
    v1, g1 = value_and_grad(loss_fn, x)
    v2, g2 = value_and_grad(reference, x)
    torch.testing.assert_close(v1, v2.to(v1.dtype), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(g1, g2, rtol=1e-7, atol=1e-9)


def check_bfloat16_is_finite(name, scale, seed):
    """A loss built by name on a bfloat16 batch (64 x 16, 8 classes, times ``scale``) is finite
    with finite gradients and within 5 % (+0.05) of the float32 loss."""
    from dmlkit.losses import get_loss

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 16, generator=g) * scale).bfloat16().requires_grad_(True)
    y = torch.randint(0, 8, (64,), generator=g)
    out = get_loss(name)(x, y)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad.float()).all()
    ref = get_loss(name)(x.detach().float(), y)
    assert abs(out.item() - ref.item()) < 0.05 * (1 + abs(ref.item()))


def backward_value_and_grad(fn, x):
    """``fn(x)`` (detached) and its gradient in ``x``, by ``backward()`` (``x`` must be used)."""
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward()
    return out.detach(), x.grad.detach()


def assert_allclose_value_and_grad(loss_fn, ref_fn, x, atol=1e-9):
    """``torch.allclose`` of value (rtol 1e-7) and gradient (rtol 1e-6) of two functions at
    ``x``; the ranking/FastAP/ProtoNCE tests' tolerance."""
    v, g = backward_value_and_grad(loss_fn, x)
    rv, rg = backward_value_and_grad(ref_fn, x)
    assert torch.allclose(v, rv, atol=atol, rtol=1e-7), (float(v), float(rv))
    assert torch.allclose(g, rg, atol=atol, rtol=1e-6), (g - rg).abs().max()


# ------------------------------------------------------------------ classification / proxy losses
def dot(a, b):
    """Dot product of two vectors as an explicit loop over dimensions."""
    return sum(a[d] * b[d] for d in range(len(a)))


try:
    pml_losses = importlib.import_module("pytorch_metric_learning.losses")
except ImportError:  # the peer library is a benchmark/test extra
    pml_losses = None
needs_pml = pytest.mark.skipif(
    pml_losses is None, reason="pytorch-metric-learning not installed: pip install 'dmlkit[bench]'"
)


def check_matches_loop_reference(loss, x, labels, reference: Callable) -> None:
    """Value, embedding gradient and parameter gradients of ``loss`` equal ``reference(x,
    labels, params)`` (a loop over the same named parameters), in float64."""
    x1 = x.clone().requires_grad_()
    params = {n: p.detach().clone().requires_grad_() for n, p in loss.named_parameters()}
    ours = functional_call(loss, params, (x1, labels))
    ours.backward()
    x2 = x.clone().requires_grad_()
    ref_params = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    ref = reference(x2, labels, ref_params)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-7, atol=1e-9)
    for n in params:
        torch.testing.assert_close(params[n].grad, ref_params[n].grad, rtol=1e-7, atol=1e-9)


def check_gradcheck(loss) -> None:
    """``torch.autograd.gradcheck`` in the embeddings and all parameters (3 classes, D = 3)."""
    labels = torch.tensor([0, 2, 2, 1])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in loss.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in loss.named_parameters()]

    def fn(x, *ps):
        return functional_call(loss, dict(zip(names, ps)), (x, labels))

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-5)


def check_bfloat16_close_to_float32(loss, x, labels) -> None:
    """In bfloat16 the loss is a finite float32 close to the float32 loss, gradients finite."""
    ref = loss(x, labels)
    xb = x.bfloat16().requires_grad_()
    lb = loss.to(torch.bfloat16)
    out = lb(xb, labels)
    out.backward()
    assert out.dtype == torch.float32
    assert torch.isfinite(out) and torch.isfinite(xb.grad.float()).all()
    assert xb.grad.dtype == torch.bfloat16
    assert all(torch.isfinite(p.grad.float()).all() for p in lb.parameters())
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)


def check_finite_with_gradients(loss, x, labels) -> None:
    """Loss, embedding gradient and parameter gradients are all finite (``x`` requires grad)."""
    out = loss(x, labels)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(x.grad.float()).all()
    assert all(torch.isfinite(p.grad.float()).all() for p in loss.parameters())


def check_proxy_loss_errors_and_empty_batch(loss, negative_labels) -> None:
    """For a loss built with 4 classes and D = 8: bad labels/sizes, miner indices and a
    reference set are rejected; any integer label dtype works; an empty batch gives a zero with
    a gradient and counts one empty batch. ``negative_labels`` holds a label below 0."""
    x = torch.randn(3, 8)
    with pytest.raises(ShapeError, match=r"\[0, 4\)"):
        loss(x, torch.tensor([0, 1, 4]))
    with pytest.raises(ShapeError, match=r"\[0, 4\)"):
        loss(x, torch.tensor(negative_labels))
    with pytest.raises(ShapeError, match="embedding_size=8"):
        loss(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    with pytest.raises(ConfigError, match="miner"):
        loss(x, torch.tensor([0, 1, 2]), indices=(torch.tensor([0]),) * 3)
    with pytest.raises(ConfigError, match="ref_emb"):
        loss(x, torch.tensor([0, 1, 2]), ref_emb=x, ref_labels=torch.tensor([0, 1, 2]))
    labels = torch.tensor([0, 3, 2])
    torch.testing.assert_close(loss(x, labels.int()), loss(x, labels))
    e = torch.zeros(0, 8, requires_grad=True)
    z = loss(e, torch.zeros(0, dtype=torch.long))
    z.backward()
    assert z.item() == 0.0 and loss.num_empty_batches == 1


# ------------------------------------------------------------------ tiny training runs
#: Config sections shared by the quick training tests: a two-block CNN with a 16-d embedding
#: on 28 x 28 grayscale images, trained with the triplet loss and the ``cpu_quick`` preset.
#: The ``fixed`` section of the protocol tests' small Omniglot benches (one epoch, CPU preset).
SMALL_BENCH_FIXED = {
    "seed": 3,
    "data": {"dataset": "omniglot"},
    "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 16},
    "sampler": {"classes_per_batch": 8, "samples_per_class": 4},
    "optimizer": {"preset": "cpu_quick"},
    "training": {"epochs": 1},
}

TINY_MODEL = {"trunk": "small_cnn", "trunk_options": {"widths": [8, 16]}, "pretrained": False,
              "in_channels": 1, "embedding_size": 16, "freeze_batchnorm": False}
TINY_LOSS = {"name": "triplet", "params": {"margin": 0.2}}
TINY_OPTIMIZER = {"preset": "cpu_quick"}


def tiny_sections() -> dict:
    """Fresh copies of the ``model``, ``loss`` and ``optimizer`` config sections above."""
    return copy.deepcopy({"model": TINY_MODEL, "loss": TINY_LOSS, "optimizer": TINY_OPTIMIZER})


def omniglot_run_config(directory, name: str, *, train: range, val: range, file: str = "config.yaml",
                        data: dict | None = None, **sections) -> Path:
    """Write a small Omniglot run config to ``directory/file`` and return its path: a split file
    beside it (``train`` / ``val`` background classes, the evaluation classes 964-973 as test),
    28-pixel grayscale, :func:`tiny_sections`' model, loss and optimizer; ``data`` adds to the
    data section, ``sections`` add top-level ones (sampler, training, miner, ...)."""
    import yaml

    directory = Path(directory)
    split = {"train": list(train), "val": list(val), "test": list(range(964, 974))}
    (directory / "split.json").write_text(json.dumps(split))
    config = {
        "name": name,
        "seed": 1,
        "data": {"dataset": "omniglot", "options": {"sets": ["background", "evaluation"]},
                 "split": {"kind": "file", "path": str(directory / "split.json")},
                 "transform": "grayscale", "image_size": 28, **(data or {})},
        **tiny_sections(),
        **sections,
    }
    path = directory / file
    path.write_text(yaml.safe_dump(config))
    return path


def bench_entries(tmp_path, cfg, labels, centres: int,
                  methods: tuple = (("contrastive", 1.5), ("ms", 0.9))) -> dict:
    """Final-stage entries of a bench with ``methods`` (name, noise), by default ``contrastive``
    (noisier) and ``ms`` (three seeds, two folds each, as the tests' two-fold splits: a results
    file must list every fold of a seed): clustered test embeddings saved under ``tmp_path``,
    evaluated with the config's metrics (for ``build_results`` in the compare / report tests)."""
    import numpy as np

    from dmlkit.embeddings import save_embeddings
    from dmlkit.protocol.runner import FinalRun, evaluate_runs

    centre = np.random.default_rng(0).normal(size=(centres, 8))
    entries = {}
    for k, (name, noise) in enumerate(methods):
        runs = []
        for s in (0, 1, 2):
            for fold in (0, 1):
                path = tmp_path / name / f"seed{s}" / f"fold{fold}" / "embeddings" / "test.npz"
                rng = np.random.default_rng(10 * k + s + 100 * fold)
                x = centre[labels] + noise * rng.normal(size=(labels.size, 8))
                save_embeddings(path, x.astype(np.float32), labels)
                runs.append(FinalRun(name, s, fold, path.parents[1], path, path.parents[1] / "best.pt"))
        entries[name] = {"runs": runs, "evaluation": evaluate_runs(runs, list(cfg.protocol.metrics)),
                         "best_params": {}, "loss": {"name": name}}
    return entries


def brown_subset(folder: Path, num_points: int, counts: tuple[int, ...], seed: int = 0):
    """A Brown-layout patch folder: ``2 * num_points`` 64 x 64 patches (two noisy views of each
    point) and one m50 pair file of each size in ``counts`` (half positive, half negative);
    returns the patches' point ids."""
    import numpy as np

    from dmlkit.apps.patches import PatchPairs, write_brown_subset

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (num_points, 64, 64))
    views = np.stack([base, base + rng.integers(-20, 21, base.shape)], 1).clip(0, 255).astype(np.uint8)
    point_ids = np.repeat(np.arange(num_points, dtype=np.int64), 2)
    image_ids = np.tile(np.arange(2, dtype=np.int64), num_points)

    def pairs(n: int, pair_seed: int) -> PatchPairs:
        r = np.random.default_rng(pair_seed)
        pts = r.integers(0, num_points, n)
        other = (pts + 1 + r.integers(0, num_points - 1, n)) % num_points
        left = (pts * 2).astype(np.int64)
        right = np.where(np.arange(n) % 2 == 0, pts * 2 + 1, other * 2).astype(np.int64)
        return PatchPairs(left, right, (point_ids[left] == point_ids[right]).astype(np.int64))

    write_brown_subset(folder, views.reshape(-1, 64, 64), point_ids, image_ids,
                       {c: pairs(c, seed + c) for c in counts})
    return point_ids


def tiny_patch_run(root: Path) -> tuple[Path, Path]:
    """``(config path, run directory)`` of a patches run trained on two small subsets of
    :func:`brown_subset` (one siam-l2 model, one epoch, a few steps) under ``root``."""
    import yaml

    from dmlkit.cli import main

    brown_subset(root / "a", 24, (64, 32), seed=1)
    brown_subset(root / "b", 24, (64, 32), seed=2)
    cfg = {"seed": 0, "data": {"root": str(root), "combinations": [["a", "b"]]},
           "model": {"architectures": ["siam-l2"], "patch_size": 32, "width": 0.125},
           "training": {"epochs": 1, "batch_size": 16, "threads": 1, "augment": False}}
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = root / "run"
    try:
        main(["patches", "train", str(path), "-o", str(run), "--json", "-q"])
    except SystemExit as exc:  # pragma: no cover - a failure shows in the tests that use it
        assert not exc.code
    return path, run


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``dmlkit ARGS`` in this process: (exit code, stdout, stderr) as captured by ``capsys``."""
    from dmlkit.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


#: Four class folders for the run-file tests: a and b train, c and d are the test classes.
FOLDER_CLASSES = ("a_cat", "b_astro", "c_coffee", "d_rocket")
#: The test split's files of :func:`four_class_folder`, in the order a run embeds them.
FOLDER_TEST_FILES = [f"{c}/img{j}.png" for c in FOLDER_CLASSES[2:] for j in range(3)]


def four_class_folder(root: Path) -> Path:
    """:data:`FOLDER_CLASSES` as class folders of three 16 x 16 grayscale PNGs each."""
    rng = np.random.default_rng(0)
    for i, name in enumerate(FOLDER_CLASSES):
        (root / name).mkdir(parents=True)
        for j in range(3):
            img = np.clip(40 + 50 * i + rng.normal(0, 20, (16, 16)), 0, 255).astype(np.uint8)
            Image.fromarray(img, mode="L").save(root / name / f"img{j}.png")
    return root


def one_step_run(name: str, dataset: str, run_dir: Path, data_root: Path, seed: int = 0) -> Path:
    """A one-step run of :func:`tiny_sections` on 16-pixel grayscale images of ``dataset``
    (``image_folder`` or ``csv``) under ``data_root``; its baseline warning is silenced."""
    import warnings

    from dmlkit.training import train

    config = {"name": name, "seed": seed,
              "data": {"dataset": dataset, "transform": "grayscale", "image_size": 16},
              **tiny_sections(),
              "sampler": {"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 1},
              "training": {"epochs": 1, "device": "cpu"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a one-step run may not beat its baseline
        train(config, run_dir, data_root=data_root, progress=False)
    return run_dir


def one_error_line(code: int, err: str) -> str:
    """The one ``error: ...`` line of a refused command (exit code 2, nothing else on stderr)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def tiny_alphadigits_bench(name: str, protocol: dict, methods: list, **fixed: dict) -> dict:
    """A small bench config (a dict) on binary_alphadigits at 20 x 20: a small CNN of 16
    dimensions, 4 classes x 4 samples, 2 batches, one epoch on the CPU; ``fixed`` updates the
    fixed sections named (``model={"embedding_size": 8}``)."""
    config = {
        "name": name,
        "fixed": {
            "seed": 0,
            "data": {"dataset": "binary_alphadigits", "transform": "grayscale", "image_size": 20},
            "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 16,
                      "freeze_batchnorm": False},
            "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 2},
            "optimizer": {"preset": "cpu_quick"},
            "training": {"epochs": 1, "device": "cpu"},
        },
        "protocol": protocol,
        "methods": methods,
    }
    for section, values in fixed.items():
        config["fixed"].setdefault(section, {}).update(values)
    return config


# ------------------------------------------------------------------ SiamFC training
def siamfc_train_sequence() -> Sequence:
    """One generated 4-frame 96 x 96 training sequence (seed 3)."""
    spec = offline_specs("train", 1, num_frames=4, seed=3, frame_size=(96, 96))[0]
    return make_sequence(spec)


def tiny_siamfc_config(data_dir: Path, epochs: int, **overrides) -> SiamFCTrainConfig:
    """A SiamFC config that trains in a second: a 1/16-width network, one pair an epoch."""
    base = dict(data_dir=str(data_dir), width=0.0625, epochs=epochs, pairs_per_epoch=1,
                batch_size=1, lr=0.01, lr_end=0.005)
    return SiamFCTrainConfig(**{**base, **overrides})


# ------------------------------------------------------------------ image-folder training
def tiny_image_folder_config(name: str, val_fraction: float) -> dict:
    """A config that trains a 4/8-wide grayscale CNN on an ``image_folder`` for two steps."""
    return {
        "name": name,
        "seed": 3,
        "data": {"dataset": "image_folder", "split": {"kind": "default", "val_fraction": val_fraction},
                 "transform": "grayscale"},
        "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8]}, "pretrained": False,
                  "in_channels": 1, "embedding_size": 8},
        "loss": {"name": "triplet", "params": {"margin": 0.2}},
        "miner": {"name": "batch_hard"},
        "sampler": {"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 2},
        "optimizer": {"preset": "cpu_quick"},
        "training": {"epochs": 1, "device": "cpu", "log_every": 1},
    }


def grey_image_folder(root: Path, classes: int = 16, per_class: int = 4) -> Path:
    """``root/classNN/i.png``: random 8 x 8 grayscale images (seed 0)."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c:02d}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(folder / f"{i}.png")
    return root


class Said:
    """A console that keeps what the bench prints (``.lines``, ``.text``: the plain text)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, message: str) -> None:
        from rich.text import Text

        self.lines.append(Text.from_markup(str(message)).plain)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def write_fake_final_run(config, run_dir: Path) -> None:
    """What a finished final run leaves for the bench's bookkeeping (its config, metrics and an
    empty test file), without training: for tests of which runs a stage trains again."""
    from dmlkit.config import dump_config  # lazy: only the bench tests need it

    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    (run_dir / "metrics.json").write_text("{}")
    (run_dir / "embeddings").mkdir(exist_ok=True)
    (run_dir / "embeddings" / "test.npz").write_bytes(b"")


class SixClassImages(torch.utils.data.Dataset):
    """Fixed random 1 x 8 x 8 images of 6 classes, 8 each."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = np.repeat(np.arange(6), 8)
        self.x = torch.randn(48, 1, 8, 8, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.x[i], int(self.labels[i])


#: A one-epoch ``small_cnn`` run on AT&T faces at 32 px (seconds on a CPU): the report tests' run.
TINY_ATT_FACES_RUN = {
    "name": "report-test",
    "seed": 0,
    "data": {"dataset": "att_faces", "split": {"kind": "default", "val_fraction": 0.2},
             "transform": "grayscale", "image_size": 32},
    "model": {"trunk": "small_cnn", "pretrained": False, "embedding_size": 16, "in_channels": 1},
    "loss": {"name": "contrastive", "params": {}},
    "miner": None,
    "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 3},
    "optimizer": {"name": "adam", "trunk_lr": 1e-3, "embedder_lr": 1e-3},
    "training": {"epochs": 1, "eval_every_epochs": 1, "log_every": 1},
}
