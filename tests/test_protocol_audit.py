"""Protocol audit: seeds in numpy's range, the compare baseline and duplicates, YAML 1.2 numbers
in configs and ``--set`` values, the search budget behind the results table, and the search
parameters' checks. Everything here runs on small synthetic inputs (no training)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from _reference import bench_entries
from dmlkit.cli import app
from dmlkit.exceptions import ConfigError, DmlkitError
from dmlkit.protocol.compare import compare_results, relative_improvements
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.runner import Bench

BASE = {
    "name": "audit",
    "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
    "protocol": {"seeds": [0], "trials": 2},
    "methods": [{"name": "triplet", "loss": {"name": "triplet"},
                 "search": {"loss.margin": {"low": 0.01, "high": 1.0, "log": True}}}],
}


def _bench(**protocol) -> dict:
    return {**BASE, "protocol": {**BASE["protocol"], **protocol}}


# -- 3. seeds numpy refuses --------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [
    {"order_seed": -1}, {"sampler_seed": -1}, {"sampler_seed": 2**32}, {"seeds": [0, -1]},
    {"seeds": [2**32]},
])
def test_seeds_outside_numpys_range_are_config_errors(protocol):
    with pytest.raises(ConfigError, match="protocol"):
        bench_config_from_dict(_bench(**protocol))


def test_fixed_seed_outside_numpys_range_is_a_config_error():
    with pytest.raises(ConfigError, match="fixed.seed"):
        bench_config_from_dict({**BASE, "fixed": {**BASE["fixed"], "seed": -1}})


@pytest.mark.parametrize("key", ["seed", "data.split.seed"])
def test_training_seeds_outside_numpys_range_are_config_errors(key):
    from dmlkit.config import load_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["data.dataset=omniglot", "loss.name=triplet", f"{key}=-1"])
    assert load_config(None, ["data.dataset=omniglot", "loss.name=triplet", f"{key}={2**32 - 1}"])


def test_the_largest_seed_is_accepted_and_trial_sampler_seeds_stay_in_range():
    from dmlkit.protocol.runner import trial_sampler_seed
    from dmlkit.protocol.study import make_sampler

    cfg = bench_config_from_dict(_bench(sampler_seed=2**32 - 1, order_seed=2**32 - 1))
    for number in (0, 1, 5):
        seed = trial_sampler_seed(cfg.protocol.sampler_seed, number)
        assert 0 <= seed < 2**32
        make_sampler("tpe", seed, 1).reseed_rng()  # numpy accepts it
    assert trial_sampler_seed(0, 2) == 2 * 7919  # unchanged for every seed that fitted


def test_compare_refuses_a_negative_seed(tmp_path):
    result = CliRunner().invoke(app, ["compare", str(tmp_path), "--seed", "-1"])
    assert result.exit_code == 2 and "--seed" in result.output


# -- 4. the relative-improvement baseline ------------------------------------------------------
def _entry(loss: str, value: float) -> dict:
    cell = {"map_at_r": {"mean": value}}
    return {"loss": {"name": loss}, "concatenated": cell, "separated": cell}


def test_the_baseline_named_exactly_wins_over_a_variant_listed_first():
    methods = {"contrastive_xbm": _entry("contrastive", 0.20), "contrastive": _entry("contrastive", 0.10),
               "ms": _entry("multi_similarity", 0.12)}
    rel = relative_improvements(methods, ["map_at_r"])
    assert rel["contrastive"]["method"] == "contrastive"
    assert rel["contrastive"]["relative_percent"]["ms"]["separated"]["map_at_r"] == pytest.approx(20.0)


def test_a_variant_is_the_baseline_when_the_exact_name_is_absent():
    methods = {"contrastive_xbm": _entry("contrastive", 0.20), "ms": _entry("multi_similarity", 0.12)}
    assert relative_improvements(methods, ["map_at_r"])["contrastive"]["method"] == "contrastive_xbm"


def test_plot_improvement_uses_the_baseline_compare_uses(tmp_path, run_cli):
    """`dmlkit plot improvement` (and the report) looked for a method named exactly
    'contrastive': with only contrastive_xbm it refused ("none of the baselines"), while
    `compare` measured against it."""
    import json

    methods = {"contrastive_xbm": _entry("contrastive", 0.20), "ms": _entry("multi_similarity", 0.12)}
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods}))
    code, out, err = run_cli(["plot", "improvement", str(tmp_path / "results.json"), "-o",
                              str(tmp_path / "fig")])
    assert code == 0, err
    assert (tmp_path / "fig.png").is_file()


# -- 5. a method, metric or mode given twice ---------------------------------------------------
LABELS = np.repeat(np.arange(12), 4)


def _results(tmp_path) -> dict:
    from dmlkit.protocol.results import build_results
    from dmlkit.protocol.splits import make_bench_split

    cfg = bench_config_from_dict({**BASE, "protocol": {"seeds": [0, 1, 2], "trials": 1}, "methods": [
        {"name": "contrastive", "loss": {"name": "contrastive"}}, {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(tmp_path, cfg, LABELS, 12)
    return build_results(cfg, make_bench_split(range(24), "halves", folds=2), entries, bench_dir=tmp_path)


def test_compare_counts_a_method_metric_or_mode_given_twice_once(tmp_path):
    results = _results(tmp_path)
    report = compare_results([results], methods=["ms", "contrastive", "ms"], metrics=["map_at_r", "map_at_r"],
                             modes=["separated", "separated"])
    assert report["methods"] == ["ms", "contrastive"]
    assert [(c["a"], c["b"], c["mode"], c["metric"]) for c in report["comparisons"]] == [
        ("ms", "contrastive", "separated", "map_at_r")]
    with pytest.raises(ConfigError, match="at least two"):  # never a method against itself
        compare_results([results], methods=["ms", "ms"])


# -- 2. YAML 1.2 numbers in --set values and config files --------------------------------------
def test_set_values_read_scientific_floats_as_floats():
    from dmlkit.config import parse_overrides

    assert parse_overrides(["a=1e-3", "b=2e0", "c=-1E-3", "d=[1e-3, 1e-2]", "e=0", "f='1e-3'", "g=0o17"]) == {
        "a": 0.001, "b": 2.0, "c": -0.001, "d": [0.001, 0.01], "e": 0, "f": "1e-3", "g": 15}


@pytest.mark.parametrize("value", ["0200", "020", "[010, 011]", "-07"])
def test_a_leading_zero_set_value_is_refused_naming_the_key(value):
    from dmlkit.config import parse_overrides

    with pytest.raises(ConfigError, match=r"protocol\.num_classes.*leading zero: write \S*[1-9]"):
        parse_overrides([f"protocol.num_classes={value}"])


def test_untyped_params_get_floats_from_set(tmp_path):
    from dmlkit.protocol.config import load_bench_config

    path = tmp_path / "bench.yaml"
    path.write_text("fixed: {data: {dataset: omniglot}}\nmethods: [{name: ms, loss: {name: multi_similarity}}]\n")
    cfg = load_bench_config(path, ["methods.0.loss.params.alpha=2e0", "methods.0.loss.params.beta=1e1"])
    assert cfg.methods[0].loss.params == {"alpha": 2.0, "beta": 10.0}


def test_config_files_read_leading_zeros_as_decimal_and_exponents_as_floats(tmp_path):
    from dmlkit.protocol.config import load_bench_config

    path = tmp_path / "bench.yaml"
    path.write_text("fixed: {data: {dataset: omniglot}, sampler: {batches_per_epoch: 020}}\n"
                    "protocol: {seeds: [010, 011], num_classes: 0200}\n"
                    "methods: [{name: ms, loss: {name: multi_similarity, params: {alpha: 2e0}}}]\n")
    cfg = load_bench_config(path)
    assert (cfg.fixed.sampler.batches_per_epoch, cfg.protocol.seeds, cfg.protocol.num_classes) == (20, [10, 11], 200)
    assert cfg.methods[0].loss.params["alpha"] == 2.0


def test_saved_configs_quote_strings_that_look_like_numbers():
    from dmlkit.config import dump_config, load_config, load_yaml
    from dmlkit.protocol.config import dump_bench_config

    cfg = bench_config_from_dict({**BASE, "methods": [{"name": "t", "loss": {"name": "triplet"}, "search": {
        "loss.margin": {"type": "categorical", "choices": ["1e-3", 0.001, "010"]}}}]})
    again = bench_config_from_dict(load_yaml(dump_bench_config(cfg)))
    assert again.methods[0].search["loss.margin"].choices == ["1e-3", 0.001, "010"]
    exp = load_config(None, {"data.dataset": "omniglot", "loss.name": "triplet", "data.options": {"tag": "2e0"}})
    assert load_yaml(dump_config(exp))["data"]["options"] == {"tag": "2e0"}


# -- 1. the search budget behind the results table ---------------------------------------------
def _searched_bench(tmp_path, values: list[float | None], trials: int):
    """A bench whose triplet study ran ``values`` in trial order (``None``: a failed trial),
    opened with ``protocol.trials = trials``."""
    from optuna.trial import TrialState

    from dmlkit.protocol.study import open_study

    bench = Bench(bench_config_from_dict(_bench(trials=len(values))), tmp_path)
    method = bench.config.methods[0]
    study = open_study(bench.storage, bench.study_name(method), len(values), seed=0, n_startup_trials=1)
    for value in values:
        trial = study.ask()
        trial.suggest_float("loss.margin", 0.01, 1.0, log=True)
        study.tell(trial, value) if value is not None else study.tell(trial, state=TrialState.FAIL)
    return Bench(bench_config_from_dict(_bench(trials=trials)), tmp_path), method, study


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_the_best_trial_comes_from_the_first_protocol_trials_only(tmp_path):
    bench, method, study = _searched_bench(tmp_path, [0.30, 0.20, 0.90], trials=2)
    params, info = bench.best_params(method)
    assert info["trial"] == 0 and params == study.trials[0].params  # not trial 2 (0.90), past the budget
    assert (info["counted"], info["finished"], info["failed"], info["beyond_budget"]) == (2, 2, 0, 1)
    _, info = Bench(bench_config_from_dict(_bench(trials=3)), tmp_path).best_params(method)
    assert info["trial"] == 2 and info["beyond_budget"] == 0


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_failed_trials_use_up_the_budget(tmp_path):
    bench, method, _ = _searched_bench(tmp_path, [None, 0.20, 0.90], trials=2)
    _, info = bench.best_params(method)
    assert (info["trial"], info["finished"], info["failed"]) == (1, 1, 1)
    bench, method, _ = _searched_bench(tmp_path / "b", [None, None, 0.90], trials=2)
    with pytest.raises(DmlkitError, match="every search trial of 'triplet' failed"):
        bench.best_params(method)


def test_results_md_reports_each_methods_trials():
    from dmlkit.protocol.results import render_markdown

    cell = {"mean": 0.5, "ci95": None}
    row = {mode: {"map_at_r": cell} for mode in ("concatenated", "separated")}
    results = {"metrics": ["map_at_r"], "trials": 2, "seeds": [0], "split": {}, "methods": {
        "pretrained": {**row, "search": None},
        "triplet": {**row, "search": {"trial": 0, "counted": 2, "finished": 2, "failed": 0, "beyond_budget": 1}},
        "ms": {**row, "search": {"trial": 1, "counted": 2, "finished": 1, "failed": 1, "beyond_budget": 0}},
        "plain": {**row, "search": {"trials": 0}}}}
    line = render_markdown(results).splitlines()[-1]
    assert ("2 search trials per method (triplet 2 completed (the first 2 of 3 run); ms 1 completed, "
            "1 failed; plain nothing searched)") in line


# -- 6. search parameters that were silently misread --------------------------------------------
@pytest.mark.parametrize(("spec", "message"), [
    ({"type": "int", "low": 1, "high": 10, "step": 2.5}, "integer step"),
    ({"low": 0.1, "high": 1.0, "step": 0}, "step must be > 0"),
    ({"type": "int", "low": 1, "high": 10, "step": -1}, "step must be > 0"),
    ({"low": 0.1, "high": 1.0, "choices": [0.1, 0.5]}, "'choices' needs type: categorical"),
    ({"type": "int", "low": 1, "high": 3, "choices": [1, 3]}, "'choices' needs type: categorical"),
    ({"type": "categorical", "choices": [0.1, 0.5], "log": True}, "only 'choices', not log"),
    ({"type": "categorical", "choices": [0.1, 0.5], "low": 0.1, "high": 0.5}, "only 'choices', not low, high"),
])
def test_search_params_that_would_be_misread_are_refused(spec, message):
    data = {**BASE, "methods": [{"name": "t", "loss": {"name": "triplet"}, "search": {"loss.margin": spec}}]}
    with pytest.raises(ConfigError, match=message):
        bench_config_from_dict(data)


@pytest.mark.parametrize("seeds", [[True], [1, False]])
def test_protocol_seeds_refuse_booleans(seeds):
    with pytest.raises(ConfigError, match=r"protocol\.seeds"):
        bench_config_from_dict(_bench(seeds=seeds))


def test_a_saved_categorical_search_parameter_loads_again():
    from dmlkit.config import load_yaml
    from dmlkit.protocol.config import dump_bench_config

    data = {**BASE, "methods": [{"name": "t", "loss": {"name": "triplet"}, "search": {
        "loss.margin": {"type": "categorical", "choices": [0.1, 0.5]},
        "loss.swap": {"type": "int", "low": 0, "high": 1, "step": 1}}}]}
    cfg = bench_config_from_dict(data)
    assert bench_config_from_dict(load_yaml(dump_bench_config(cfg))) == cfg


# -- 7. pruned trials: a used-up slot, never a result -------------------------------------------
@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_pruned_trial_uses_up_its_slot_and_the_study_ends(tmp_path):
    """``run_worker`` records an ``optuna.TrialPruned`` as PRUNED: that slot is used (it is not
    re-run), so the study must count it, or it never reaches ``trials`` and the final stage
    refuses it for ever ("the search is not over")."""
    import optuna

    from dmlkit.protocol.study import count_completed, count_finished, open_study, run_worker

    bench = Bench(bench_config_from_dict(_bench(trials=3)), tmp_path)
    method = bench.config.methods[0]
    study = open_study(bench.storage, bench.study_name(method), 3, seed=0, n_startup_trials=1)

    def objective(trial):
        margin = trial.suggest_float("loss.margin", 0.01, 1.0, log=True)
        if trial.number == 1:
            raise optuna.TrialPruned()
        return 0.5 if trial.number == 0 else 0.25 + 0 * margin

    assert run_worker(study, objective) == 3
    assert (count_finished(study), count_completed(study)) == (3, 2)
    params, info = bench.best_params(method)
    assert info["trial"] == 0 and params == study.trials[0].params
    assert (info["counted"], info["finished"]) == (3, 2)


# -- 8. training seeds the protocol derives stay in numpy's range -------------------------------
@pytest.mark.parametrize(("fixed_seed", "seeds", "key"), [
    (2**32 - 1, [0], "fixed.seed"),         # the search's fold 1 trains with seed 2**32
    (0, [2**32 - 1], "protocol.seeds"),    # the final runs train with fixed.seed + 4 (s + 1) + f
    (2**32 - 5, [0], "lower fixed.seed"),  # the search fits, final seed 0 does not
])
def test_seeds_whose_run_seeds_overflow_are_refused_up_front(fixed_seed, seeds, key):
    """Accepted, they failed every search trial past fold 0, or the final stage after the whole
    search; every derived seed must be one numpy (and the training config) accepts."""
    data = {**_bench(seeds=seeds), "fixed": {**BASE["fixed"], "seed": fixed_seed}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        bench_config_from_dict(data)


def test_the_largest_accepted_seeds_give_run_seeds_training_accepts():
    from dmlkit.protocol.stages import run_seed

    folds = 4
    cfg = bench_config_from_dict({**_bench(seeds=[3]), "fixed": {**BASE["fixed"], "seed": 7}})
    assert run_seed(cfg, 3, 2) == 7 + folds * (3 + 1) + 2  # the formula the docs state
    assert [cfg.search_seed(f) for f in range(folds)] == [7, 8, 9, 10]
    top = 2**32 // folds - 2  # fixed.seed 0: its last final seed is 2**32 - 1
    cfg = bench_config_from_dict(_bench(seeds=[top]))
    method = cfg.methods[0]
    cfg.experiment(method, seed=run_seed(cfg, top, folds - 1))  # the final stage's last run
    assert run_seed(cfg, top, folds - 1) == 2**32 - 1
    with pytest.raises(ConfigError, match=rf"protocol\.seeds .* use seeds up to {top}"):
        bench_config_from_dict(_bench(seeds=[top + 1]))
    fixed = {**BASE["fixed"], "seed": 2**32 - 2 * folds}  # the largest fixed.seed with seed 0
    cfg = bench_config_from_dict({**_bench(seeds=[0]), "fixed": fixed})
    cfg.experiment(method, seed=cfg.search_seed(folds - 1))  # the search's last fold
    cfg.experiment(method, seed=run_seed(cfg, 0, folds - 1))


# -- 9. a resumed search reproduces the uninterrupted one ---------------------------------------
def _search(tmp_path, kill_at: int | None) -> list[tuple[float, float]]:
    """``(x, value)`` of the completed trials of a 4-trial TPE search (2 start-up trials),
    seeded per trial as ``Bench.search`` does; ``kill_at``: the trial whose worker is killed
    (a ``KeyboardInterrupt`` leaves it RUNNING), after which the search is resumed."""
    from optuna.trial import TrialState

    from dmlkit.protocol.runner import trial_sampler_seed
    from dmlkit.protocol.study import (
        fail_running_trials,
        make_sampler,
        make_storage,
        open_study,
        run_worker,
    )

    tmp_path.mkdir()
    study = open_study(make_storage(f"sqlite:///{tmp_path / 'study.db'}"), "s", 4, seed=0, n_startup_trials=2)
    kill = {"at": kill_at}

    def objective(trial):
        x = trial.suggest_float("x", -2.0, 2.0)
        if trial.number == kill["at"]:
            kill["at"] = None
            raise KeyboardInterrupt
        return -((x - 0.5) ** 2)

    def sampler(number):
        return make_sampler("tpe", trial_sampler_seed(0, number), 2)

    if kill_at is not None:
        with pytest.raises(KeyboardInterrupt):
            run_worker(study, objective, sampler_factory=sampler)
        assert fail_running_trials(study) == 1
    run_worker(study, objective, sampler_factory=sampler)
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return [(t.params["x"], t.value) for t in sorted(done, key=lambda t: t.datetime_complete)]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_search_resumed_after_a_kill_samples_what_the_uninterrupted_one_did(tmp_path):
    """The interrupted trial's retry must run before the later slots: run after them (it was
    the newest WAITING trial), the later slots' TPE saw one finished trial fewer and sampled
    other points, so the benchmark's outcome depended on whether its search was interrupted."""
    assert _search(tmp_path / "b", kill_at=1) == _search(tmp_path / "a", kill_at=None)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_the_budget_holds_the_retry_of_an_interrupted_slot_not_a_later_slot(tmp_path):
    """A bench killed in trial 1 and resumed with more trials (``--set protocol.trials=5``)
    queues the new slot (4) before trial 1's retry (5). Read back with the original budget of 4,
    the best must come from slots 0-3 (trial 1 being its retry), not from slot 4."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    from dmlkit.protocol.study import open_study

    bench = Bench(bench_config_from_dict(_bench(trials=5)), tmp_path)
    method = bench.config.methods[0]
    study = open_study(bench.storage, bench.study_name(method), 0, seed=0)
    dist = {"loss.margin": FloatDistribution(0.01, 1.0, log=True)}
    rows = [(0.30, TrialState.COMPLETE, {}), (None, TrialState.FAIL, {}), (0.20, TrialState.COMPLETE, {}),
            (0.10, TrialState.COMPLETE, {}), (0.95, TrialState.COMPLETE, {}),
            (0.50, TrialState.COMPLETE, {"failed_trial": 1, "retry_history": [1]})]
    for i, (value, state, system) in enumerate(rows):
        study.add_trial(optuna.create_trial(state=state, value=value, params={"loss.margin": 0.01 * (i + 1)},
                                            distributions=dist, system_attrs=system))
    params, info = Bench(bench_config_from_dict(_bench(trials=4)), tmp_path).best_params(method)
    assert (info["trial"], params["loss.margin"]) == (5, 0.06)  # the retry of slot 1, not slot 4
    assert (info["counted"], info["beyond_budget"]) == (4, 1)


def test_the_config_check_tries_a_stepped_range_at_the_end_optuna_samples():
    """1..10 step 4 samples 1, 5, 9 (Optuna's grid): the check must not try 10, which a loss may
    refuse while every sampled value is fine; floats alike (0.1..1.0 step 0.4 ends at 0.9)."""
    import optuna

    from dmlkit.protocol.config import SearchParam
    from dmlkit.protocol.space import search_corners, suggest

    space = {"loss.k": SearchParam(type="int", low=1, high=10, step=4),
             "loss.m": SearchParam(type="float", low=0.1, high=1.0, step=0.4)}
    low, high = search_corners(space)
    assert (low["loss.k"], high["loss.k"]) == (1, 9)
    assert low["loss.m"] == 0.1 and high["loss.m"] == pytest.approx(0.9)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    with pytest.warns(UserWarning):  # Optuna's own "not divisible by step" (it adjusts high)
        seen = {tuple(sorted(suggest(study.ask(), space).items())) for _ in range(40)}
    assert max(dict(p)["loss.k"] for p in seen) == 9 and max(dict(p)["loss.m"] for p in seen) <= 0.9 + 1e-9
