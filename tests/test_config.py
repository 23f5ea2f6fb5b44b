"""The config spine (dmlkit.config): the evaluation section, renamed keys, resume checks,
builders that take their own section, and the deprecation shims of moved import paths."""

from __future__ import annotations

import inspect
import warnings

import pytest
import yaml

from dmlkit.config import (
    DEFAULT_EVAL_BATCH_SIZE,
    EvaluationConfig,
    ExperimentConfig,
    config_from_dict,
    dump_config,
    load_config,
)
from dmlkit.exceptions import CheckpointError, ConfigError

BASE = {"data": {"dataset": "omniglot"}, "loss": {"name": "triplet"}}


def test_evaluation_defaults_are_the_librarys_defaults():
    from dmlkit.embeddings import embed, extract_features
    from dmlkit.metrics import evaluate

    ev = EvaluationConfig()
    metric_defaults = inspect.signature(evaluate).parameters
    assert ev.memory_mb * 2**20 == metric_defaults["memory_budget"].default
    assert ev.cluster_restarts == metric_defaults["cluster_restarts"].default
    assert ev.backend == metric_defaults["backend"].default
    for fn in (embed, extract_features):  # one inference batch default
        assert inspect.signature(fn).parameters["batch_size"].default == ev.batch_size == DEFAULT_EVAL_BATCH_SIZE
    assert ev.metric_options() == {"backend": "auto", "memory_budget": 256 * 2**20, "cluster_restarts": 3}


def test_old_eval_batch_size_key_is_read_as_evaluation_batch_size(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({**BASE, "training": {"epochs": 2, "eval_batch_size": 64}}))
    cfg = load_config(path)
    assert cfg.evaluation.batch_size == 64 and cfg.training.epochs == 2
    assert "eval_batch_size" not in dump_config(cfg)
    # the old key as an override of a resolved config, and in a nested (bench) override
    assert cfg.override(["training.eval_batch_size=32"]).evaluation.batch_size == 32
    assert load_config(path, ["evaluation.batch_size=16"]).evaluation.batch_size == 16
    with pytest.raises(ConfigError, match="disagree"):
        config_from_dict({**BASE, "training": {"eval_batch_size": 64}, "evaluation": {"batch_size": 8}})
    with pytest.raises(ConfigError, match="evaluation.memory_mb"):
        config_from_dict({**BASE, "evaluation": {"memory_mb": 0}})
    # both names as overrides (--set), in either order: the same refusal as in a file
    for pair in (["training.eval_batch_size=77", "evaluation.batch_size=64"],
                 ["evaluation.batch_size=64", "training.eval_batch_size=77"]):
        with pytest.raises(ConfigError, match="disagree: keep only evaluation.batch_size"):
            load_config(path, pair)
    assert load_config(path, ["training.eval_batch_size=8", "evaluation.batch_size=8"]).evaluation.batch_size == 8


def test_resume_check_ignores_renamed_keys_and_evaluation_settings():
    from dmlkit.training.checkpoint import check_resumable

    cfg = config_from_dict(BASE)
    saved = cfg.model_dump(mode="json")
    del saved["evaluation"]
    saved["training"]["eval_batch_size"] = 256  # a checkpoint written before the section existed
    check_resumable(saved, cfg.override(["evaluation.memory_mb=1024", "evaluation.backend=torch"]))
    with pytest.raises(CheckpointError, match=r"loss.params.margin"):
        check_resumable(saved, cfg.override(["loss.params.margin=0.3"]))


def test_bench_fingerprint_keeps_its_old_shape_and_ignores_evaluation():
    from dmlkit.protocol import bench_config_from_dict
    from dmlkit.protocol.runner import method_fingerprint
    from dmlkit.protocol.splits import make_bench_split

    data = {"fixed": {"data": {"dataset": "omniglot"}},
            "methods": [{"name": "triplet", "loss": {"name": "triplet"}}]}
    cfg = bench_config_from_dict(data)
    fixed = cfg.fixed_fingerprint()
    assert "evaluation" not in fixed and fixed["training"]["eval_batch_size"] == 256
    split = make_bench_split(list(range(16)), "halves", folds=4)
    other = bench_config_from_dict({**data, "fixed": {**data["fixed"], "evaluation": {"memory_mb": 64}}})
    assert method_fingerprint(cfg, cfg.methods[0], split) == method_fingerprint(other, other.methods[0], split)
    changed = bench_config_from_dict({**data, "fixed": {**data["fixed"], "evaluation": {"batch_size": 32}}})
    assert method_fingerprint(cfg, cfg.methods[0], split) != method_fingerprint(changed, changed.methods[0], split)
    assert cfg.experiment(cfg.methods[0]).evaluation == cfg.fixed.evaluation


def test_builders_take_their_own_section():
    from dmlkit.training import build_loss, build_miner, build_model, build_optimizer

    cfg = config_from_dict({
        **BASE, "model": {"trunk": "small_cnn", "pretrained": False, "in_channels": 1, "embedding_size": 8},
        "miner": {"name": "batch_hard"}, "optimizer": {"preset": "cpu_quick"},
    })
    model = build_model(cfg.model)
    assert model.embedding_size == 8
    assert type(build_model(cfg)) is type(model)  # a whole config still works
    assert build_miner(None) is None and build_miner(cfg.miner) is not None
    loss = build_loss(cfg.loss, num_classes=5, embedding_size=model.embedding_size)
    opt = build_optimizer(cfg.optimizer, model, loss)
    assert [g["name"] for g in opt.param_groups] == ["trunk", "embedder"]
    assert [g["name"] for g in build_optimizer(cfg.optimizer, build_model(cfg.model), loss,
                                               frozen_trunk=True).param_groups] == ["embedder"]
    with pytest.raises(TypeError, match="ModelConfig"):
        build_model(cfg.loss)


@pytest.mark.parametrize(("old", "name", "new"), [
    ("dmlkit.training.config", "ExperimentConfig", "dmlkit.config"),
    ("dmlkit.training.embed", "embed", "dmlkit.embeddings"),
    ("dmlkit.utils", "load_embeddings", "dmlkit.embeddings"),
    ("dmlkit.utils", "save_embeddings", "dmlkit.embeddings"),
    ("dmlkit.models", "extract_features", "dmlkit.embeddings"),
    ("dmlkit.models.features", "state_dict_digest", "dmlkit.embeddings"),
])
def test_moved_names_still_import_with_a_deprecation_warning(old, name, new):
    import importlib

    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError):
        _ = importlib.import_module(old).no_such_name


def test_training_package_reexports_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from dmlkit.training import EvaluationConfig as E2
        from dmlkit.training import ExperimentConfig as X2
        from dmlkit.training import embed_split, load_config  # noqa: F401
    assert E2 is EvaluationConfig and X2 is ExperimentConfig


@pytest.mark.parametrize("name", ["../../x", "/abs/path", "a/b", "..", "~me", "a\\b"])
def test_a_run_name_is_a_name_not_a_path(name):
    from dmlkit.config import config_from_dict
    from dmlkit.exceptions import ConfigError
    from dmlkit.protocol.config import bench_config_from_dict

    with pytest.raises(ConfigError, match="must be a plain name.*--run-dir"):
        config_from_dict({"name": name, "data": {"dataset": "omniglot"}, "loss": {"name": "triplet"}})
    with pytest.raises(ConfigError, match="must be a plain name"):
        bench_config_from_dict({"name": name, "fixed": {"data": {"dataset": "omniglot"}},
                                "methods": [{"name": "t", "loss": {"name": "triplet"}}]})
    assert config_from_dict({"name": "my-run_2", "data": {"dataset": "omniglot"},
                             "loss": {"name": "triplet"}}).name == "my-run_2"


@pytest.mark.parametrize("kind", ["latin1", "directory", "yaml"])
def test_an_unreadable_config_is_one_clear_line(tmp_path, kind, capsys):
    from dmlkit.cli import main

    if kind == "latin1":
        path = tmp_path / "c.yaml"
        path.write_bytes("name: caf\xe9\ndata: {dataset: omniglot}\n".encode("latin-1"))
    elif kind == "directory":
        path = tmp_path / "configs"
        path.mkdir()
    else:
        path = tmp_path / "c.yaml"
        path.write_text("data: [unclosed\n")
    for command in (["train", str(path)], ["bench", str(path)]):
        with pytest.raises(SystemExit) as info:
            main(command)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err, err
        assert len([line for line in err.splitlines() if line.strip()]) == 1, err


@pytest.mark.parametrize("split, key", [
    ({"kind": "default", "ratios": [4, 1, 5]}, "split.ratios"),
    ({"kind": "default", "path": "/nonexistent.json"}, "split.path"),
    ({"kind": "file", "path": "s.json", "order": "random"}, "split.order"),
])
def test_split_keys_the_kind_does_not_read_are_refused(split, key):
    """They trained with the kind's defaults, the key ignored without a word."""
    with pytest.raises(ConfigError, match=f"{key} is read by kind"):
        config_from_dict({**BASE, "data": {**BASE["data"], "split": split}})


def test_number_settings_refuse_true_and_false():
    """pydantic reads `true` as 1: `epochs: true` trained one epoch without a word."""
    from dmlkit.apps.tracking.training import SiamFCTrainConfig

    with pytest.raises(ConfigError, match="training.epochs: must be a number, not true"):
        config_from_dict({**BASE, "training": {"epochs": True}})
    with pytest.raises(ConfigError, match="evaluation.memory_mb: must be a number, not false"):
        config_from_dict({**BASE, "evaluation": {"memory_mb": False}})
    assert config_from_dict({**BASE, "training": {"amp": True, "epochs": 3}}).training.epochs == 3
    with pytest.raises(Exception, match="must be a number"):
        SiamFCTrainConfig.model_validate({"data_dir": "x", "epochs": True})


# -- the configuration audit: values a config file or --set can no longer slip through ---------
def test_a_key_given_twice_in_a_yaml_file_is_refused():
    """PyYAML kept the last value: a second ``training:`` block replaced the first whole."""
    from dmlkit.config_yaml import load_yaml

    for text, key in (("training: {epochs: 1}\ntraining: {max_steps: 1}\n", "training"),
                      ("loss: {params: {margin: 0.1, margin: 0.2}}\n", "margin")):
        with pytest.raises(yaml.YAMLError, match=f"the key '{key}' is given twice"):
            load_yaml(text)
    merged = load_yaml("base: &d {x: 1, y: 2}\nc:\n  <<: *d\n  x: 3\n")
    assert merged["c"] == {"x": 3, "y": 2}  # a merge key still gives way to the keys beside it


def test_a_set_key_given_twice_with_two_values_is_refused():
    from dmlkit.config_yaml import parse_overrides

    with pytest.raises(ConfigError, match=r"--set training.max_steps is given twice \(1 and 2\)"):
        parse_overrides(["training.max_steps=1", "training.max_steps=2"])
    assert parse_overrides(["training.max_steps=1", "training.max_steps=1"]) == {"training.max_steps": 1}
    with pytest.raises(ConfigError) as info:
        parse_overrides(["training.epochs=[1"])
    assert "\n" not in str(info.value)  # PyYAML's message spans several lines


@pytest.mark.parametrize("override", ["optimizer.trunk_lr=.inf", "optimizer.weight_decay=.nan",
                                      "data.split.ratios=[.inf, 1, 5]"])
def test_non_finite_numbers_are_refused_when_the_config_is_read(tmp_path, override):
    """``trunk_lr: .inf`` trained NaN weights after the run directory was written."""
    from dmlkit.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("name: t\ndata: {dataset: att_faces}\nloss: {name: triplet}\n")
    with pytest.raises(ConfigError, match="finite number"):
        load_config(path, [override])


@pytest.mark.parametrize(("value", "message"), [(float("nan"), "must be a finite number, got nan"),
                                                (float("inf"), "must be a finite number, got inf"),
                                                (True, r"is a number \(default 0.2\), got true")])
def test_loss_and_miner_numbers_are_checked_though_their_sections_are_untyped(value, message):
    """``margin: .nan`` trained NaN losses blamed on the embeddings; ``margin: yes`` used 1.0.
    The builders check too, for sections made without validation (``model_construct``)."""
    from dmlkit.config import LossConfig, MinerConfig
    from dmlkit.training.builders import build_loss, build_miner

    with pytest.raises(ConfigError, match=f"loss.params.margin {message}"):
        build_loss(LossConfig.model_construct(name="triplet", params={"margin": value}), 10, 16)
    with pytest.raises(ConfigError, match="miner.params.margin"):
        build_miner(MinerConfig.model_construct(name="semi_hard", params={"margin": value}))


@pytest.mark.parametrize(("overrides", "message"), [
    (["loss.name=ranked_list", "loss.params={alpha: .nan}", "miner=null"], "loss.params.alpha must be a finite number, got nan"),
    (["loss.params.margin=.nan"], "loss.params.margin must be a finite number, got nan"),
    (["miner.params.margin=-.inf"], "miner.params.margin must be a finite number, got -inf"),
    (["loss.params.margin=true"], r"loss.params.margin is a number \(default 0.2\), got true"),
])
def test_loss_and_miner_numbers_are_refused_when_the_config_is_read(tmp_path, overrides, message):
    """docs/configuration.md: such parameters "are refused when the config is read". They were
    read, and the next override's JSON dump turned NaN into None: the loss's default trained."""
    path = tmp_path / "c.yaml"
    path.write_text("data: {dataset: omniglot}\nloss: {name: triplet}\nminer: {name: semi_hard}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, overrides)


@pytest.mark.parametrize("value", ["False", "false", 0, 1, None])
def test_a_boolean_loss_parameter_takes_only_a_boolean(tmp_path, value):
    """``swap: "False"`` (a quoted boolean, a non-empty string) trained with the swap on; a
    boolean parameter of the untyped loss and miner sections takes true or false only."""
    from dmlkit.config import LossConfig
    from dmlkit.training.builders import build_loss

    with pytest.raises(ConfigError, match=r"loss.params.swap is true or false \(default false\)"):
        build_loss(LossConfig.model_construct(name="triplet", params={"swap": value}), 10, 16)
    path = tmp_path / "c.yaml"
    path.write_text("data: {dataset: omniglot}\nloss: {name: triplet}\n")
    with pytest.raises(ConfigError, match="loss.params.swap is true or false"):
        load_config(path, [f"loss.params.swap={yaml.safe_dump(value).splitlines()[0]}"])
    assert build_loss(LossConfig(name="triplet", params={"swap": True}), 10, 16).swap is True


def test_an_override_keeps_every_value_as_given():
    """``config.override`` (what ``train(data_root=...)`` does) and ``with_method`` rewrote a NaN
    parameter put into a read config as None; the copy must hold it and so refuse it."""
    config = config_from_dict(BASE)
    config.loss.params["margin"] = float("nan")  # a dict: not re-validated on assignment
    with pytest.raises(ConfigError, match="loss.params.margin must be a finite number, got nan"):
        config.override({"data.root": "/elsewhere"})
    with pytest.raises(ConfigError, match="loss.params.margin must be a finite number, got nan"):
        config_from_dict(BASE).with_method(config.loss)


def test_a_bench_method_parameter_must_be_finite():
    """A method's miner parameter is checked when the bench config is read (not turned into None)."""
    from pathlib import Path

    from dmlkit.protocol.config import load_bench_config

    path = Path(__file__).resolve().parents[1] / "configs" / "bench_quick.yaml"
    with pytest.raises(ConfigError, match="miner.params.epsilon must be a finite number, got nan"):
        load_bench_config(path, ["methods.2.miner.params.epsilon=.nan"])  # ms+miner


def test_a_search_range_must_be_finite():
    """``low: -.inf`` failed every trial after the bench directory was written."""
    from pathlib import Path

    from dmlkit.protocol.config import load_bench_config

    path = Path(__file__).resolve().parents[1] / "configs" / "bench_quick.yaml"
    with pytest.raises(ConfigError, match="finite number"):
        load_bench_config(path, ["methods.0.search.loss.pos_margin.low=-.inf"])


def test_a_new_preset_on_a_resolved_config_file_replaces_its_values(tmp_path):
    """A run's config.yaml holds its preset's values explicitly: ``--set optimizer.preset=...``
    on it changed only the label (Adam at 1e-3 trained as "reality_check"), where the Python
    override starts the section afresh. A hand-written section's explicit keys still win."""
    from dmlkit.config import apply_overrides, dump_config, load_config

    base = tmp_path / "base.yaml"
    base.write_text("name: t\ndata: {dataset: att_faces}\nloss: {name: triplet}\n")
    quick = load_config(base, ["optimizer.preset=cpu_quick"])
    path = tmp_path / "config.yaml"
    dump_config(quick, path)
    from_file = load_config(path, ["optimizer.preset=reality_check"])
    assert from_file.optimizer == apply_overrides(quick, ["optimizer.preset=reality_check"]).optimizer
    assert (from_file.optimizer.name, from_file.optimizer.trunk_lr) == ("rmsprop", 1e-6)
    path.write_text(base.read_text() + "optimizer: {preset: cpu_quick, trunk_lr: 0.5}\n")
    kept = load_config(path, ["optimizer.preset=reality_check"])
    assert (kept.optimizer.name, kept.optimizer.trunk_lr) == ("rmsprop", 0.5)


def test_a_new_preset_on_a_resolved_bench_config_replaces_its_values(tmp_path):
    """The bench's ``fixed.optimizer`` follows the same rule as an experiment's."""
    from pathlib import Path

    from dmlkit.protocol.config import dump_bench_config, load_bench_config

    source = Path(__file__).resolve().parents[1] / "configs" / "bench_quick.yaml"
    resolved = tmp_path / "config.yaml"
    resolved.write_text(dump_bench_config(load_bench_config(source)))
    switched = load_bench_config(resolved, ["fixed.optimizer.preset=reality_check"])
    assert (switched.fixed.optimizer.name, switched.fixed.optimizer.trunk_lr) == ("rmsprop", 1e-6)
