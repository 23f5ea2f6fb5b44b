"""ExperimentConfig: validation messages, presets, overrides, YAML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dmlkit.config import (
    FIXED_SECTIONS,
    ExperimentConfig,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
)
from dmlkit.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[1]
#: configs/ files that are not experiment configs: benchmark configs (tests/test_protocol_config.py)
#: and the app configs of patch matching and tracking (validated by their apps' tests).
OTHER_CONFIG_PREFIXES = ("bench_", "patches_", "siamfc_")
EXPERIMENT_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                            if not p.name.startswith(OTHER_CONFIG_PREFIXES))
MINIMAL = {"data": {"dataset": "omniglot"}, "loss": {"name": "triplet"}}


def test_defaults_are_the_reality_check_settings():
    cfg = config_from_dict(MINIMAL)
    assert cfg.optimizer.preset == "reality_check"
    assert cfg.optimizer.name == "rmsprop"
    assert cfg.optimizer.trunk_lr == cfg.optimizer.embedder_lr == 1e-6
    assert (cfg.sampler.classes_per_batch, cfg.sampler.samples_per_class) == (8, 4)
    assert cfg.sampler.batch_size == 32
    assert cfg.model.embedding_size == 128 and cfg.model.normalize and cfg.model.freeze_batchnorm
    assert cfg.model.trunk == "bn_inception"
    assert cfg.miner is None
    assert "map_at_r" in cfg.training.eval_metrics


def test_preset_fills_only_missing_keys():
    cfg = config_from_dict({**MINIMAL, "optimizer": {"preset": "cpu_quick", "embedder_lr": 0.01}})
    assert cfg.optimizer.name == "adam"
    assert cfg.optimizer.embedder_lr == 0.01
    assert cfg.optimizer.trunk_lr == 1e-3


def test_unknown_key_names_the_key():
    with pytest.raises(ConfigError) as err:
        config_from_dict({**MINIMAL, "model": {"embeding_size": 64}})
    assert "model.embeding_size" in str(err.value)
    assert "unknown key (did you mean 'embedding_size'?" in str(err.value)
    assert "valid: " in str(err.value) and "normalize" in str(err.value)


def test_unknown_key_lists_the_valid_keys_of_nested_sections():
    with pytest.raises(ConfigError) as err:
        config_from_dict({**MINIMAL, "data": {**MINIMAL["data"], "split": {"kindd": "ratio"}}})
    assert "data.split.kindd: unknown key (did you mean 'kind'? valid: kind, order, path, ratios, seed, val_fraction)" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config_from_dict({**MINIMAL, "zzz": 1})
    assert "zzz: unknown key (valid: data," in str(err.value)


def test_application_configs_report_keys_as_the_experiment_config_does(tmp_path):
    """The patch and SiamFC configs, and the patch training settings, go through the same
    formatter: a misspelt key gets the closest valid name, a missing file one line."""
    from dmlkit.apps.patches.protocol import load_patch_config
    from dmlkit.apps.patches.training import TrainSettings
    from dmlkit.apps.tracking.training import SiamFCTrainConfig

    path = tmp_path / "typo.yaml"
    path.write_text("training:\n  epoch: 1\n")
    with pytest.raises(ConfigError, match=r"training.epoch: unknown key \(did you mean 'epochs'\?"):
        load_patch_config(path)
    with pytest.raises(ConfigError, match=r"training: unknown key \(valid: batch_size, data_dir,"):
        SiamFCTrainConfig.from_yaml(path)
    with pytest.raises(ConfigError, match=r"epochs: Input should be greater than or equal to 1 \(got 0\)"):
        TrainSettings(epochs=0)
    for load in (load_patch_config, SiamFCTrainConfig.from_yaml):
        with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
            load(tmp_path / "missing.yaml")


def test_bad_value_names_the_key_and_value():
    with pytest.raises(ConfigError) as err:
        config_from_dict({**MINIMAL, "optimizer": {"name": "adagrad"}})
    assert "optimizer.name" in str(err.value) and "adagrad" in str(err.value)
    with pytest.raises(ConfigError, match="sampler.classes_per_batch"):
        config_from_dict({**MINIMAL, "sampler": {"classes_per_batch": 0}})
    with pytest.raises(ConfigError, match=r"data\b"):
        config_from_dict({"loss": {"name": "triplet"}})


def test_split_kind_checks():
    with pytest.raises(ConfigError, match="ratios"):
        config_from_dict({**MINIMAL, "data": {"dataset": "x", "split": {"kind": "ratio"}}})
    with pytest.raises(ConfigError, match="path"):
        config_from_dict({**MINIMAL, "data": {"dataset": "x", "split": {"kind": "file"}}})
    cfg = config_from_dict({**MINIMAL, "data": {"dataset": "x", "split": {"kind": "ratio", "ratios": [4, 1, 5]}}})
    assert cfg.data.split.ratios == (4, 1, 5)


def test_overrides_parse_yaml_values_and_create_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    cfg = load_config(path, [
        "loss.params.margin=0.2",
        "miner.name=semi_hard",
        "training.eval_metrics=[precision_at_1, map_at_r]",
        "training.grad_clip=1e-1",
        "model.weights=null",
    ])
    assert cfg.loss.params == {"margin": 0.2}
    assert cfg.miner is not None and cfg.miner.name == "semi_hard"
    assert cfg.training.eval_metrics == ["precision_at_1", "map_at_r"]
    assert cfg.training.grad_clip == pytest.approx(0.1)
    assert parse_overrides(["a.b=[1, 2]", "c=yes", "d="]) == {"a.b": [1, 2], "c": True, "d": None}


def test_an_override_ending_in_a_colon_stays_text():
    # YAML reads `x:` as {x: null}: --set protocol.storage=sqlite:///:memory: failed as 'a valid string'
    assert parse_overrides(["s=sqlite:///:memory:", "t=x:", "m={a: 1}", "n={a: }", "u=a: 1"]) == {
        "s": "sqlite:///:memory:", "t": "x:", "m": {"a": 1}, "n": {"a": None}, "u": {"a": 1}}


def test_bad_overrides():
    cfg = config_from_dict(MINIMAL)
    with pytest.raises(ConfigError, match="key.sub=value"):
        apply_overrides(cfg, ["training.epochs"])
    with pytest.raises(ConfigError, match="training.epochs"):
        apply_overrides(cfg, ["training.epochs=-3"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides(cfg, ["seed.x=1"])
    with pytest.raises(ConfigError, match="training.epoch"):
        apply_overrides(cfg, ["training.epoch=3"])


def test_switching_preset_on_a_resolved_config():
    cfg = config_from_dict(MINIMAL)
    quick = apply_overrides(cfg, ["optimizer.preset=cpu_quick"])
    assert quick.optimizer.name == "adam" and quick.optimizer.embedder_lr == 1e-3
    both = cfg.override({"optimizer.preset": "cpu_quick", "optimizer.loss_lr": 0.5})
    assert both.optimizer.loss_lr == 0.5


def test_dump_load_round_trip(tmp_path):
    cfg = load_config(None, [
        "data.dataset=omniglot", "loss.name=arcface", "loss.params={margin: 0.3}",
        "optimizer.preset=cpu_quick", "optimizer.loss_lr=0.01", "seed=7",
    ])
    text = dump_config(cfg, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again == cfg
    assert yaml.safe_load(text)["optimizer"]["loss_lr"] == 0.01


def test_with_method_keeps_the_fixed_part():
    cfg = config_from_dict({**MINIMAL, "model": {"embedding_size": 64}, "miner": {"name": "batch_hard"}})
    other = cfg.with_method({"name": "arcface", "params": {"margin": 0.5}})
    assert other.loss.name == "arcface" and other.miner is None
    assert other.fixed_part() == cfg.fixed_part()
    assert set(cfg.fixed_part()) == set(FIXED_SECTIONS)


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


@pytest.mark.parametrize("name", EXPERIMENT_CONFIGS)
def test_shipped_configs_validate(name):
    cfg = load_config(REPO / "configs" / name)
    assert isinstance(cfg, ExperimentConfig)


@pytest.mark.parametrize("name", EXPERIMENT_CONFIGS)
def test_shipped_configs_name_real_losses_and_miners(name):
    from dmlkit.training import build_loss, build_miner

    cfg = load_config(REPO / "configs" / name)
    miner = build_miner(cfg)
    loss = build_loss(cfg, num_classes=10, embedding_size=cfg.model.embedding_size, miner=miner)
    assert loss is not None
    assert (miner is None) == (cfg.miner is None)
