"""Security audit s42, the sites the first fixers did not own (F3, F6, F8 finished):

* F8: JSON nested 100,000 deep raised ``RecursionError`` (a traceback, or a crash where a
  corrupt file is skipped) in ``serve --verification``, a bench's ``split.json``, a class split
  file, the files of ``track build-data`` / ``patches build-data``, torchrun's rank files and a
  final run's ``failed.json``: each now reads it as it reads corrupt JSON.
* F3: the shard writer's ``.<shard>.tmp``, SiamFC's ``log.jsonl`` and the final-run and Optuna
  lock files were opened through a symbolic link planted out of their folder.
* F6: ``results.md`` wrote method names, metric names, split notes and warnings raw.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from dmlkit.exceptions import DataError

DEEP = '{"a":' * 100_000 + "1" + "}" * 100_000


def _deep(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DEEP)
    return path


# -- F8: deeply nested JSON reads as corrupt JSON ----------------------------------------------
def test_serve_verification_file_nested_too_deeply_is_one_data_error(tmp_path):
    from dmlkit.apps.service.config import ServiceConfig, load_threshold

    config = ServiceConfig(index=tmp_path / "index", verification=_deep(tmp_path / "v.json"))
    with pytest.raises(DataError, match=r"v\.json is not a valid verification file: nested too deeply"):
        load_threshold(config, {})
    (tmp_path / "v.json").write_text("{not json")  # corrupt: the same kind of line
    with pytest.raises(DataError, match=r"v\.json is not a valid verification file: Expecting"):
        load_threshold(config, {})


def test_bench_split_json_nested_too_deeply_is_one_data_error(tmp_path):
    from _reference import tiny_alphadigits_bench
    from dmlkit.protocol import Bench, bench_config_from_dict

    config = bench_config_from_dict(tiny_alphadigits_bench(
        "deep", {"num_classes": 16, "folds": 2, "trials": 1, "seeds": [0]},
        [{"name": "contrastive", "loss": {"name": "contrastive"}}]))
    bench = Bench(config, tmp_path / "b", data_root=tmp_path / "no-data")
    _deep(tmp_path / "b" / "split.json")
    with pytest.raises(DataError, match=r"split\.json is not a valid bench split file: nested too deeply"):
        bench.split()


def test_class_split_file_nested_too_deeply_is_one_data_error(tmp_path):
    from dmlkit.data import ClassSplit

    with pytest.raises(DataError, match="is not valid JSON: nested too deeply"):
        ClassSplit.from_json(_deep(tmp_path / "split.json"))


def test_rank_error_file_nested_too_deeply_is_skipped_as_a_corrupt_one(tmp_path):
    from dmlkit.protocol.launch import read_rank_error

    _deep(tmp_path / "error-rank1.json")
    (tmp_path / "error-rank0.json").write_text(json.dumps({"time": 1.0, "rank": 0, "error": "E: x"}))
    assert read_rank_error(tmp_path) == (0, "E: x")


def test_rank_result_and_spec_nested_too_deeply_are_one_data_error(tmp_path):
    from dmlkit.protocol.config import TorchrunSettings
    from dmlkit.protocol.launch import TorchrunLauncher, rank_main

    _deep(tmp_path / "result.json")
    with pytest.raises(DataError, match=r"result\.json is not a valid rank 0 result file: nested too deeply"):
        TorchrunLauncher(TorchrunSettings(), 2).collect(tmp_path, tmp_path)
    spec = _deep(tmp_path / "spec" / "spec.json")
    assert rank_main(spec) == 1  # the rank's one error line, as for a corrupt spec
    error = json.loads((spec.parent / "error-rank0.json").read_text())["error"]
    assert "is not a valid dmlkit launch spec: nested too deeply" in error


def test_failed_json_nested_too_deeply_reads_as_unreadable(tmp_path):
    from dmlkit.protocol.stages import FAILED_RUN, _recorded_failure

    _deep(tmp_path / FAILED_RUN)
    assert _recorded_failure(tmp_path) == f"diverged (its {FAILED_RUN} is unreadable)"


def test_patch_build_manifest_nested_too_deeply_reads_as_not_a_build(tmp_path):
    from dmlkit.apps.patches.brown import BUILD_MANIFEST, _check_build_finished

    (tmp_path / "liberty").mkdir()
    _deep(tmp_path / BUILD_MANIFEST)
    _check_build_finished(tmp_path / "liberty", "liberty")  # no manifest of a build: no check


def test_patch_rebuild_reads_a_manifest_nested_too_deeply_as_none(tmp_path):
    from dmlkit.apps.patches.offline import BUILD_MANIFEST, _earlier_subsets

    (tmp_path / "liberty").mkdir()
    _deep(tmp_path / BUILD_MANIFEST)
    assert _earlier_subsets(tmp_path) == {}


def test_track_build_meta_nested_too_deeply_reads_as_not_a_build(tmp_path):
    from dmlkit.apps.tracking.datasets import check_offline_build

    (tmp_path / "train").mkdir()
    _deep(tmp_path / "meta.json")
    check_offline_build(tmp_path / "train")  # not a build's meta.json: passes


# -- F3: no write or lock through a link planted out of the folder ----------------------------
def test_shard_tmp_file_is_not_written_through_a_planted_link(tmp_path):
    from dmlkit.embedding_shards import ShardWriter, open_shards

    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    nowhere = tmp_path / "created-outside.bin"
    writer = ShardWriter(tmp_path / "s", shard_rows=4)
    planted = [tmp_path / "s" / f".{key}-{writer._prefix}00000.npy.tmp" for key in ("embeddings", "labels")]
    planted[0].symlink_to(victim)
    planted[1].symlink_to(nowhere)  # dangling: not created either
    writer.append(np.ones((4, 3), np.float32), np.arange(4))
    writer.close()
    assert victim.read_bytes() == b"precious" and not nowhere.exists()
    shards = open_shards(tmp_path / "s")
    assert len(shards) == 4 and not any(p.is_symlink() for p in (tmp_path / "s").iterdir())


@pytest.mark.usefixtures("one_torch_thread")
def test_siamfc_log_is_not_written_through_a_planted_link(tmp_path):
    from _reference import siamfc_train_sequence, tiny_siamfc_config
    from dmlkit.apps.tracking.training import train_siamfc

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "provenance.json").write_text("{}")  # a received run folder
    (run / "log.jsonl").symlink_to(victim)
    with pytest.raises(DataError, match="is a symbolic link to .*outside its folder"):
        train_siamfc(tiny_siamfc_config(tmp_path, 1), run, sequences=[siamfc_train_sequence()], progress=False)
    assert victim.read_text() == "precious"


def test_final_run_claim_takeover_lock_is_not_opened_through_a_link(tmp_path):
    from dmlkit.protocol.stages import CLAIM_TAKEOVER, _claim

    run = tmp_path / "final" / "seed0"
    assert _claim(run)  # the claim exists now: a second claim takes the takeover lock
    outside = tmp_path / "outside.lock"
    (run.parent / CLAIM_TAKEOVER).symlink_to(outside)
    with pytest.raises(DataError, match="outside its folder"):
        _claim(run)
    assert not outside.exists()


def test_optuna_sqlite_lock_is_not_opened_through_a_link(tmp_path):
    from dmlkit.protocol.study import _sqlite_file_lock

    (tmp_path / "b").mkdir()
    outside = tmp_path / "outside.lock"
    (tmp_path / "b" / "study.lock").symlink_to(outside)
    with pytest.raises(DataError, match="outside its folder"), _sqlite_file_lock(f"sqlite:///{tmp_path}/b/study.db"):
        pass
    assert not outside.exists()
    (tmp_path / "b" / "study.lock").unlink()
    with _sqlite_file_lock(f"sqlite:///{tmp_path}/b/study.db"):  # a plain lock file: as before
        assert (tmp_path / "b" / "study.lock").is_file()


# -- F6: results.md writes what the results hold as literal markdown ---------------------------
HOSTILE = ["<script>alert(8)</script>|=cmd", "two\nlines|x", "[x](javascript:alert(1))"]


def _hostile_results() -> dict:
    cell = {"mean": 0.5, "ci95": 0.01, "n": 1, "values": [0.5]}
    row = {mode: {"map_at_r": cell, "<b>m|x</b>": cell} for mode in ("concatenated", "separated")}
    methods = {name: dict(row) for name in ["pretrained", *HOSTILE]}
    methods[HOSTILE[0]] |= {"seeds": [0], "seeds_failed": [1],
                            "failed_runs": [{"seed": 1, "fold": 0, "error": "nan <img src=x> | cell"}]}
    return {"metrics": ["map_at_r", "<b>m|x</b>"], "trials": 1, "seeds": [0, "<i>|"],
            "modes": {"concatenated": "<u>|", "separated": 8},
            "split": {"kind": "<s>|", "order": "sorted"}, "methods": methods,
            "config": {"methods": [{"name": "gone<script>|"}]}}


def test_results_md_keeps_every_text_of_the_results_literal():
    """Was: render_markdown wrote names, metric names, split notes and warnings raw: a
    ``<script>`` element in results.md and rows of more cells than the header."""
    from dmlkit.protocol.results import markdown_text, render_markdown

    md = render_markdown(_hostile_results())
    assert not re.search(r"<[a-z/]", md), md  # no raw tag at all
    lines = md.splitlines()
    table = [line for line in lines if line.startswith("|")]
    cells = [len(re.split(r"(?<!\\)\|", row)) for row in table]
    assert len(table) == 3 + 1 + len(HOSTILE) and len(set(cells)) == 1, table
    for name in HOSTILE:
        assert any(row.startswith(f"| {markdown_text(name)}") for row in table), name
    assert "Not in this table: gone&lt;script&gt;\\|" in md
    assert "Warning: " + markdown_text(HOSTILE[0]) + ": 1 final run(s) diverged" in md


def test_markdown_text_has_one_home():
    from dmlkit.protocol import compare, results

    assert compare.markdown_text is results.markdown_text
    assert results.missing_note({"methods": {}, "config": {"methods": [{"name": "a<b"}]}}).startswith(
        "Not in this table: a<b ")  # the HTML report escapes it itself
    assert os.path.basename(results.__file__) == "results.py"
