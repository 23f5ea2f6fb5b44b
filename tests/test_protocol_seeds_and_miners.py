"""Two ways the bench protocol quietly departed from "A Metric Learning Reality Check" (seed 000).

1. The triplet method of every bench preset paired the searched ``loss.margin`` with a miner
   that keeps only the triplets inside its *own* fixed margin (``batch_all`` 0.1 in the
   paper-scale presets, ``semi_hard`` 0.2 in bench_quick and the reproduction). Past the
   miner's reach every mined triplet is inside the hinge, so different margins trained
   bit-identical models and most of the search range was flat. The seed's triplet row has no
   miner; the presets now have none, and the bench preflight warns about the combination.
2. Final run (seed s, fold f) trained with ``1000 s + f`` and search fold f with
   ``fixed.seed + f``: with ``fixed.seed: 0`` the final seed-0 models *were* the winning
   trial's, bit for bit, so one of the seeds behind each CI was selected on validation. Final
   runs now train with ``fixed.seed + folds (s + 1) + f``, disjoint from the search by
   construction; a bench directory with final runs trained with the old seeds retrains them.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from _reference import Said, grey_image_folder, write_fake_final_run
from dmlkit.protocol import Bench, bench_config_from_dict, load_bench_config
from dmlkit.protocol.stages import FinalStage, run_seed
from dmlkit.training.builders import build_loss, build_miner

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
PRESETS = [REPO / "configs" / f"bench_{n}.yaml" for n in ("cub200", "cars196", "sop", "quick")] + [
    REPO / "benchmarks" / "reproduction" / f"{n}.yaml" for n in ("omniglot", "alphadigits")]
OLD_BATCH_ALL = "{name: batch_all, params: {margin: 0.1}}"  # the paper-scale presets' miner
OLD_SEMI_HARD = "{name: semi_hard}"                           # bench_quick's and the reproduction's


def _bench(method: dict, **protocol) -> dict:
    return {"name": "t", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
            "protocol": {"seeds": [0], "trials": 2, **protocol}, "methods": [method]}


TRIPLET = {"name": "triplet", "loss": {"name": "triplet"},
           "search": {"loss.margin": {"low": 0.0, "high": 1.0}}}


def _tiny_bench(root: Path, method: dict, **protocol) -> dict:
    return {
        "name": "seeds",
        "fixed": {"data": {"dataset": "image_folder", "root": str(root), "transform": "grayscale",
                           "image_size": 8},
                  "model": {"trunk": "small_cnn", "trunk_options": {"widths": [4, 8]}, "pretrained": False,
                            "in_channels": 1, "embedding_size": 8, "freeze_batchnorm": False},
                  "sampler": {"classes_per_batch": 2, "samples_per_class": 2, "batches_per_epoch": 1},
                  "optimizer": {"preset": "cpu_quick"}, "training": {"epochs": 1, "device": "cpu"}},
        "protocol": {"folds": 2, "seeds": [0, 1], "trials": 1, "n_startup_trials": 1, **protocol},
        "methods": [method],
    }


# -- 1. the triplet margin and a margin miner ------------------------------------------------------
@pytest.mark.parametrize(("miner", "reach"), [
    ({"name": "batch_all", "params": {"margin": 0.1}}, "0.447"),  # sqrt(2 * 0.1): cosine vs Euclidean
    ({"name": "semi_hard"}, "0.632"),                               # its default margin 0.2
    ({"name": "semi_hard", "params": {"distance": "euclidean", "margin": 0.3}}, "0.3"),
])
def test_a_searched_triplet_margin_with_a_margin_miner_warns_in_one_line(miner, reach):
    from dmlkit.protocol.preflight import inert_margin_problems

    cfg = bench_config_from_dict(_bench({**TRIPLET, "miner": miner}))
    (problem,) = inert_margin_problems(cfg, cfg.methods[0], 0)
    line = problem.line()
    assert problem.severity == "warning" and "\n" not in line
    assert line.startswith("methods.0.miner: method 'triplet' searches loss.margin over 0.0-1.0")
    assert f"its miner {miner['name']}" in line and f"above {reach} " in line and "remove the miner" in line


@pytest.mark.parametrize("change", [
    {"miner": None},                                                      # the seed's triplet
    {"miner": {"name": "batch_hard"}},                                   # no margin of its own
    {"miner": {"name": "batch_all", "params": {"nonzero": False}}},      # keeps every triplet
    {"miner": {"name": "semi_hard"}, "loss": {"name": "triplet", "params": {"soft_margin": True}}},
    {"miner": {"name": "semi_hard"}, "search": {}},                      # the margin is not searched
    {"miner": {"name": "batch_all", "params": {"margin": 0.1}},           # the ratio form: m in its gradient
     "loss": {"name": "triplet", "params": {"form": "ratio"}}},
])
def test_no_warning_where_the_loss_margin_stays_live(change):
    from dmlkit.protocol.preflight import inert_margin_problems

    cfg = bench_config_from_dict(_bench({**TRIPLET, **change}))
    assert inert_margin_problems(cfg, cfg.methods[0], 0) == []


def test_the_bench_preflight_reports_the_warning(tmp_path):
    """``check_bench`` (what ``dmlkit bench`` runs before the first trial) lists it among its
    warnings; the config still runs (nothing refused)."""
    from dmlkit.protocol.preflight import check_bench

    cfg = bench_config_from_dict(_tiny_bench(grey_image_folder(tmp_path / "data"),
                                             {**TRIPLET, "miner": {"name": "semi_hard"}}))
    report = check_bench(cfg, Bench(cfg, tmp_path / "b").full_dataset())
    assert not report.errors
    assert [p.key for p in report.warnings] == ["methods.0.miner"]
    assert "keeps only the triplets inside its own margin 0.2" in report.warnings[0].line()
    # said beside the errors of a config that does not fit (in the error's "also (warnings)")
    data = _tiny_bench(tmp_path / "data", {**TRIPLET, "miner": {"name": "semi_hard"}})
    data["fixed"]["sampler"]["classes_per_batch"] = 20
    cfg = bench_config_from_dict(data)
    report = check_bench(cfg, Bench(cfg, tmp_path / "b").full_dataset())
    assert [p.key for p in report.errors] == ["fixed.sampler.classes_per_batch"]
    assert "also (warnings): methods.0.miner: method 'triplet'" in report.message()


def test_a_bench_without_a_console_says_it_as_a_python_warning(tmp_path):
    """``dmlkit bench --quiet`` and ``Bench(...)`` from Python have no console: the preflight's
    warnings come as :class:`PreflightWarning` (one line each) instead of not at all."""
    from dmlkit.training.problems import PreflightWarning

    cfg = bench_config_from_dict(_tiny_bench(grey_image_folder(tmp_path / "data"),
                                             {**TRIPLET, "miner": {"name": "batch_all", "params": {"margin": 0.1}}}))
    with pytest.warns(PreflightWarning, match=r"^methods\.0\.miner: method 'triplet' searches loss\.margin"):
        Bench(cfg, tmp_path / "b").validate()
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_the_shipped_presets_do_not_warn(path):
    from dmlkit.protocol.preflight import inert_margin_problems

    cfg = load_bench_config(path)
    assert [p.line() for i, m in enumerate(cfg.methods) for p in inert_margin_problems(cfg, m, i)] == []
    assert cfg.method("triplet").miner is None  # the seed's triplet row has no miner


def _triplet_gradients(cfg, margins) -> dict[float, torch.Tensor]:
    """The gradient of the preset's triplet method (loss and miner as built for training) on one
    fixed batch of 8 classes x 4, clustered 32-d unit embeddings, for each loss margin."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(8).repeat_interleave(4)
    centres = torch.randn(8, 32, generator=g)
    emb = torch.nn.functional.normalize((centres[labels] + torch.randn(32, 32, generator=g)) / math.sqrt(32), dim=1)
    method = cfg.method("triplet")
    grads = {}
    for margin in margins:
        e = cfg.experiment(method, {"loss.margin": margin})
        miner = build_miner(e)
        loss = build_loss(e, 8, 32, miner=miner)
        x = emb.clone().requires_grad_(True)
        if miner is None:
            loss(x, labels).backward()
        else:
            loss(x, labels, miner(x, labels)).backward()
        grads[margin] = x.grad
    return grads


def test_without_the_miner_the_triplet_margin_changes_the_gradient():
    """The search of loss.margin is live: margins 0.5, 0.7 and 1.0 give three different
    gradients on the same batch (the shipped preset, no miner) ..."""
    cfg = load_bench_config(REPO / "configs" / "bench_cub200.yaml")
    grads = _triplet_gradients(cfg, (0.5, 0.7, 1.0))
    assert not torch.equal(grads[0.5], grads[0.7]) and not torch.equal(grads[0.7], grads[1.0])
    assert (grads[0.5] - grads[1.0]).norm() > 0.01 * grads[1.0].norm()  # not a rounding difference


@pytest.mark.parametrize("miner", [OLD_BATCH_ALL, OLD_SEMI_HARD])
def test_with_the_old_miners_the_triplet_margin_changed_nothing(miner):
    """... while with the miner the presets had, the same margins gave bit-identical, non-zero
    gradients: every mined triplet was inside the hinge, so the trials trained the same model."""
    cfg = load_bench_config(REPO / "configs" / "bench_cub200.yaml", [f"methods.1.miner={miner}"])
    grads = _triplet_gradients(cfg, (0.7, 1.0))
    assert torch.equal(grads[0.7], grads[1.0]) and grads[1.0].norm() > 0


@pytest.mark.parametrize("miner", ["batch_all", "semi_hard"])
def test_no_mined_triplet_is_beyond_the_reach_the_warning_states(miner):
    """The reach ``sqrt(2 mu)`` (cosine miner, Euclidean loss): the largest ``d_an - d_ap`` of a
    mined triplet stays below it on batches from tight to loose clusters."""
    from dmlkit.miners import get_miner

    g = torch.Generator().manual_seed(1)
    labels = torch.arange(8).repeat_interleave(4)
    for spread in (0.05, 0.3, 1.0, 3.0):
        centres = torch.randn(8, 16, generator=g)
        emb = torch.nn.functional.normalize(centres[labels] + spread * torch.randn(32, 16, generator=g), dim=1)
        a, p, n = get_miner(miner, margin=0.1)(emb, labels)
        d = torch.cdist(emb.double(), emb.double())
        if a.numel():
            assert float((d[a, n] - d[a, p]).max()) < math.sqrt(2 * 0.1)


# -- 2. final-run seeds never repeat a search seed --------------------------------------------------
@pytest.mark.parametrize("folds", [1, 2, 3, 4, 10])
def test_search_and_final_training_seeds_never_coincide(folds):
    """For every fixed.seed, number of folds and list of seeds tried, the training seeds of the
    search (every trial trains fold f with the same seed) and of the final runs are disjoint,
    and no two final runs share one. (With the old ``1000 s + f``, fixed.seed 0 gave final
    seed 0 the search's seeds.)"""
    split = {"split": "ratio_4_1_5"} if folds == 1 else {"folds": folds}
    for fixed_seed in (0, 1, 2, 3, 4, 5, 7, 999, 1000, 1001, 4000, 2**20, 2**31):
        for seeds in ([0, 1, 2, 3, 4], [0], [1, 3], [7, 1000, 12345], list(range(20))):
            data = _bench(TRIPLET, seeds=seeds, **split)
            data["fixed"]["seed"] = fixed_seed
            cfg = bench_config_from_dict(data)
            search = {cfg.search_seed(f) for f in range(folds)}
            final = [run_seed(cfg, s, f) for s in seeds for f in range(folds)]
            assert len(search) == folds and len(set(final)) == len(final)
            assert not search & set(final), (fixed_seed, folds, seeds)
            assert final == [fixed_seed + folds * (s + 1) + f for s in seeds for f in range(folds)]


def test_the_old_run_seed_call_is_refused_in_one_line():
    """``run_seed(seed, fold)`` (before the seeds were made disjoint) would be a confusing
    TypeError from inside the function: it says what changed."""
    with pytest.raises(TypeError, match=r"takes the bench config, a seed and a fold \(got a int .*no longer 1000 \* seed \+ fold") as info:
        run_seed(0, 1)
    assert "\n" not in str(info.value)
    cfg = bench_config_from_dict(_bench(TRIPLET))
    with pytest.raises(TypeError, match=r"got a BenchConfig and 2 arguments") as info:
        run_seed(cfg, 0)  # the fold left out: named briefly, not the config's whole repr
    assert len(str(info.value)) < 300



def test_final_runs_and_pretrained_row_made_with_the_old_seeds_are_stale(tmp_path):
    """A bench directory whose final runs (and pretrained row) an earlier dmlkit made with seed
    ``1000 s + f``: its runs are reported as trained with other settings, never mixed with
    new-seed runs; the final stage trains them again, and embeds the pretrained row again, with
    the new seeds, which the pretrained row and the trained runs share."""
    cfg = bench_config_from_dict(_tiny_bench(grey_image_folder(tmp_path / "data"), {**TRIPLET, "search": {}}))
    trained: list[tuple[str, int]] = []

    def fake_train(config, run_dir, **_):
        trained.append(("/".join(run_dir.parts[-2:]), config.seed))
        write_fake_final_run(config, run_dir)

    bench = Bench(cfg, tmp_path / "b", train_fn=fake_train)
    full = bench.full_dataset()
    said = Said()
    stage = FinalStage(cfg, bench.split(full), full, bench.dir, train_fn=fake_train, console=said)
    method = cfg.methods[0]
    # what the earlier dmlkit left: every final run finished, with seed 1000 s + f
    for s in (0, 1):
        for f in (0, 1):
            fake_train(cfg.experiment(method, {}, seed=1000 * s + f), bench.dir / "final" / "triplet" / f"seed{s}" / f"fold{f}")
    old_pretrained = stage.run_pretrained()
    for run in old_pretrained:
        saved = yaml.safe_load((run.run_dir / "config.yaml").read_text())
        saved["seed"] = 1000 * run.seed + run.fold
        (run.run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
        np.savez(run.embeddings, stale=np.zeros(1))  # not what the new seed embeds
    trained.clear()

    assert stage.current_runs(method, {}) == "seed 0 fold 0 was trained with other settings (seed (0 -> 2))"
    runs = stage.run_method(method, {})
    assert trained == [("seed0/fold0", 2), ("seed0/fold1", 3), ("seed1/fold0", 4), ("seed1/fold1", 5)]
    assert "final triplet: seed 1 fold 1 was trained with other settings (seed (1001 -> 5)): training it " \
        "again" in said.text
    assert isinstance(stage.current_runs(method, {}), list) and len(runs) == 4

    pretrained = stage.run_pretrained()
    assert "pretrained: seed 0 fold 1 was embedded with other settings (seed (1 -> 3)): embedding it " \
        "again" in said.text
    seeds = [yaml.safe_load((r.run_dir / "config.yaml").read_text())["seed"] for r in pretrained]
    assert seeds == [2, 3, 4, 5]  # the trained runs' seeds
    fresh = FinalStage(cfg, bench.split(full), full, tmp_path / "fresh").run_pretrained()
    for again, new in zip(pretrained, fresh, strict=True):
        with np.load(again.embeddings) as a, np.load(new.embeddings) as b:
            assert "stale" not in a.files and np.array_equal(a["embeddings"], b["embeddings"])


def test_the_final_seeds_depend_on_fixed_seed_and_folds_only():
    """The formula depends on fixed.seed and protocol.folds only (not on the method)."""
    data = _bench(TRIPLET, seeds=[0, 3], folds=4)
    data["fixed"]["seed"] = 10
    cfg = bench_config_from_dict(data)
    other = bench_config_from_dict({**copy.deepcopy(data), "methods": [{"name": "c", "loss": {"name": "contrastive"}}]})
    assert [run_seed(cfg, 3, f) for f in range(4)] == [run_seed(other, 3, f) for f in range(4)] == [26, 27, 28, 29]


# -- 3. the presets search the learning rate of a loss's own weights -----------------------------
@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_searches_the_lr_of_a_loss_with_its_own_weights(path):
    """The seed leaves the lr of a loss's own weights (ArcFace, ...) "as a hyperparameter to be
    optimized"; bench_quick kept it at its Adam 1e-3 for normalized_softmax, arcface and
    proxy_anchor. Every method whose loss has trainable weights searches optimizer.loss_lr,
    and no other method does."""
    cfg = load_bench_config(path)
    wrong = []
    for method in cfg.methods:
        e = cfg.experiment(method)
        loss = build_loss(e, 10, cfg.fixed.model.embedding_size, miner=build_miner(e))
        owns = any(p.requires_grad for p in loss.parameters())
        if owns != ("optimizer.loss_lr" in method.search):
            wrong.append(method.name)
    assert wrong == []
