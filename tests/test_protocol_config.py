"""BenchConfig validation: fixed settings are fixed, methods only choose loss/miner/search."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import yaml

from _reference import SMALL_BENCH_FIXED
from dmlkit.exceptions import ConfigError
from dmlkit.losses import needs_pair_batches
from dmlkit.protocol.config import bench_config_from_dict, load_bench_config
from dmlkit.training.preflight import TrainStats, batch_problems

BASE = {
    "name": "t",
    "fixed": {**copy.deepcopy(SMALL_BENCH_FIXED),
              "classification_sampler": {"classes_per_batch": 32, "samples_per_class": 1}},
    "protocol": {"trials": 3},
    "methods": [
        {"name": "contrastive", "loss": {"name": "contrastive", "params": {}},
         "search": {"loss.pos_margin": {"low": 0.0, "high": 0.5},
                    "loss.neg_margin": {"low": 0.5, "high": 1.5}}},
        {"name": "triplet", "loss": {"name": "triplet"}, "miner": {"name": "batch_hard"},
         "search": {"loss.margin": {"low": 0.01, "high": 1.0, "log": True}}},
        {"name": "arcface", "loss": {"name": "arcface"},
         "search": {"loss.margin": {"low": 10, "high": 60, "type": "float"},
                    "optimizer.loss_lr": {"low": 1e-5, "high": 1e-2, "log": True}}},
    ],
}


def make(mutate=None):
    data = copy.deepcopy(BASE)
    if mutate:
        mutate(data)
    return bench_config_from_dict(data)


def test_valid_config_resolves_defaults():
    cfg = make()
    p = cfg.protocol
    assert p.split == "halves" and p.folds == 4 and p.trials == 3 and p.sampler == "tpe"
    assert p.seeds == [0] and p.repeats == 1
    assert p.metrics[:3] == ["precision_at_1", "r_precision", "map_at_r"]


def test_experiment_applies_params_and_keeps_fixed_settings():
    cfg = make()
    arc = cfg.method("arcface")
    exp = cfg.experiment(arc, {"loss.margin": 28.6, "optimizer.loss_lr": 1e-3}, seed=7)
    assert exp.loss.name == "arcface" and exp.loss.params["margin"] == 28.6
    assert exp.optimizer.loss_lr == 1e-3 and exp.seed == 7
    # classification losses get the classification sampler (the seed's 32 x 1)
    assert (exp.sampler.classes_per_batch, exp.sampler.samples_per_class) == (32, 1)
    con = cfg.experiment(cfg.method("contrastive"), {"loss.pos_margin": 0.1})
    assert (con.sampler.classes_per_batch, con.sampler.samples_per_class) == (8, 4)
    # every fixed section is identical across methods
    a = cfg.experiment(cfg.method("triplet")).fixed_part()
    b = cfg.experiment(cfg.method("contrastive")).fixed_part()
    assert a == b
    assert exp.model == con.model and exp.training == con.training
    assert exp.optimizer.trunk_lr == con.optimizer.trunk_lr


@pytest.mark.parametrize("key,value", [
    ("model", {"embedding_size": 64}),
    ("optimizer", {"trunk_lr": 1e-3}),
    ("sampler", {"classes_per_batch": 4}),
    ("training", {"epochs": 100}),
    ("data", {"dataset": "cub200"}),
])
def test_method_cannot_set_fixed_settings(key, value):
    def mutate(d):
        d["methods"][0][key] = value

    with pytest.raises(ConfigError, match="identical across methods") as info:
        make(mutate)
    assert key in str(info.value) and "fixed" in str(info.value)


@pytest.mark.parametrize("key", ["model.embedding_size", "optimizer.trunk_lr", "training.epochs",
                                 "sampler.samples_per_class", "lr"])
def test_search_outside_method_parameters_is_rejected(key):
    def mutate(d):
        d["methods"][0]["search"][key] = {"low": 1, "high": 2}

    with pytest.raises(ConfigError, match=r"identical across methods|must be 'loss"):
        make(mutate)


def test_other_errors_are_clear():
    with pytest.raises(ConfigError, match="no miner"):
        make(lambda d: d["methods"][0]["search"].update({"miner.epsilon": {"low": 0.0, "high": 1.0}}))
    with pytest.raises(ConfigError, match="unique"):
        make(lambda d: d["methods"].append(copy.deepcopy(d["methods"][0])))
    with pytest.raises(ConfigError, match="log-scaled range needs low > 0"):
        make(lambda d: d["methods"][1]["search"].update({"loss.margin": {"low": 0, "high": 1, "log": True}}))
    with pytest.raises(ConfigError, match="choices"):
        make(lambda d: d["methods"][1]["search"].update({"loss.margin": {"type": "categorical"}}))
    with pytest.raises(ConfigError, match="unknown loss"):
        make(lambda d: d["methods"][1]["loss"].update({"name": "no_such_loss"}))
    with pytest.raises(ConfigError, match="under 'fixed'"):
        make(lambda d: d.update({"model": {"embedding_size": 3}}))
    with pytest.raises(ConfigError, match="protocol.split"):
        make(lambda d: d["fixed"]["data"].update({"split": {"kind": "ratio", "ratios": [4, 1, 5]}}))
    with pytest.raises(ConfigError, match="folds: 1"):
        make(lambda d: d["protocol"].update({"split": "ratio_4_1_5", "folds": 4}))
    with pytest.raises(ConfigError, match="reserved"):
        make(lambda d: d["methods"][0].update({"name": "pretrained"}))
    with pytest.raises(ConfigError, match="database URL"):
        make(lambda d: d["protocol"].update({"storage": "study.db"}))


def test_seeds_and_ratio_split():
    cfg = make(lambda d: d["protocol"].update({"split": "ratio_4_1_5", "seeds": [4, 5, 6]}))
    assert cfg.protocol.folds == 1 and cfg.protocol.repeats == 3 and cfg.protocol.seeds == [4, 5, 6]
    cfg = make(lambda d: d["protocol"].update({"repeats": 2}))
    assert cfg.protocol.seeds == [0, 1]
    # an empty list trained seed 0, wrote "0 seed(s) []" and repeats: 0, which no rerun could read
    with pytest.raises(ConfigError, match="protocol.seeds is empty"):
        make(lambda d: d["protocol"].update({"seeds": []}))


def test_load_with_overrides(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_bench_config(path, ["protocol.trials=7", "methods.1.loss.params.swap=true"])
    assert cfg.protocol.trials == 7
    # a search range's key holds a dot: --set reaches it (it was "unknown key")
    searched = next(k for k in cfg.method("triplet").search)
    narrowed = load_bench_config(path, [f"methods.1.search.{searched}.high=0.6"])
    assert narrowed.method("triplet").search[searched].high == 0.6
    assert cfg.method("triplet").loss.params == {"swap": True}
    # a fixed value of a searched parameter was silently replaced by each trial's value
    with pytest.raises(ConfigError, match="loss.margin is both fixed .* and searched"):
        load_bench_config(path, ["methods.1.loss.params.margin=0.3"])
    # repeats that contradict the seeds listed were silently replaced by their count
    with pytest.raises(ConfigError, match="protocol.repeats = 5 but protocol.seeds lists 3"):
        load_bench_config(path, ["protocol.repeats=5", "protocol.seeds=[0, 1, 2]"])
    assert load_bench_config(path, ["protocol.repeats=3", "protocol.seeds=[0, 1, 2]"]).protocol.repeats == 3
    with pytest.raises(ConfigError, match="grace_period .* must exceed"):
        load_bench_config(path, ["protocol.heartbeat_interval=500", "protocol.grace_period=10"])
    with pytest.raises(ConfigError, match="not found"):
        load_bench_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["bench_cub200", "bench_cars196", "bench_sop", "bench_quick"])
def test_shipped_presets_are_valid(name):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    if not path.exists():
        pytest.skip(f"{path} not written yet")
    cfg = load_bench_config(path)
    names = {m.loss.name for m in cfg.methods}
    if name != "bench_quick":
        assert cfg.protocol.trials == 50 and cfg.protocol.folds == 4
        assert cfg.fixed.model.embedding_size == 128 and cfg.fixed.optimizer.trunk_lr == 1e-6
        assert (cfg.fixed.sampler.classes_per_batch, cfg.fixed.sampler.samples_per_class) == (8, 4)
    assert {"contrastive", "triplet", "multi_similarity", "normalized_softmax", "arcface",
            "proxy_anchor"} <= names


@pytest.mark.parametrize("url", [
    "postgresql://alice:s3cret@db.example:5432/studies",
    "postgres://alice:s3cret@db/studies",
    "postgresql+psycopg://alice:s3cret@db/studies",
    "postgresql://alice@db/studies?password=s3cret",
])
def test_a_password_in_the_storage_url_is_refused_before_anything_is_written(url, tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["protocol"]["storage"] = url
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="PGPASSWORD") as info:
        load_bench_config(path)
    assert "s3cret" not in str(info.value)
    # the same through a --set override (which lands in provenance's argv if accepted)
    cfg["protocol"]["storage"] = None
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="never stores a password"):
        load_bench_config(path, [f"protocol.storage={url}"])


def test_a_storage_url_without_password_is_accepted():
    cfg = make(lambda d: d["protocol"].update({"storage": "postgresql://alice@db:5432/studies"}))
    assert cfg.protocol.storage == "postgresql://alice@db:5432/studies"


@pytest.mark.parametrize(("terms", "batch"), [
    ([{"name": "triplet"}, {"name": "softmax"}], (8, 4)),  # the re-id recipe: pairs needed
    ([{"name": "contrastive"}, {"name": "triplet"}], (8, 4)),
    ([{"name": "softmax"}, {"name": "arcface"}], (32, 1)),  # classification alone
])
def test_a_combined_loss_gets_the_embedding_sampler_when_a_term_learns_from_pairs(terms, batch):
    """Seed 000: C = 8, M = 4 for embedding losses, 32 x 1 for classification losses. Every
    ``combined`` loss got 32 x 1 (it needs num_classes when one term does), so its triplet term
    saw no positive pair on any batch; and the training preflight did not flag M = 1 for it."""
    def add(data):
        data["methods"].append({"name": "mix", "loss": {"name": "combined", "params": {"losses": terms}}})

    cfg = make(add)
    exp = cfg.experiment(cfg.method("mix"))
    assert (exp.sampler.classes_per_batch, exp.sampler.samples_per_class) == batch
    assert needs_pair_batches("combined", {"losses": terms}) == (batch == (8, 4))
    one_per_class = exp.override({"sampler.classes_per_batch": 32, "sampler.samples_per_class": 1})
    flagged = [p.key for p in batch_problems(one_per_class, TrainStats.of(np.repeat(np.arange(40), 5)))]
    assert ("sampler.samples_per_class" in flagged) == (batch == (8, 4))
