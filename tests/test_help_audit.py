"""Options that did otherwise than their help and the docs say: a recorded data root hinted at
$DMLKIT_DATA, options given at their default value passed unchecked, and `fewshot --distance`
took names with other numbers than the two it documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dmlkit.apps import few_shot_accuracy, prototype_predict
from dmlkit.config import load_config
from dmlkit.data.datasets import DATA_ROOT_HINT
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError, DataNotFoundError
from dmlkit.training.builders import build_datasets
from dmlkit.training.data_root import load_config_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def emb_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(8), 10)
    path = tmp_path / "e.npz"
    save_embeddings(path, rng.normal(size=(80, 8)).astype(np.float32) + labels[:, None] * 0.3, labels)
    return path


# -- a run's recorded data.root: the not-found hint names it, not $DMLKIT_DATA --------------------

def test_missing_data_at_a_recorded_root_names_that_root_not_dmlkit_data(tmp_path):
    """`report`/`embed` of a run whose data moved said "Use --data-root / $DMLKIT_DATA": setting
    $DMLKIT_DATA changed nothing, the run's recorded data.root wins over it."""
    gone = str(tmp_path / "old_data_root")
    config = load_config(REPO / "configs" / "quickstart.yaml", [f"data.root={gone}"])
    with pytest.raises(DataNotFoundError) as run:
        build_datasets(config, ("test",))
    said = str(run.value)
    assert DATA_ROOT_HINT not in said and "$DMLKIT_DATA does not apply" in said
    assert f"data.root = {gone}" in said and said.endswith("use --data-root to point at the data.")
    with pytest.raises(DataNotFoundError) as new:  # a new run (train): --set changes the config's root
        load_config_dataset(config.data)
    assert DATA_ROOT_HINT not in str(new.value) and "--set data.root=PATH" in str(new.value)


def test_missing_data_at_an_explicit_root_keeps_the_generic_hint(tmp_path):
    config = load_config(REPO / "configs" / "quickstart.yaml", [f"data.root={tmp_path / 'old'}"])
    with pytest.raises(DataNotFoundError, match="Use --data-root / \\$DMLKIT_DATA"):
        build_datasets(config, ("test",), data_root=tmp_path / "new")


# -- options given at their default value are still given ----------------------------------------

def test_evaluate_refuses_k_at_its_default_value_without_a_k_metric(run_cli, emb_file):
    """`--k 1,2,4,8` (the default, spelled out) passed where `--k 8,4,2,1` was refused."""
    code, out, err = run_cli(["evaluate", str(emb_file), "-m", "map_at_r", "--k", "1,2,4,8", "--json"])
    assert code == 2 and out == "" and "--k" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run_cli(["evaluate", str(emb_file), "-m", "map_at_r", "--json"])  # not given: fine
    assert code == 0 and "map_at_r" in out


@pytest.mark.parametrize("extra", [["--overwrite"], ["--dtype", "float32"], ["--shard-rows", "65536"],
                                   ["--dtype", "float16"]])
def test_embed_refuses_shard_options_with_npz_even_at_their_defaults(run_cli, tmp_path, extra):
    code, out, err = run_cli(["embed", str(tmp_path / "no_run"), "-o", str(tmp_path / "e.npz"), *extra])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert extra[0] in err and "--format shards" in err


# -- fewshot --distance: the two documented rules only -------------------------------------------

@pytest.mark.parametrize("name", ["lp", "dot", "snr"])
def test_fewshot_refuses_distances_other_than_euclidean_and_cosine(run_cli, emb_file, name):
    """`lp` is the normalised Euclidean (cosine's ranking), not the documented squared Euclidean;
    dot and snr were accepted too, each with other numbers and no word."""
    code, out, err = run_cli(["fewshot", str(emb_file), "--episodes", "5", "--distance", name])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "'euclidean'" in err and "'cosine'" in err
    x, y = np.load(emb_file)["embeddings"], np.load(emb_file)["labels"]
    with pytest.raises(ConfigError, match="'euclidean'.*'cosine'"):
        few_shot_accuracy(x, y, 5, 1, 3, episodes=5, distance=name)
    with pytest.raises(ConfigError, match="'euclidean'.*'cosine'"):
        prototype_predict(x[:8], y[:8], x[8:], distance=name)


def test_fewshot_reads_the_two_distances_in_any_case(emb_file):
    x, y = np.load(emb_file)["embeddings"], np.load(emb_file)["labels"]
    assert (few_shot_accuracy(x, y, 5, 1, 3, episodes=20, distance="COSINE")
            == few_shot_accuracy(x, y, 5, 1, 3, episodes=20, distance="cosine"))
    assert (few_shot_accuracy(x, y, 5, 1, 3, episodes=20, distance=" Euclidean ")
            == few_shot_accuracy(x, y, 5, 1, 3, episodes=20, distance="euclidean"))
