"""``dmlkit bench CONFIG --stage final -m A`` after a full bench, and final runs that diverge.

A subset final stage rewrote results.json / results.md with method A and the pretrained row
only, although the other methods' final runs were on disk and current; a final run whose loss
became NaN stopped the stage with one line, and every rerun failed the same way, so the bench
never produced a table. Tiny benches on real data (binary_alphadigits, 20 x 20)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import yaml

from _reference import Said, tiny_alphadigits_bench
from dmlkit.exceptions import DataError, NonFiniteError
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import load_results
from dmlkit.protocol.runner import Bench
from dmlkit.training import train

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = tiny_alphadigits_bench(
    "tiny-subset",
    {"num_classes": 16, "folds": 2, "trials": 1, "n_startup_trials": 1, "seeds": [0, 1]},
    [{"name": "contrastive", "loss": {"name": "contrastive"}}, {"name": "triplet", "loss": {"name": "triplet"}}],
    model={"embedding_size": 8}, sampler={"samples_per_class": 2, "batches_per_epoch": 1},
)



def _config(**protocol):
    data = copy.deepcopy(TINY)
    data["protocol"].update(protocol)
    return bench_config_from_dict(data)


@pytest.fixture(scope="module")
def full_bench(tmp_path_factory, data_root):
    """A finished tiny bench of both methods (nothing searched: the final stage only)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("full") / "bench"
    Bench(_config(), folder, data_root=data_root).run()
    torch.set_num_threads(before)
    return folder


def _copy(full_bench, tmp_path):
    folder = tmp_path / "bench"
    shutil.copytree(full_bench, folder)
    return folder


def _cells(results, name):
    row = results["methods"][name]
    return {(mode, m): row[mode][m]["mean"] for mode in ("concatenated", "separated") for m in results["metrics"]}


def test_a_final_stage_for_one_method_keeps_the_other_current_rows(full_bench, tmp_path, data_root):
    """The table of a subset final stage lost every other method although their final runs were
    current; now their rows are kept (evaluated again from the same files: the same numbers and
    embedding digests), the console says so, and compare reads the table."""
    from dmlkit.protocol.compare import compare_results

    folder = _copy(full_bench, tmp_path)
    before = load_results(folder)
    said = Said()
    results = Bench(_config(), folder, data_root=data_root, console=said).run(stage="final", methods=["triplet"])
    assert list(results["methods"]) == ["pretrained", "contrastive", "triplet"]
    assert "kept the rows of contrastive" in said.text
    after = load_results(folder)
    for name in ("contrastive", "triplet"):
        assert _cells(after, name) == pytest.approx(_cells(before, name), abs=1e-12)
        assert [r["embeddings_sha256"] for r in after["methods"][name]["runs"]] == \
            [r["embeddings_sha256"] for r in before["methods"][name]["runs"]]
        assert after["methods"][name]["runs"][0]["embeddings_sha256"]
    assert "| contrastive |" in (folder / "results.md").read_text()
    report = compare_results([folder], methods=["contrastive", "triplet"], metrics=["map_at_r"],
                             modes=["separated"])
    assert len(report["comparisons"]) == 1


def test_a_method_without_current_final_runs_is_left_out_and_named(full_bench, tmp_path, data_root):
    """More seeds than contrastive's final runs cover: its row would be over other seeds than
    the table says, so it is left out, and the console names it with the -m that trains it."""
    folder = _copy(full_bench, tmp_path)
    said = Said()
    # triplet's seed-2 runs really train (tiny); contrastive's are missing
    results = Bench(_config(seeds=[0, 1, 2]), folder, data_root=data_root, console=said).run(
        stage="final", methods=["triplet"])
    assert list(results["methods"]) == ["pretrained", "triplet"]
    assert "not in the table: contrastive (seed 2 fold 0 has no finished final run); add -m contrastive" in said.text


def _diverging(method: str, seed: int, fold: int, calls: list):
    """The real trainer, except that the final run of ``method``, ``seed``, ``fold`` diverges."""

    def train_fn(cfg, run_dir, **kwargs):
        calls.append(run_dir)
        if run_dir.parts[-3:] == (method, f"seed{seed}", f"fold{fold}"):
            raise NonFiniteError(f"the {cfg.loss.name} loss became nan at epoch 1, step 1: lower the "
                                 "learning rates (optimizer.*_lr)")
        return train(cfg, run_dir, **kwargs)

    return train_fn


def test_a_diverged_final_run_is_recorded_and_its_seed_left_out_with_a_warning(tmp_path, data_root):
    """One of triplet's final runs diverges: the stage stopped (every rerun too, so no table).
    Now the run is recorded in failed.json, the row is over the seed whose fold models all
    finished, labelled (1/2 seeds), with the error in results.json and a warning in results.md;
    a rerun keeps the failure without training anything again."""
    folder = tmp_path / "bench"
    calls: list = []
    said = Said()
    cfg = _config()
    with pytest.warns(UserWarning, match=r"triplet: 1 final run\(s\) diverged, in seed\(s\) \[1\]"):
        results = Bench(cfg, folder, data_root=data_root, console=said,  # warned: also said with -q
                        train_fn=_diverging("triplet", 1, 0, calls)).run(methods=["triplet"])
    row = results["methods"]["triplet"]
    assert row["seeds"] == [0] and row["seeds_failed"] == [1]
    (failed,) = row["failed_runs"]
    assert (failed["seed"], failed["fold"], failed["run_dir"]) == (1, 0, "final/triplet/seed1/fold0")
    assert "loss became nan" in failed["error"]
    assert {r["seed"] for r in row["runs"]} == {0}  # the table's runs: seed 1 is not half-used
    assert all(cell["n"] == 1 for mode in ("concatenated", "separated") for cell in row[mode].values())
    md = (folder / "results.md").read_text()
    assert "| triplet (1/2 seeds) |" in md and "Warning: triplet: 1 final run(s) diverged" in md
    assert "fixed.training.grad_clip=1.0" in said.text and "--out NEW" in said.text
    assert json.loads((folder / "final/triplet/seed1/fold0/failed.json").read_text())["seed"] == 1
    assert len(calls) == 4

    calls.clear()
    again = Bench(cfg, folder, data_root=data_root, console=Said(),
                  train_fn=_diverging("triplet", 1, 0, calls)).run(stage="final", methods=["triplet"])
    assert calls == []
    assert _cells(again, "triplet") == pytest.approx(_cells(results, "triplet"), abs=1e-12)
    # a subset final stage keeps the row with its failure
    said = Said()
    kept = Bench(cfg, folder, data_root=data_root, console=said, train_fn=_diverging("triplet", 1, 0, calls)
                 ).run(stage="final", methods=["contrastive"])
    assert kept["methods"]["triplet"]["seeds_failed"] == [1] and "kept the rows of triplet" in said.text
    assert load_results(folder)["methods"]["triplet"]["seeds"] == [0]
    from dmlkit.protocol.compare import compare_results

    report = compare_results([folder], methods=["contrastive", "triplet"], metrics=["map_at_r"],
                             modes=["separated"])
    assert report["seeds"] == {"contrastive": 2, "triplet": 1}  # the finished seeds, said
    assert "triplet: the final runs of seed(s) [1] diverged; it is compared over its 1 finished seed(s)" \
        in report["warnings"]
    # dmlkit report's table labels the row as results.md does
    from dmlkit.report.builder import ReportOptions, build_report

    page = build_report(folder, tmp_path / "report.html",
                        ReportOptions(maps=(), gallery_queries=1, thumbnails=False, max_points=200))
    text = page.read_text()
    assert "triplet (1/2 seeds)" in text and "Warning: triplet: 1 final run(s) diverged" in text
    triplet_row = text.split("<td>triplet (1/2 seeds)</td>")[1].split("</tr>")[0]
    assert 'class="best"' not in triplet_row  # not bolded as the best, as in results.md
    # a row over fewer seeds is never the column's best (bold)
    assert "| triplet (1/2 seeds) | " in (folder / "results.md").read_text()
    assert "**" not in (folder / "results.md").read_text().split("| triplet (1/2 seeds) |")[1].split("\n")[0]


def test_every_final_run_diverging_writes_the_table_and_exits_2(tmp_path, data_root, run_cli):
    """A real divergence (learning rate 1e30): exit 2 after the table is written, the row n/a,
    the error recorded; the rerun says the same without training again."""
    config = tmp_path / "bench.yaml"
    data = copy.deepcopy(TINY)
    data["fixed"]["optimizer"].update(trunk_lr=1e30, embedder_lr=1e30)
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "bench"
    recorded = []
    for _ in range(2):
        code, _, err = run_cli(["bench", str(config), "-o", str(out), "-m", "triplet", "-q",
                                "--data-root", str(data_root)])
        assert code == 2 and "Traceback" not in err, err
        line = " ".join(err.split())
        assert "every final run of triplet diverged (seed 0 fold 0: " in line and "--out NEW" in line
        md = (out / "results.md").read_text()
        assert "| triplet (0/2 seeds) | n/a |" in md
        recorded.append((out / "final/triplet/seed0/fold0/failed.json").stat().st_mtime_ns)
    assert recorded[0] == recorded[1]  # the rerun kept the failure, trained nothing again
    results = load_results(out)
    assert results["methods"]["triplet"]["seeds"] == [] and len(results["methods"]["triplet"]["failed_runs"]) == 4
    assert "nan" in results["methods"]["triplet"]["failed_runs"][0]["error"].lower()
    from dmlkit.exceptions import DataError
    from dmlkit.protocol.compare import compare_results

    with pytest.raises(DataError, match="every final run of method 'triplet' diverged"):
        compare_results([out], methods=["pretrained", "triplet"])


def test_a_rank_that_diverged_is_a_divergence_for_the_final_stage(tmp_path):
    """With protocol.launcher: torchrun, a diverged rank came back as a DistributedError, which
    the final stage cannot tell from a crash; it is now a NonFiniteError naming the rank (other
    rank errors stay DistributedError)."""
    import sys

    from dmlkit.distributed import DistributedError
    from dmlkit.protocol.config import TorchrunSettings
    from dmlkit.protocol.launch import TorchrunLauncher

    launcher = TorchrunLauncher(TorchrunSettings(), 2)

    def job(error: str) -> list[str]:
        path = tmp_path / "error-rank1.json"
        return [sys.executable, "-c", f"import json, sys, time; open({str(path)!r}, 'w').write(json.dumps("
                f"{{'rank': 1, 'time': time.time(), 'error': {error!r}}})); sys.exit(1)"]

    with pytest.raises(NonFiniteError, match=r"^rank 1 of 2: the triplet loss became nan"):
        launcher.run(job("NonFiniteError: the triplet loss became nan at epoch 1"), tmp_path, tmp_path)
    with pytest.raises(DistributedError, match=r"^rank 1 of 2 failed: DataError: no data"):
        launcher.run(job("DataError: no data"), tmp_path, tmp_path)


def _minimal_results(runs: list, **method: object) -> dict:
    cells = {m: {"mean": 0.5} for m in ("precision_at_1", "map_at_r")}
    return {"metrics": ["precision_at_1", "map_at_r"], "split": {"folds": 2},
            "methods": {"ms": {"concatenated": cells, "separated": cells, "runs": runs, **method}}}


@pytest.mark.parametrize(("runs", "method", "message"), [
    ([{"seed": "x", "fold": 0, "embeddings": "e.npz"}], {}, "integers, a path"),
    ([{"seed": 0, "fold": None, "embeddings": "e.npz"}], {}, "integers, a path"),
    ([{"seed": 0, "fold": 0, "embeddings": 5}], {}, "integers, a path"),
    ([{"seed": 0, "fold": 0, "embeddings": "a.npz"}], {}, r"seed 0: 'runs' list folds \[0\], not each of 0..1 once"),
    ([{"seed": 0, "fold": f, "embeddings": f"{f}.npz"} for f in (0, 1, 1)], {}, r"folds \[0, 1, 1\]"),
    ([], {"seeds_failed": 3}, "'seeds_failed' must be a list"),
    ([], {"loss": "multi_similarity"}, "'loss' must be a mapping or null"),
])
def test_a_hand_edited_results_file_is_one_error(tmp_path, runs, method, message):
    """Wrong types were tracebacks in compare and report; a seed missing a fold was concatenated
    from one 64-d fold model and compared as the 128-d concatenation (-2.91 points where the
    table said +0.81), a repeated run counted twice."""
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_minimal_results(runs, **method)))
    with pytest.raises(DataError, match=message):
        load_results(path)
    data = _minimal_results([])
    data["config"] = {"fixed": [1]}
    path.write_text(json.dumps(data))
    with pytest.raises(DataError, match="'config.fixed'"):
        load_results(path)


def test_a_metric_value_that_is_no_number_is_shown_as_none():
    from dmlkit.report.builder import _fmt

    assert (_fmt(True), _fmt(0.5), _fmt(float("nan")), _fmt(1)) == ("n/a", "50.00", "n/a", "100.00")
