"""A new user's workflows of ``dmlkit bench`` / ``dmlkit compare`` (and ``dmlkit.protocol``):
what may change when a bench resumes (evaluation settings, seeds), refusals in one line before
anything is written, the statistics' arguments, and compare's checks that a results table and
the embedding files it reads agree."""

from __future__ import annotations

import copy

import pytest

from _reference import tiny_alphadigits_bench
from dmlkit.exceptions import ConfigError
from dmlkit.protocol.config import BenchConfig, bench_config_from_dict
from dmlkit.protocol.runner import Bench

TINY = tiny_alphadigits_bench(
    "tiny-newuser",
    {"num_classes": 16, "folds": 2, "trials": 2, "n_startup_trials": 1, "seeds": [0, 1, 2]},
    [{"name": "contrastive", "loss": {"name": "contrastive"}, "search": {"loss.neg_margin": {"low": 0.5, "high": 1.5}}}],
)


def _config(**fixed_changes: dict) -> BenchConfig:
    data = copy.deepcopy(TINY)
    for section, values in fixed_changes.items():
        data["fixed"].setdefault(section, {}).update(values)
    return bench_config_from_dict(data)


def test_resume_with_other_evaluation_memory_is_accepted(tmp_path):
    """`dmlkit bench --help` advises `--set fixed.evaluation.memory_mb=512` (a final stage out of
    memory): the bench directory refused it as "another config", so the user had to start the
    whole search again in a new directory. Settings that change neither the search nor the
    results (the kNN's memory and backend, the data's location) may change on resume; what the
    studies compare (training length, the evaluation batch) is still refused."""
    Bench(_config(), tmp_path).prepare()
    Bench(_config(evaluation={"memory_mb": 64, "backend": "torch"}), tmp_path).prepare()
    Bench(_config(data={"root": str(tmp_path / "elsewhere")}), tmp_path).prepare()
    assert "memory_mb: 64" not in (tmp_path / "config.yaml").read_text()  # the latest config is kept
    with pytest.raises(ConfigError, match="another config"):
        Bench(_config(training={"epochs": 2}), tmp_path).prepare()
    with pytest.raises(ConfigError, match="another config"):
        Bench(bench_config_from_dict({**TINY, "protocol": {**TINY["protocol"], "folds": 3}}), tmp_path).prepare()
    with pytest.raises(ConfigError, match="another config"):
        Bench(_config(evaluation={"batch_size": 7}), tmp_path).prepare()


def test_resume_with_other_cluster_restarts_is_refused(tmp_path):
    """NMI, AMI and F1 average fixed.evaluation.cluster_restarts k-means runs: a resume with
    another count would mix trials scored both ways, so it is another config (and another
    study), while the default count keeps the fingerprint earlier searches were keyed by."""
    assert "evaluation" not in _config().fixed_fingerprint()
    assert _config(evaluation={"cluster_restarts": 5}).fixed_fingerprint()["evaluation"] == {"cluster_restarts": 5}
    Bench(_config(), tmp_path).prepare()
    with pytest.raises(ConfigError, match="another config"):
        Bench(_config(evaluation={"cluster_restarts": 5}), tmp_path).prepare()


def test_final_stage_before_the_search_embeds_nothing(tmp_path, data_root):
    """`dmlkit bench CONFIG --stage final` before any search embedded the test classes with every
    pretrained fold model (seeds x folds networks, the largest cost on a real test set) and
    only then failed, on the first method, with a hint not in CLI spelling."""
    from dmlkit.exceptions import DmlkitError

    bench = Bench(_config(), tmp_path / "b", data_root=data_root)
    with pytest.raises(DmlkitError, match=r"run the search first \(`dmlkit bench CONFIG --stage search`"):
        bench.run(stage="final")
    assert not (tmp_path / "b" / "final").exists()


def test_too_small_num_classes_hints_at_num_classes(tmp_path, data_root):
    """`--set protocol.num_classes=6` with 2 folds on a 36-class dataset: the hint was "use a
    dataset with more classes" (this one has 36); it is now the fitting protocol.num_classes."""
    data = copy.deepcopy(TINY)
    data["protocol"]["num_classes"] = 6
    bench = Bench(bench_config_from_dict(data), tmp_path / "b", data_root=data_root)
    with pytest.raises(ConfigError, match=r"protocol.num_classes: 6 classes are too few") as info:
        bench.validate()
    assert "--set protocol.num_classes=8" in str(info.value)
    assert "use a dataset with more classes" not in str(info.value)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(("options", "message"), [
    ({"confidence": 95}, "confidence must be a fraction strictly between 0 and 1"),
    ({"confidence": 0.0}, "confidence must be a fraction strictly between 0 and 1"),
    ({"metrics": []}, "metrics must list at least one name"),
    ({"modes": []}, "modes must list at least one name"),
    ({"metrics": "map_at_r"}, r"metrics must be a list of names \(\['map_at_r'\]\)"),
])
def test_compare_results_refuses_unusable_options_in_one_line(tmp_path, options, message):
    """`compare_results(..., confidence=95)` (a percentage) failed inside numpy; confidence=0
    called a difference with Welch p = 0.6 significant (p < 1 - 0); no metrics or
    modes failed with IndexError / UnboundLocalError."""
    from dmlkit.protocol.compare import compare_results

    with pytest.raises(ConfigError, match=message):
        compare_results([tmp_path / "never-read"], methods=["a", "b"], **options)


def test_mean_ci_and_bootstraps_refuse_a_percentage_as_confidence():
    """`mean_ci(values, confidence=95)` returned a NaN half-width (t.ppf of 48), silently; the
    bootstraps failed inside numpy. The 95 % half-width itself matches t_{0.975, n-1} s / sqrt(n)."""
    import numpy as np

    from dmlkit.protocol.stats import mean_ci, paired_bootstrap, seed_query_t_test

    values = [0.31, 0.35, 0.30, 0.36]
    mean, half = mean_ci(values)
    expected = 3.182446305284263 * np.std(values, ddof=1) / 2.0  # t_{0.975, 3}, sqrt(4)
    assert mean == pytest.approx(0.33) and half == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ConfigError, match="confidence must be a fraction"):
        mean_ci(values, confidence=95)
    with pytest.raises(ConfigError, match="confidence must be a fraction"):
        seed_query_t_test(np.ones((3, 4)), np.zeros((3, 4)), confidence=95)
    with pytest.raises(ConfigError, match="resamples must be an integer from 1 to 1000000"):
        paired_bootstrap([1.0, 2.0], [1.0, 3.0], resamples=0)


def test_a_smaller_trial_budget_says_how_to_go_on(tmp_path):
    """A study grown with `--set protocol.trials=3`, rerun with the config's 2: the refusal named
    no way forward, though `--stage final` reads each method's first 2 trials (the documented
    way to build a table at the smaller budget)."""
    from dmlkit.protocol.study import make_storage, open_study

    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}")
    open_study(storage, "tiny/m", 3)
    with pytest.raises(ConfigError, match=r"cannot shrink it: search with --set protocol.trials=3, or build "
                                          r"the table from each method's first 2 trials with --stage final"):
        open_study(storage, "tiny/m", 2)


def test_the_package_exports_the_test_compare_uses():
    """`dmlkit.protocol` exported only `paired_bootstrap` (queries only) and described compare as
    that; compare uses `seed_query_t_test` (seeds and queries)."""
    import dmlkit.protocol as protocol

    assert "seed_query_t_test" in protocol.__all__
    assert "paired bootstrap over queries" not in (protocol.__doc__ or "")


def test_compare_pairs_benches_that_name_all_classes_differently(tmp_path):
    """One bench leaves protocol.num_classes out (all 60 classes), the other writes 60, as the
    preflight's `--set protocol.num_classes=N` hint does: the same test items, refused as
    "different test sets (protocol.num_classes None vs 60)". 30 classes are still refused."""
    import numpy as np

    from _reference import bench_entries
    from dmlkit.exceptions import DataError
    from dmlkit.protocol.compare import compare_results
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split

    def results(name: str, num_classes: int | None) -> dict:
        cfg = bench_config_from_dict({
            "name": name, "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
            "protocol": {"seeds": [0, 1, 2], "num_classes": num_classes},
            "methods": [{"name": "ms", "loss": {"name": "multi_similarity"}}]})
        split = make_bench_split(range(60), "halves", folds=2, num_classes=num_classes)
        entries = bench_entries(tmp_path / name, cfg, np.repeat(np.arange(10), 4), 10)
        return build_results(cfg, split, entries, bench_dir=tmp_path / name)

    report = compare_results([results("a", None), results("b", 60)], methods=["ms", "ms@b"],
                             metrics=["map_at_r"], modes=["separated"])
    assert report["comparisons"][0]["diff"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(DataError, match="protocol.num_classes 60 vs 30"):
        compare_results([results("a", None), results("c", 30)], methods=["ms", "ms@c"])


def test_an_out_path_that_is_a_file_is_one_clear_line(tmp_path, run_cli):
    """`dmlkit bench CONFIG -o results.txt` (an existing file) loaded and checked the data, then
    said "cannot access results.txt: File exists"."""
    import yaml

    config = tmp_path / "bench.yaml"
    config.write_text(yaml.safe_dump(TINY))
    (tmp_path / "afile").write_text("notes\n")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        code, _, err = run_cli(["bench", str(config), "-o", str(out), "--data-root", str(tmp_path / "none")])
        assert code == 2 and "Traceback" not in err
        assert f"{tmp_path / 'afile'} is a file; name a directory with --out" in " ".join(err.split())


def test_compare_refuses_embeddings_rewritten_after_the_table(tmp_path):
    """A grown search gives a new best; the next `--stage final` trains the stale runs again
    one by one and is interrupted: results.json still describes the old runs, and compare read
    the mix of new (retrained) and old fold models silently as that method. Each run's
    embeddings digest is now recorded, and a rewritten file is refused in one line."""
    import numpy as np

    from _reference import bench_entries
    from dmlkit.embeddings import load_embeddings, save_embeddings
    from dmlkit.exceptions import DataError
    from dmlkit.protocol.compare import compare_results
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split

    cfg = bench_config_from_dict({
        "name": "d", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2]},
        "methods": [{"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(tmp_path, cfg, np.repeat(np.arange(10), 4), 10)
    results = build_results(cfg, make_bench_split(range(60), "halves", folds=2), entries, bench_dir=tmp_path)
    assert all(len(run["embeddings_sha256"]) == 64 for run in results["methods"]["ms"]["runs"])
    options = {"methods": ["ms", "contrastive"], "metrics": ["map_at_r"]}
    before = compare_results([results], **options)["comparisons"][0]["diff"]
    path = entries["ms"]["runs"][0].embeddings  # seed 0 "retrained": other embeddings, same items
    emb, labels, _ = load_embeddings(path)
    save_embeddings(path, np.roll(emb, 1, axis=1), labels)
    with pytest.raises(DataError, match=r"is not the file the results table was computed on.*"
                                        r"rerun `dmlkit bench CONFIG --stage final`"):
        compare_results([results], **options)
    save_embeddings(path, emb, labels)  # the same values again: the table holds
    assert compare_results([results], **options)["comparisons"][0]["diff"] == before


def test_the_table_note_of_a_ratio_split_names_no_cross_validation(tmp_path):
    """results.md of `protocol.split: ratio_4_1_5` said "15 cross-validation classes in 1 folds":
    that split is one fixed train/validation split (Oi et al.), nothing is cross-validated."""
    import numpy as np

    from _reference import bench_entries
    from dmlkit.protocol.results import build_results, render_markdown
    from dmlkit.protocol.splits import make_bench_split

    cfg = bench_config_from_dict({
        "name": "r", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"split": "ratio_4_1_5", "folds": 1, "seeds": [0, 1, 2]},
        "methods": [{"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(tmp_path, cfg, np.repeat(np.arange(10), 4), 10)
    split = make_bench_split(range(30), "ratio_4_1_5", folds=1)
    note = render_markdown(build_results(cfg, split, entries, bench_dir=tmp_path)).splitlines()[-1]
    assert "Split: ratio_4_1_5 (15 training + validation classes in one fixed split, 15 test classes)" in note
    assert "cross-validation" not in note


def test_a_sqlite_storage_in_a_missing_folder_is_one_line_before_anything_is_written(tmp_path):
    """`--set protocol.storage=sqlite:///nodir/x.db`: the bench wrote its directory, then said
    "FileNotFoundError: ... nodir/x.lock; the file may be damaged or not an Optuna study"."""
    from dmlkit.protocol.study import make_storage

    data = copy.deepcopy(TINY)
    data["protocol"]["storage"] = f"sqlite:///{tmp_path / 'nodir' / 'x.db'}"
    bench = Bench(bench_config_from_dict(data), tmp_path / "b", data_root=tmp_path / "no-data")
    with pytest.raises(ConfigError, match=r"protocol.storage sqlite:///\S+x.db: the folder \S+nodir does not exist"):
        bench.run()
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="nodir does not exist; create it"):
        make_storage(f"sqlite:///{tmp_path / 'nodir' / 'x.db'}")


def test_more_seeds_on_resume_are_accepted(tmp_path):
    """compare's warning "too few to tell ... the Reality Check ran 5: protocol.seeds" advises
    more seeds; the bench directory refused `--set protocol.seeds=[0,1,2,3,4]` as "another
    config", so the user had to repeat the whole search. The seeds only choose final runs."""
    import yaml

    Bench(_config(), tmp_path).prepare()
    for seeds in ([0, 1, 2, 3, 4], [0, 1]):
        data = copy.deepcopy(TINY)
        data["protocol"]["seeds"] = seeds
        Bench(bench_config_from_dict(data), tmp_path).prepare()
        saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
        assert bench_config_from_dict(saved).protocol.seeds == seeds
