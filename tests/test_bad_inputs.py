"""The guard of issue 11: every command, fed bad input, says so in one line and exits 2.

One parametrized table feeds each ``dmlkit`` command (the list comes from the CLI itself, so a
new command without a case fails :func:`test_every_command_has_bad_input_cases`) missing,
misplaced, empty, truncated, corrupt and non-UTF-8 files, NaN/Inf and wrongly shaped
embeddings, fractional/NaN labels, ``k <= 0`` and unknown names. Each run goes through
:func:`dmlkit.cli.main` in-process (the real error handling, not typer's test runner) and must:

* exit with code 2 (a user error; 130 only for interrupts, tested in ``test_cli_interrupts``),
* print exactly one non-empty line on stderr, with no ``Traceback``,
* print nothing on stdout: never a metric computed from bad input.

A few inputs are legitimate and must give a *correct* number instead (string labels are class
names): :func:`test_string_labels_are_class_names_not_an_error`.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
import yaml

from dmlkit import cli
from dmlkit.apps.patches.protocol import PatchExperimentConfig
from dmlkit.cli import app, main
from dmlkit.exceptions import CheckpointError

REPO = Path(__file__).resolve().parents[1]

N_CLASSES, PER_CLASS, DIM = 4, 6, 8


def _save_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Tiny good and bad inputs, built once for the whole module."""
    return build_inputs(tmp_path_factory.mktemp("bad_inputs"))


def build_inputs(d: Path) -> Path:
    """Write the good and bad input files into ``d``."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(N_CLASSES), PER_CLASS)
    emb = (rng.standard_normal((labels.size, DIM)) + 3 * np.eye(N_CLASSES, DIM)[labels]).astype(np.float32)
    good = _save_npz(d / "good.npz", embeddings=emb, labels=labels)
    np.save(d / "good.npy", emb)
    (d / "labels.txt").write_text("\n".join(map(str, labels)) + "\n")
    _save_npz(d / "other_ids.npz", embeddings=emb, labels=labels, ids=np.array([f"q{i}" for i in range(labels.size)]))
    # shard directories: a write killed before its manifest, a manifest without "dim"
    from dmlkit.embedding_shards import MANIFEST, write_shards

    (d / "shards_killed").mkdir()
    np.save(d / "shards_killed" / "embeddings-00000.npy", emb)
    write_shards(d / "shards_nodim", emb, labels)
    write_shards(d / "shards_good", emb, labels)
    manifest = json.loads((d / "shards_nodim" / MANIFEST).read_text())
    del manifest["dim"]
    (d / "shards_nodim" / MANIFEST).write_text(json.dumps(manifest))
    # numbers that read as garbage
    nan = emb.copy()
    nan[3] = np.nan
    _save_npz(d / "nan.npz", embeddings=nan, labels=labels)
    _save_npz(d / "allnan.npz", embeddings=np.full_like(emb, np.nan), labels=labels)
    inf = emb.copy()
    inf[0, 0] = np.inf
    _save_npz(d / "inf.npz", embeddings=inf, labels=labels)
    np.save(d / "nan.npy", nan)
    _save_npz(d / "emb1d.npz", embeddings=emb[:, 0], labels=labels)
    _save_npz(d / "emb3d.npz", embeddings=emb[:, :, None], labels=labels)
    _save_npz(d / "wide.npz", embeddings=np.hstack([emb, emb]), labels=labels)  # wrong dimension
    _save_npz(d / "empty_rows.npz", embeddings=np.zeros((0, DIM), np.float32), labels=np.zeros(0, int))
    # labels that read as garbage
    _save_npz(d / "floatlab.npz", embeddings=emb, labels=(labels % 10) / 10 + 0.05)
    nanlab = labels.astype(float)
    nanlab[2] = np.nan
    _save_npz(d / "nanlab.npz", embeddings=emb, labels=nanlab)
    _save_npz(d / "shortlab.npz", embeddings=emb, labels=labels[:-3])
    _save_npz(d / "boollab.npz", embeddings=emb, labels=labels % 2 == 0)
    _save_npz(d / "nolab.npz", embeddings=emb)
    _save_npz(d / "strlab.npz", embeddings=emb, labels=np.array([f"class_{c}" for c in labels]))
    (d / "floatlines.txt").write_text("0.5\n" * labels.size)
    (d / "badutf8.txt").write_bytes(b"\xff\xfe\xfa\n" * labels.size)
    (d / "shortlabels.txt").write_text("0\n1\n")
    # files that are not what they claim
    (d / "empty.npz").write_bytes(b"")
    blob = good.read_bytes()
    (d / "trunc.npz").write_bytes(blob[: len(blob) // 2])
    (d / "garbage.npz").write_bytes(rng.bytes(512))
    (d / "adir.npz").mkdir()
    _save_npz(d / "pickled.npz", embeddings=emb, labels=np.array([object()] * labels.size, dtype=object))
    torch.save({"embeddings": torch.from_numpy(emb), "labels": torch.from_numpy(labels)}, d / "good.pt")
    blob = (d / "good.pt").read_bytes()
    (d / "trunc.pt").write_bytes(blob[: len(blob) // 2])
    (d / "garbage.pt").write_bytes(rng.bytes(512))
    (d / "emb.csv").write_text("1,2,3\n")
    # configs
    (d / "badutf8.yaml").write_bytes(b"name: \xff\xfe\n")
    (d / "bad.yaml").write_text("name: [unclosed\n")
    (d / "list.yaml").write_text("- 1\n- 2\n")
    (d / "empty.yaml").write_text("")
    (d / "unknown_key.yaml").write_text("name: x\nno_such_section: {a: 1}\n")
    (d / "adir.yaml").mkdir()
    # results / logs
    (d / "corrupt.json").write_text('{"methods": {"a": ')
    # inputs that a command is asked to write its output over (each its own: before the guard,
    # the case destroyed it)
    for name in ("victim_evaluate.npz", "victim_reid.npz"):
        shutil.copy(good, d / name)
    (d / "victim_results.json").write_text('{"methods": {}}')
    (d / "list.json").write_text("[1, 2, 3]")
    (d / "badutf8.json").write_bytes(b'{"methods": "\xff"}')
    (d / "nan_results.json").write_text('{"methods": {"a": {"concatenated": {"map_at_r": NaN}}}}')
    (d / "cell_results.json").write_text('{"methods": {"contrastive": {"concatenated": [0.5]}, '
                                         '"b": {"concatenated": {"map_at_r": {"mean": "abc"}}}}}')
    bench = d / "bench"
    bench.mkdir()
    (bench / "results.json").write_text('{"methods": {"a": ')
    for name, row in (("patch_results_no_arch", {"train": "a", "test": "b"}),  # an architecture missing
                      ("patch_results_null", {"train": "a", "test": "b", "2ch": {"fpr95": None}})):
        (d / name).mkdir()
        (d / name / "results.json").write_text(json.dumps(
            {"architectures": ["2ch"], "rows": [row], "mean": {"2ch": {"fpr95": 0.1}}}))
    run = d / "run_corrupt_log"
    run.mkdir()
    (run / "log.jsonl").write_text('not a log\n{"step": 2, "lo\n')
    run = d / "run_badutf8_log"
    run.mkdir()
    (run / "log.jsonl").write_bytes(b'{"step": 1, "loss": \xff}\n')
    (d / "emptydir").mkdir()
    from PIL import Image

    (d / "frames").mkdir()
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(d / "frames" / f"{i:04d}.png")
    clip = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(2)]
    clip[0].save(d / "victim_clip.gif", save_all=True, append_images=clip[1:])  # a video to track
    run = d / "run_trunc_ckpt"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "quickstart.yaml", run / "config.yaml")
    (run / "checkpoints" / "best.pt").write_bytes((d / "trunc.pt").read_bytes())
    (run / "checkpoints" / "last.pt").write_bytes((d / "trunc.pt").read_bytes())
    run = d / "run_bad_config"
    run.mkdir()
    (run / "config.yaml").write_text("name: [unclosed\n")
    # an index to query
    _run(["index", str(good), "-o", str(d / "index.npz")])
    (d / "garbage_index.npz").write_bytes(rng.bytes(512))
    _run(["index", str(good), "-o", str(d / "damaged_index_dir")])
    (d / "damaged_index_dir" / "vectors.npy").write_bytes(rng.bytes(512))
    return d


def _run(argv: list[str]) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``dmlkit ARGV`` through the real entry point."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
    return code, out.getvalue(), err.getvalue()


#: A count no option may take (10**23 - 1): every count option has an upper bound.
HUGE = "99999999999999999999999"

# (id, argv); "{d}" is the fixture directory. Every command of `dmlkit --help` appears.
CASES: list[tuple[str, list[str]]] = [
    # evaluate
    ("evaluate-missing", ["evaluate", "{d}/missing.npz"]),
    ("evaluate-directory", ["evaluate", "{d}/adir.npz"]),
    ("evaluate-empty-file", ["evaluate", "{d}/empty.npz"]),
    ("evaluate-truncated-npz", ["evaluate", "{d}/trunc.npz"]),
    ("evaluate-garbage-npz", ["evaluate", "{d}/garbage.npz"]),
    ("evaluate-pickled-npz", ["evaluate", "{d}/pickled.npz"]),
    ("evaluate-truncated-pt", ["evaluate", "{d}/trunc.pt"]),
    ("evaluate-garbage-pt", ["evaluate", "{d}/garbage.pt"]),
    ("evaluate-unsupported-suffix", ["evaluate", "{d}/emb.csv"]),
    ("evaluate-nan-row", ["evaluate", "{d}/nan.npz"]),
    ("evaluate-all-nan", ["evaluate", "{d}/allnan.npz"]),
    ("evaluate-inf", ["evaluate", "{d}/inf.npz"]),
    ("evaluate-1d", ["evaluate", "{d}/emb1d.npz"]),
    ("evaluate-3d", ["evaluate", "{d}/emb3d.npz"]),
    ("evaluate-no-rows", ["evaluate", "{d}/empty_rows.npz"]),
    ("evaluate-wrong-dim-reference", ["evaluate", "{d}/good.npz", "-r", "{d}/wide.npz"]),
    ("evaluate-unknown-device", ["evaluate", "{d}/good.npz", "--device", "tpu9"]),
    ("evaluate-float-labels", ["evaluate", "{d}/floatlab.npz"]),
    ("evaluate-nan-labels", ["evaluate", "{d}/nanlab.npz"]),
    ("evaluate-bool-labels", ["evaluate", "{d}/boollab.npz"]),
    ("evaluate-short-labels", ["evaluate", "{d}/shortlab.npz"]),
    ("evaluate-no-labels", ["evaluate", "{d}/nolab.npz"]),
    ("evaluate-npy-without-labels", ["evaluate", "{d}/good.npy"]),
    ("evaluate-float-label-lines", ["evaluate", "{d}/good.npy", "--labels", "{d}/floatlines.txt"]),
    ("evaluate-non-utf8-labels", ["evaluate", "{d}/good.npy", "--labels", "{d}/badutf8.txt"]),
    ("evaluate-short-labels-file", ["evaluate", "{d}/good.npy", "--labels", "{d}/shortlabels.txt"]),
    ("evaluate-missing-labels-file", ["evaluate", "{d}/good.npy", "--labels", "{d}/missing.txt"]),
    ("evaluate-k0", ["evaluate", "{d}/good.npz", "--k", "0", "-m", "recall_at_k"]),
    ("evaluate-k-negative", ["evaluate", "{d}/good.npz", "--k", "-3", "-m", "recall_at_k"]),
    ("evaluate-k-not-int", ["evaluate", "{d}/good.npz", "--k", "one"]),
    ("evaluate-unknown-metric", ["evaluate", "{d}/good.npz", "-m", "accuracy"]),
    ("evaluate-unknown-distance", ["evaluate", "{d}/good.npz", "-d", "bogus"]),
    ("evaluate-unknown-backend", ["evaluate", "{d}/good.npz", "--backend", "bogus"]),
    ("evaluate-memory-0", ["evaluate", "{d}/good.npz", "--memory-mb", "0"]),
    ("evaluate-per-class-into-directory", ["evaluate", "{d}/good.npz", "--per-class", "{d}/emptydir"]),
    # index / query
    ("index-missing", ["index", "{d}/missing.npz", "-o", "{d}/out_index.npz"]),
    ("index-directory", ["index", "{d}/adir.npz", "-o", "{d}/out_index.npz"]),
    ("index-corrupt", ["index", "{d}/garbage.npz", "-o", "{d}/out_index.npz"]),
    ("index-truncated", ["index", "{d}/trunc.npz", "-o", "{d}/out_index.npz"]),
    ("index-nan", ["index", "{d}/nan.npz", "-o", "{d}/out_index.npz"]),
    ("index-nan-npy", ["index", "{d}/nan.npy", "-o", "{d}/out_index.npz"]),
    ("index-1d", ["index", "{d}/emb1d.npz", "-o", "{d}/out_index.npz"]),
    ("index-float-labels", ["index", "{d}/floatlab.npz", "-o", "{d}/out_index.npz"]),
    ("index-unknown-distance", ["index", "{d}/good.npz", "-o", "{d}/out_index.npz", "--distance", "bogus"]),
    ("index-unknown-kind", ["index", "{d}/good.npz", "-o", "{d}/out_index.npz", "--kind", "bogus"]),
    ("index-add-to-missing", ["index", "{d}/good.npz", "-o", "{d}/missing_index.npz", "--add"]),
    ("index-add-wrong-dim", ["index", "{d}/wide.npz", "-o", "{d}/index.npz", "--add"]),
    ("index-over-its-input", ["index", "{d}/good.npz", "-o", "{d}/good.npz"]),
    ("index-over-embeddings", ["index", "{d}/good.npz", "-o", "{d}/wide.npz"]),
    ("index-add-its-own-file", ["index", "{d}/index.npz", "-o", "{d}/index.npz", "--add"]),
    ("evaluate-per-class-over-its-input", ["evaluate", "{d}/victim_evaluate.npz", "--per-class", "{d}/victim_evaluate.npz"]),
    ("evaluate-empty-k", ["evaluate", "{d}/good.npz", "--k", ","]),
    ("reid-output-over-its-input", ["reid", "{d}/victim_reid.npz", "-o", "{d}/victim_reid.npz"]),
    ("compare-output-over-its-results", ["compare", "{d}/victim_results.json", "-o", "{d}/victim_results.json"]),
    ("query-output-over-its-queries", ["query", "{d}/index.npz", "{d}/good.npz", "-o", "{d}/good.npz"]),
    ("query-output-over-its-index", ["query", "{d}/index.npz", "{d}/good.npz", "-o", "{d}/index.npz"]),
    ("query-k0", ["query", "{d}/index.npz", "{d}/good.npz", "-k", "0"]),
    ("query-k-negative", ["query", "{d}/index.npz", "{d}/good.npz", "-k", "-2"]),
    ("query-missing-queries", ["query", "{d}/index.npz", "{d}/missing.npz"]),
    ("query-directory-queries", ["query", "{d}/index.npz", "{d}/adir.npz"]),
    ("query-corrupt-queries", ["query", "{d}/index.npz", "{d}/garbage.npz"]),
    ("query-nan-queries", ["query", "{d}/index.npz", "{d}/nan.npz"]),
    ("query-wrong-dim", ["query", "{d}/index.npz", "{d}/wide.npz"]),
    ("query-missing-index", ["query", "{d}/missing_index.npz", "{d}/good.npz"]),
    ("query-corrupt-index", ["query", "{d}/garbage_index.npz", "{d}/good.npz"]),
    ("query-unknown-id", ["query", "{d}/index.npz", "--id", "no-such-item"]),
    ("query-limit-negative", ["query", "{d}/index.npz", "{d}/good.npz", "--limit", "-1"]),
    ("query-no-rows", ["query", "{d}/index.npz", "{d}/empty_rows.npz"]),
    ("query-exclude-self-other-ids", ["query", "{d}/index.npz", "{d}/other_ids.npz", "--exclude-self"]),
    ("evaluate-killed-shard-write", ["evaluate", "{d}/shards_killed"]),
    ("evaluate-shard-manifest-without-dim", ["evaluate", "{d}/shards_nodim"]),
    ("index-shard-manifest-without-dim", ["index", "{d}/shards_nodim", "-o", "{d}/out_index"]),
    ("index-nprobe-0", ["index", "{d}/good.npz", "-o", "{d}/out_index", "--kind", "ivf_flat", "--nprobe", "0"]),
    ("index-nprobe-negative", ["index", "{d}/good.npz", "-o", "{d}/out_index", "--kind", "ivf_flat",
                               "--nprobe", "-3"]),
    ("index-nlist-0", ["index", "{d}/good.npz", "-o", "{d}/out_index", "--kind", "ivf_flat", "--nlist", "0"]),
    # verify / fewshot / oneshot
    ("verify-missing", ["verify", "{d}/missing.npz"]),
    ("verify-corrupt", ["verify", "{d}/garbage.npz"]),
    ("verify-nan", ["verify", "{d}/nan.npz"]),
    ("verify-all-nan", ["verify", "{d}/allnan.npz"]),
    ("verify-float-labels", ["verify", "{d}/floatlab.npz"]),
    ("verify-unknown-distance", ["verify", "{d}/good.npz", "--distance", "bogus"]),
    ("verify-pairs-0", ["verify", "{d}/good.npz", "--pairs", "0"]),
    ("verify-folds-1", ["verify", "{d}/good.npz", "--folds", "1"]),
    ("verify-missing-pair-list", ["verify", "{d}/good.npz", "--pair-list", "{d}/missing.txt"]),
    ("verify-non-utf8-pair-list", ["verify", "{d}/good.npz", "--pair-list", "{d}/badutf8.txt"]),
    ("fewshot-missing", ["fewshot", "{d}/missing.npz"]),
    ("fewshot-corrupt", ["fewshot", "{d}/trunc.npz"]),
    ("fewshot-all-nan", ["fewshot", "{d}/allnan.npz"]),
    ("fewshot-float-labels", ["fewshot", "{d}/floatlab.npz"]),
    ("fewshot-too-many-ways", ["fewshot", "{d}/good.npz", "--way", "50"]),
    ("fewshot-way-0", ["fewshot", "{d}/good.npz", "--way", "0"]),
    ("fewshot-shot-0", ["fewshot", "{d}/good.npz", "--shot", "0"]),
    ("fewshot-episodes-0", ["fewshot", "{d}/good.npz", "--episodes", "0"]),
    ("fewshot-unknown-distance", ["fewshot", "{d}/good.npz", "--distance", "bogus"]),
    ("oneshot-missing-checkpoint", ["oneshot", "{d}/missing_run", "--data-root", "{d}/emptydir"]),
    ("oneshot-truncated-checkpoint", ["oneshot", "{d}/run_trunc_ckpt", "--data-root", "{d}/emptydir"]),
    ("oneshot-garbage-checkpoint", ["oneshot", "{d}/garbage.pt", "--data-root", "{d}/emptydir"]),
    # compare / report / plot
    ("compare-missing", ["compare", "{d}/missing.json"]),
    ("compare-corrupt", ["compare", "{d}/corrupt.json"]),
    ("compare-list", ["compare", "{d}/list.json"]),
    ("compare-non-utf8", ["compare", "{d}/badutf8.json"]),
    ("compare-corrupt-bench-dir", ["compare", "{d}/bench"]),
    ("compare-empty-dir", ["compare", "{d}/emptydir"]),
    ("compare-out-unknown-suffix", ["compare", "{d}/nan_results.json", "-o", "{d}/cmp.txt"]),
    ("report-missing", ["report", "{d}/missing_run"]),
    ("report-empty-dir", ["report", "{d}/emptydir"]),
    ("report-a-file", ["report", "{d}/good.npz"]),
    ("report-corrupt-bench", ["report", "{d}/bench"]),
    ("report-bad-config", ["report", "{d}/run_bad_config"]),
    ("report-unknown-map", ["report", "{d}/run_trunc_ckpt", "--maps", "bogus"]),
    ("plot-map-nan", ["plot", "map", "{d}/nan.npz", "-o", "{d}/fig"]),
    ("plot-per-class-shards", ["plot", "per-class", "{d}/shards_good", "-o", "{d}/fig"]),
    ("evaluate-recall-at-0", ["evaluate", "{d}/good.npz", "-m", "recall_at_0"]),
    ("plot-map-corrupt", ["plot", "map", "{d}/garbage.npz", "-o", "{d}/fig"]),
    ("plot-map-unknown-method", ["plot", "map", "{d}/good.npz", "--method", "bogus", "-o", "{d}/fig"]),
    ("plot-histograms-nan", ["plot", "histograms", "{d}/nan.npz", "-o", "{d}/fig"]),
    ("plot-histograms-missing", ["plot", "histograms", "{d}/missing.npz", "-o", "{d}/fig"]),
    ("plot-histograms-bins-0", ["plot", "histograms", "{d}/good.npz", "--bins", "0", "-o", "{d}/fig"]),
    ("plot-per-class-nan", ["plot", "per-class", "{d}/nan.npz", "-o", "{d}/fig"]),
    ("plot-per-class-float-labels", ["plot", "per-class", "{d}/floatlab.npz", "-o", "{d}/fig"]),
    ("plot-gallery-inf", ["plot", "gallery", "{d}/inf.npz", "-o", "{d}/fig"]),
    ("plot-gallery-k0", ["plot", "gallery", "{d}/good.npz", "--k", "0", "-o", "{d}/fig"]),
    ("plot-curves-missing", ["plot", "curves", "{d}/missing_run", "-o", "{d}/fig"]),
    ("plot-curves-corrupt-log", ["plot", "curves", "{d}/run_corrupt_log", "-o", "{d}/fig"]),
    ("plot-curves-non-utf8-log", ["plot", "curves", "{d}/run_badutf8_log", "-o", "{d}/fig"]),
    ("plot-improvement-corrupt", ["plot", "improvement", "{d}/corrupt.json", "-o", "{d}/fig"]),
    ("plot-improvement-cell-no-number", ["plot", "improvement", "{d}/cell_results.json", "-o", "{d}/fig"]),
    ("plot-improvement-list", ["plot", "improvement", "{d}/list.json", "-o", "{d}/fig"]),
    ("plot-improvement-nan", ["plot", "improvement", "{d}/nan_results.json", "-o", "{d}/fig"]),
    ("plot-improvement-directory", ["plot", "improvement", "{d}/emptydir", "-o", "{d}/fig"]),
    ("plot-improvement-unknown-mode", ["plot", "improvement", "{d}/nan_results.json", "--mode", "bogus",
                                       "-o", "{d}/fig"]),
    # train / bench / embed / export
    ("train-missing-config", ["train", "{d}/missing.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-directory-config", ["train", "{d}/adir.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-non-utf8-config", ["train", "{d}/badutf8.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-bad-yaml", ["train", "{d}/bad.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-list-yaml", ["train", "{d}/list.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-unknown-key", ["train", "{d}/unknown_key.yaml", "--run-dir", "{d}/runs/t"]),
    ("train-bad-override", ["train", "configs/quickstart.yaml", "--run-dir", "{d}/runs/t",
                            "--set", "model.embedding_size=abc"]),
    ("train-unknown-override-key", ["train", "configs/quickstart.yaml", "--run-dir", "{d}/runs/t",
                                    "--set", "training.no_such_key=1"]),
    ("train-override-without-equals", ["train", "configs/quickstart.yaml", "--run-dir", "{d}/runs/t",
                                       "--set", "training.epochs"]),
    ("train-missing-data", ["train", "configs/quickstart.yaml", "--run-dir", "{d}/runs/t",
                            "--data-root", "{d}/emptydir"]),
    ("bench-missing-config", ["bench", "{d}/missing.yaml", "-o", "{d}/runs/b"]),
    ("bench-non-utf8-config", ["bench", "{d}/badutf8.yaml", "-o", "{d}/runs/b"]),
    ("bench-bad-yaml", ["bench", "{d}/bad.yaml", "-o", "{d}/runs/b"]),
    ("bench-directory-config", ["bench", "{d}/adir.yaml", "-o", "{d}/runs/b"]),
    ("bench-unknown-key", ["bench", "{d}/unknown_key.yaml", "-o", "{d}/runs/b"]),
    ("bench-list-yaml", ["bench", "{d}/list.yaml", "-o", "{d}/runs/b"]),
    ("bench-unknown-stage", ["bench", "configs/bench_quick.yaml", "-o", "{d}/runs/b", "--stage", "bogus"]),
    ("embed-missing", ["embed", "{d}/missing_run"]),
    ("embed-dtype-without-shards", ["embed", "{d}/run_trunc_ckpt", "--dtype", "float16"]),
    ("embed-empty-dir", ["embed", "{d}/emptydir"]),
    ("embed-truncated-checkpoint", ["embed", "{d}/run_trunc_ckpt", "--data-root", "{d}/emptydir"]),
    ("embed-garbage-checkpoint", ["embed", "{d}/garbage.pt"]),
    ("embed-unknown-split", ["embed", "{d}/run_trunc_ckpt", "--split", "bogus"]),
    ("export-missing", ["export", "{d}/missing_run"]),
    ("export-truncated-checkpoint", ["export", "{d}/run_trunc_ckpt", "--data-root", "{d}/emptydir"]),
    ("export-unknown-format", ["export", "{d}/run_trunc_ckpt", "--format", "bogus"]),
    ("serve-missing-index", ["serve", "--index", "{d}/missing_index.npz", "--port", "1"]),
    ("serve-corrupt-index", ["serve", "--index", "{d}/garbage_index.npz", "--port", "1"]),
    # reid
    ("reid-missing", ["reid", "{d}/missing.npz"]),
    ("reid-corrupt", ["reid", "{d}/garbage.npz"]),
    ("reid-no-groups", ["reid", "{d}/good.npz"]),
    ("reid-nan-gallery", ["reid", "{d}/good.npz", "--gallery", "{d}/nan.npz"]),
    ("reid-wrong-dim-gallery", ["reid", "{d}/good.npz", "--gallery", "{d}/wide.npz"]),
    ("reid-float-labels", ["reid", "{d}/floatlab.npz", "--gallery", "{d}/good.npz"]),
    ("reid-unknown-metric", ["reid", "{d}/good.npz", "--gallery", "{d}/good.npz", "-d", "bogus"]),
    ("reid-unknown-ap-mode", ["reid", "{d}/good.npz", "--gallery", "{d}/good.npz", "--ap-mode", "bogus"]),
    ("reid-bad-ranks", ["reid", "{d}/good.npz", "--gallery", "{d}/good.npz", "--ranks", "0"]),
    ("reid-empty-run-dir", ["reid", "{d}/emptydir"]),
    ("reid-run-dir-bad-config", ["reid", "{d}/run_bad_config"]),
    # patches
    ("patches-train-missing-config", ["patches", "train", "{d}/missing.yaml", "-o", "{d}/runs/p"]),
    ("patches-evaluate-no-test-pairs", ["patches", "evaluate", "{d}/runs/p", "--rescore", "--max-test-pairs", "0"]),
    ("patches-train-bad-yaml", ["patches", "train", "{d}/bad.yaml", "-o", "{d}/runs/p"]),
    ("patches-train-non-utf8", ["patches", "train", "{d}/badutf8.yaml", "-o", "{d}/runs/p"]),
    ("patches-train-unknown-key", ["patches", "train", "{d}/unknown_key.yaml", "-o", "{d}/runs/p"]),
    ("patches-train-missing-data", ["patches", "train", "configs/patches_offline.yaml", "-o", "{d}/runs/p",
                                    "--data-root", "{d}/emptydir"]),
    ("patches-evaluate-missing", ["patches", "evaluate", "{d}/missing_run"]),
    ("patches-evaluate-empty-dir", ["patches", "evaluate", "{d}/emptydir"]),
    ("patches-evaluate-corrupt-results", ["patches", "evaluate", "{d}/bench"]),
    ("patches-evaluate-results-without-an-architecture", ["patches", "evaluate", "{d}/patch_results_no_arch"]),
    ("patches-evaluate-results-null-fpr95", ["patches", "evaluate", "{d}/patch_results_null"]),
    ("patches-build-data-unknown-subset", ["patches", "build-data", "-o", "{d}/runs/pd", "--subset", "bogus"]),
    ("patches-build-data-points-0", ["patches", "build-data", "-o", "{d}/runs/pd", "--points", "0"]),
    # track
    ("track-missing-frames", ["track", "--frames", "{d}/missing_frames", "--init-box", "1,2,3,4",
                              "--method", "ncc"]),
    ("track-empty-frames", ["track", "--frames", "{d}/emptydir", "--init-box", "1,2,3,4", "--method", "ncc"]),
    ("track-bad-box", ["track", "--frames", "{d}/emptydir", "--init-box", "1,2,3", "--method", "ncc"]),
    ("track-unknown-method", ["track", "--frames", "{d}/frames", "--init-box", "1,2,3,4",
                              "--method", "bogus"]),
    ("track-truncated-weights", ["track", "--frames", "{d}/frames", "--init-box", "1,2,3,4",
                                 "--weights", "{d}/trunc.pt"]),
    ("track-siamfc-without-weights", ["track", "--frames", "{d}/frames", "--init-box", "1,2,3,4"]),
    ("track-fps-0", ["track", "--frames", "{d}/frames", "--init-box", "1,2,3,4", "--method", "ncc",
                     "--fps", "0", "--out", "{d}/track.gif"]),
    ("track-box-outside-frame", ["track", "--frames", "{d}/frames", "--init-box", "100,100,3,4",
                                 "--method", "ncc"]),
    ("track-train-missing-config", ["track", "train", "{d}/missing.yaml", "-o", "{d}/runs/s"]),
    ("track-train-bad-yaml", ["track", "train", "{d}/bad.yaml", "-o", "{d}/runs/s"]),
    ("track-train-non-utf8", ["track", "train", "{d}/badutf8.yaml", "-o", "{d}/runs/s"]),
    ("track-train-unknown-key", ["track", "train", "{d}/unknown_key.yaml", "-o", "{d}/runs/s"]),
    ("track-evaluate-missing", ["track", "evaluate", "{d}/missing_root", "--methods", "ncc"]),
    ("track-evaluate-empty", ["track", "evaluate", "{d}/emptydir", "--methods", "ncc"]),
    ("track-evaluate-unknown-dataset", ["track", "evaluate", "{d}/emptydir", "--dataset", "bogus",
                                        "--methods", "ncc"]),
    ("track-evaluate-unknown-method", ["track", "evaluate", "{d}/emptydir", "--methods", "bogus"]),
    ("track-build-data-bad-size", ["track", "build-data", "{d}/runs/td", "--size", "big"]),
    # files that are no video (imageio's numpy plugin reads .npz: an empty one was "aborted", exit 130)
    ("track-frames-empty-npz", ["track", "--frames", "{d}/empty.npz", "--init-box", "1,2,3,4", "--method", "ncc"]),
    ("track-frames-garbage-npz", ["track", "--frames", "{d}/garbage.npz", "--init-box", "1,2,3,4", "--method", "ncc"]),
    ("track-frames-embeddings-npz", ["track", "--frames", "{d}/good.npz", "--init-box", "1,2,3,4", "--method", "ncc"]),
    ("track-output-over-its-video", ["track", "--frames", "{d}/victim_clip.gif", "--init-box", "1,2,3,4",
                                     "--method", "ncc", "-o", "{d}/victim_clip.gif"]),
    ("track-boxes-over-its-video", ["track", "--frames", "{d}/victim_clip.gif", "--init-box", "1,2,3,4",
                                    "--method", "ncc", "--boxes", "{d}/victim_clip.gif"]),
    # counts beyond dmlkit.limits (or a module's own bound): tracebacks, allocations or endless loops
    ("bench-threads-huge", ["bench", "configs/bench_quick.yaml", "-o", "{d}/runs/b", "--threads", HUGE]),
    ("track-threads-huge", ["track", "--frames", "{d}/frames", "--init-box", "1,2,3,4", "--method", "untrained",
                            "--threads", HUGE]),
    ("track-evaluate-threads-huge", ["track", "evaluate", "{d}/emptydir", "--methods", "ncc", "--threads", HUGE]),
    ("track-train-threads-huge", ["track", "train", "configs/siamfc_offline.yaml", "-o", "{d}/runs/s",
                                  "--data-dir", "{d}/emptydir", "--set", f"threads={HUGE}"]),
    ("patches-train-threads-huge", ["patches", "train", "configs/patches_offline.yaml", "-o", "{d}/runs/p",
                                    "--data-root", "{d}/emptydir", "--set", f"training.threads={HUGE}"]),
    ("plot-histograms-bins-huge", ["plot", "histograms", "{d}/good.npz", "--bins", HUGE, "-o", "{d}/fig"]),
    ("patches-build-data-pairs-huge", ["patches", "build-data", "-o", "{d}/runs/pd", "--train-pairs", HUGE]),
    ("patches-build-data-views-huge", ["patches", "build-data", "-o", "{d}/runs/pd", "--views", HUGE]),
    ("track-build-data-frames-huge", ["track", "build-data", "{d}/runs/td", "--frames", HUGE]),
    ("track-build-data-train-huge", ["track", "build-data", "{d}/runs/td", "--train", HUGE]),
    ("export-opset-huge", ["export", "{d}/run_trunc_ckpt", "--opset", HUGE]),
    ("export-opset-0", ["export", "{d}/run_trunc_ckpt", "--opset", "0"]),
    ("fewshot-episodes-huge", ["fewshot", "{d}/good.npz", "--episodes", HUGE]),
    # a damaged index: np.load's "pickled (object) data ... allow_pickle" sent users after a setting
    ("index-add-to-corrupt-index", ["index", "{d}/good.npz", "-o", "{d}/garbage_index.npz", "--add"]),
    ("query-corrupt-index-directory", ["query", "{d}/damaged_index_dir", "{d}/good.npz"]),
    # options that would be silently unused or mean a default
    ("evaluate-restarts-without-clustering", ["evaluate", "{d}/good.npz", "-m", "map_at_r", "--restarts", "7"]),
    ("evaluate-seed-without-clustering", ["evaluate", "{d}/good.npz", "-m", "map_at_r", "--seed", "5"]),
    ("index-empty-kind", ["index", "{d}/good.npz", "-o", "{d}/out_index.npz", "--kind", ""]),
    ("index-empty-distance", ["index", "{d}/good.npz", "-o", "{d}/out_index.npz", "--distance", ""]),
    # refused before the embedding work, not after it
    ("report-output-a-folder", ["report", "{d}/run_trunc_ckpt", "-o", "{d}/emptydir", "--data-root", "{d}/emptydir"]),
    ("report-output-empty", ["report", "{d}/run_trunc_ckpt", "-o", "", "--data-root", "{d}/emptydir"]),
]


#: What the error must be about, where another error could come first and hide it.
EXPECT = {
    "plot-per-class-shards": "is a shard directory (dmlkit embed --format shards); this reads one embeddings file",
    "evaluate-recall-at-0": "unknown metric 'recall_at_0'",
    "index-over-its-input": "would overwrite the input",
    "index-over-embeddings": "exists and is not a dmlkit index file",
    "index-add-its-own-file": "would overwrite the input",
    "query-output-over-its-queries": "would overwrite the input",
    "evaluate-per-class-over-its-input": "would overwrite the input",
    "evaluate-empty-k": "--k must list at least one integer",
    "reid-output-over-its-input": "would overwrite the input",
    "compare-output-over-its-results": "would overwrite the input",
    "query-output-over-its-index": "would overwrite the input",
    "oneshot-truncated-checkpoint": "checkpoint",
    "oneshot-garbage-checkpoint": "checkpoint",
    "train-bad-override": "embedding_size",
    "train-unknown-override-key": "no_such_key",
    "track-unknown-method": "bogus",
    "track-train-unknown-key": "no_such_section",
    "patches-train-unknown-key": "no_such_section",
    "bench-unknown-key": "no_such_section",
    "track-truncated-weights": "trunc.pt",
    "track-siamfc-without-weights": "--weights",
    "track-box-outside-frame": "outside",
    "track-evaluate-unknown-dataset": "bogus",
    "track-evaluate-unknown-method": "bogus",
    "report-bad-config": "config.yaml",
    "evaluate-wrong-dim-reference": "16",
    "query-wrong-dim": "16",
    "index-add-wrong-dim": "16",
    "reid-wrong-dim-gallery": "16",
    "embed-unknown-split": "bogus",
    "export-unknown-format": "bogus",
    "index-nprobe-0": "nprobe",
    "index-nprobe-negative": "nprobe",
    "index-nlist-0": "nlist",
    "query-no-rows": "no query embeddings",
    "track-fps-0": "--fps",
    "compare-out-unknown-suffix": ".json or .md",
    "query-exclude-self-other-ids": "no id of",
    "evaluate-killed-shard-write": "interrupted",
    "evaluate-shard-manifest-without-dim": "malformed",
    "index-shard-manifest-without-dim": "malformed",
    "embed-dtype-without-shards": "--format shards",
    "query-corrupt-index": "not a readable .npz file",
    "serve-corrupt-index": "not a readable .npz file",
    "index-add-to-corrupt-index": "not a readable .npz file",
    "query-corrupt-index-directory": "not a readable .npy file",
    "track-frames-empty-npz": "the file is empty",
    "track-frames-garbage-npz": "not a readable .npz file",
    "track-frames-embeddings-npz": "is not a video",
    "track-output-over-its-video": "would overwrite the input",
    "track-boxes-over-its-video": "would overwrite the input",
    "bench-threads-huge": "'--threads': Input should be less than or equal to 1024",
    "track-threads-huge": "'--threads': Input should be less than or equal to 1024",
    "track-evaluate-threads-huge": "'--threads': Input should be less than or equal to 1024",
    "track-train-threads-huge": "less than or equal to 1024",
    "patches-train-threads-huge": "less than or equal to 1024",
    "plot-histograms-bins-huge": "less than or equal to 1000000",
    "patches-build-data-pairs-huge": "train_pairs (--train-pairs) must be at most 10000000",
    "patches-build-data-views-huge": "views (--views) must be at most 32",
    "track-build-data-frames-huge": "at most 10000 frames (--frames)",
    "track-build-data-train-huge": "at most 10000 sequences per split (--train)",
    "export-opset-huge": "--opset must be an integer from",
    "export-opset-0": "--opset must be an integer from",
    "fewshot-episodes-huge": "less than or equal to 10000000",
    "evaluate-restarts-without-clustering": "--restarts sets the k-means runs",
    "evaluate-seed-without-clustering": "--seed sets the k-means runs",
    "index-empty-kind": "--kind is empty",
    "index-empty-distance": "--distance is empty",
    "report-output-a-folder": "is a folder",
    "report-output-empty": "is a folder",
}


def _argv(case: list[str], d: Path) -> list[str]:
    return [a.replace("{d}", str(d)) for a in case]


def check_one_error(code: int, out: str, err: str) -> str:
    """Assert the shape of a refused command; return its error line."""
    assert "Traceback" not in err, err[-3000:]
    assert code == 2, (code, out[-500:], err[-1500:])
    lines = [line for line in err.splitlines() if line.strip()]
    # one error; a list of several violations of one config continues on indented lines
    assert lines and lines[0].startswith("error: "), err
    assert all(line[0].isspace() for line in lines[1:]), err
    assert out.strip() == "", f"printed a result for bad input: {out[:500]}"
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_and_exit_2(case, files):
    name, argv = case
    code, out, err = _run(_argv(argv, files))
    first = check_one_error(code, out, err)
    if name in EXPECT:
        assert EXPECT[name] in err, (name, first)


def _commands(group, prefix: str = "") -> set[str]:
    import typer.main

    names = set()
    click_group = typer.main.get_command(group)
    for name, cmd in click_group.commands.items():
        names.add(prefix + name)
        if hasattr(cmd, "commands"):
            names |= {prefix + name + " " + sub for sub in cmd.commands}
    return names


def test_every_command_has_bad_input_cases():
    covered = {" ".join(argv[:2]) for _, argv in CASES} | {argv[0] for _, argv in CASES}
    missing = sorted(c for c in _commands(app) if c not in covered)
    assert not missing, f"add bad-input cases for: {missing}"


def test_string_labels_are_class_names_not_an_error(files):
    """String labels are accepted as class names and give the same number as integer ids."""
    code_i, out_i, err_i = _run(["evaluate", str(files / "good.npz"), "--json"])
    code_s, out_s, err_s = _run(["evaluate", str(files / "strlab.npz"), "--json"])
    assert code_i == code_s == 0, (err_i, err_s)
    assert json.loads(out_i) == json.loads(out_s)


# -- disk full (issue 11, item 7): one clear line, as for checkpoints -----------------------------
def _enospc(path: object = None) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else str(path))


def test_disk_full_while_writing_provenance_is_one_clear_error(tmp_path, monkeypatch):
    from dmlkit import utils
    from dmlkit.config import load_config
    from dmlkit.training.trainer import open_run_dir

    real = utils.atomic_write_bytes

    def full_for_provenance(path, data):
        if Path(path).name == "provenance.json":
            raise _enospc(path)
        return real(path, data)

    monkeypatch.setattr(utils, "atomic_write_bytes", full_for_provenance)
    config = load_config(REPO / "configs" / "quickstart.yaml")
    with pytest.raises(CheckpointError, match="disk is full") as info:
        open_run_dir(tmp_path / "run", config, resume=False)
    assert "provenance.json" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run" / "provenance.json").exists()
    assert not list((tmp_path / "run").glob(".*.tmp"))  # no half-written temporary file left


class _FullDisk(io.StringIO):
    """A log file handle on a full disk: every write and flush fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise _enospc()

    def flush(self) -> None:
        raise _enospc()


def test_disk_full_while_writing_the_run_log_is_one_error_and_close_does_not_raise_again(tmp_path):
    from dmlkit.training.runlog import RunLogger, read_log

    logger = RunLogger(tmp_path, csv_log=True)
    logger.log({"event": "train", "step": 1, "loss": 0.5})
    logger._fh = _FullDisk()  # the disk fills up during the run
    with pytest.raises(CheckpointError, match="disk is full") as info:
        logger.log({"event": "train", "step": 2, "loss": 0.4})
    assert "log.jsonl" in str(info.value)
    logger.close()  # the failed buffer is dropped, not written (and failed) a second time
    assert [r["step"] for r in read_log(tmp_path / "log.jsonl")] == [1]


def test_disk_full_through_the_cli_is_one_line_exit_2(files, tmp_path, monkeypatch):
    from dmlkit import utils

    def full(path, data):
        raise _enospc(path)

    monkeypatch.setattr(utils, "atomic_write_bytes", full)
    code, out, err = _run(["evaluate", str(files / "good.npz"), "--per-class", str(tmp_path / "pc.json")])
    check_one_error(code, "", err)
    assert "disk is full" in err and "pc.json" in err


def test_a_probe_command_writing_provenance_on_a_full_disk(tmp_path, monkeypatch):
    """The CLI turns the provenance writer's error into one line (no chained tracebacks)."""
    import typer

    from dmlkit import cli, provenance, utils

    def full(path, data):
        raise _enospc(path)

    probe = typer.Typer()

    @probe.command("write-provenance")
    def _write() -> None:
        provenance.write_provenance(tmp_path / "provenance.json", seed=0)

    @probe.command("other")
    def _other() -> None:
        pass

    monkeypatch.setattr(utils, "atomic_write_bytes", full)
    monkeypatch.setattr(cli, "app", probe)
    code, out, err = _run(["write-provenance"])
    check_one_error(code, out, err)
    assert "provenance.json" in err and "disk is full" in err


def test_an_input_that_ends_early_is_an_error_not_an_abort(monkeypatch):
    """typer turns an EOFError into an abort: a file that ended early (numpy reading an empty
    file) printed "aborted" and exited 130, as if the user had pressed Ctrl-C."""
    probe = typer.Typer()

    @probe.command("read")
    def _read() -> None:
        raise EOFError("No data left in file")

    @probe.command("other")
    def _other() -> None:
        pass

    monkeypatch.setattr(cli, "app", probe)
    code, out, err = _run(["read"])
    assert "ended unexpectedly (No data left in file)" in check_one_error(code, out, err)


def test_a_thread_count_beyond_the_bound_in_the_environment_is_one_error(files, monkeypatch):
    """``$DMLKIT_NUM_THREADS`` stands in for ``bench --threads`` and has its bound: 10**23
    overflowed ``torch.set_num_threads`` with a traceback."""
    monkeypatch.setenv("DMLKIT_NUM_THREADS", HUGE)
    code, out, err = _run(["bench", "configs/bench_quick.yaml", "-o", str(files / "runs" / "b")])
    assert "at most 1024 threads" in check_one_error(code, out, err)


# -- hints, units, warnings (item 22) -------------------------------------------------------------
def test_library_hints_are_written_the_way_the_command_is_used():
    from dmlkit.cli import cli_spelling

    msg = ("cannot read image a.jpg: truncated. Replace or delete the file, or load the dataset "
           "with skip_corrupt=True to skip unreadable images")
    assert "pass --set data.options.skip_corrupt=true to skip" in cli_spelling(msg, "train")
    assert "pass --set fixed.data.options.skip_corrupt=true" in cli_spelling(msg, "bench")
    # embed, verify, report, ...: a run's data options are its checkpoint's (an edited config.yaml
    # is refused), verify --pair-list reads no config: no way to skip, so no hint to
    for command in ("embed", "verify", "report"):
        assert cli_spelling(msg, command) == "cannot read image a.jpg: truncated. Replace or delete the file"
    assert "not possible under this command" in cli_spelling("skip them (load the dataset with "
                                                             "skip_corrupt=True)", "embed")
    assert "(or pass --set data.options.download=true)" in cli_spelling("into x (or pass download=True)", "train")


class _UnreadableImages(torch.utils.data.Dataset):
    """A dataset whose items raise the loaders' error for an unreadable image."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        from dmlkit.exceptions import DataError

        raise DataError(f"cannot read image img{i}.jpg: truncated. Replace or delete the file, or "
                        "load the dataset with skip_corrupt=True to skip unreadable images")


def test_an_error_in_a_data_loader_worker_is_one_line(monkeypatch):
    """With ``data.num_workers > 0`` (configs/cub200.yaml: 4) torch re-raised the worker's
    error as "Caught DataError in DataLoader worker process 0." and its whole traceback: 47
    lines where ``num_workers = 0`` gave the error's own line."""
    import typer

    from dmlkit import cli

    probe = typer.Typer()

    @probe.command("train")
    def _train() -> None:
        for _ in torch.utils.data.DataLoader(_UnreadableImages(), batch_size=2, num_workers=1):
            pass

    @probe.command("other")
    def _other() -> None:
        pass

    monkeypatch.setattr(cli, "app", probe)
    line = check_one_error(*_run(["train"]))
    assert line == ("error: cannot read image img0.jpg: truncated. Replace or delete the file, or pass "
                    "--set data.options.skip_corrupt=true to skip unreadable images")


def test_warnings_are_one_readable_line_in_cli_spelling(monkeypatch):
    import warnings

    import typer

    from dmlkit import cli

    probe = typer.Typer()

    @probe.command("train")
    def _train() -> None:
        warnings.warn("3 files cannot be read:\n"
                      "skip them (load the dataset with skip_corrupt=True)", UserWarning, stacklevel=1)

    @probe.command("other")
    def _other() -> None:
        pass

    monkeypatch.setattr(cli, "app", probe)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() installs its own
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code, out, err = _run(["train"])
    assert code == 0, err
    assert err == ("warning: 3 files cannot be read: skip them (pass --set data.options.skip_corrupt=true)\n")


def test_tables_show_percent_and_json_fractions(files):
    code, out, _ = _run(["fewshot", str(files / "good.npz"), "--way", "3", "--episodes", "20", "--json"])
    assert code == 0
    accuracy = json.loads(out)["accuracy"]
    assert 0.0 <= accuracy <= 1.0
    code, out, _ = _run(["fewshot", str(files / "good.npz"), "--way", "3", "--episodes", "20"])
    assert code == 0 and "accuracy (%)" in out and f"{100 * accuracy:.2f}" in out


# -- output off a terminal, class names, bold (item 23) -------------------------------------------
def test_piped_tables_keep_whole_method_names(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    arch = "a_rather_long_architecture_name_that_does_not_fit_in_eighty_columns_x" * 2
    run = tmp_path / "patch_run"
    run.mkdir()
    config = PatchExperimentConfig().model_dump(mode="json")  # the run's config.yaml and its table's
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "results.json").write_text(json.dumps({
        "architectures": [arch], "rows": [{"train": "liberty", "test": "notredame", arch: {"fpr95": 0.1234}}],
        "mean": {arch: {"fpr95": 0.1234}}, "config": config}))
    code, out, err = _run(["patches", "evaluate", str(run)])
    assert code == 0, err
    assert arch in out  # one line, not cut with "…" and not folded
    assert "12.34" in out


def test_figures_name_classes_by_their_names():
    from dmlkit.report import figures

    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1, 2], 4)
    names = {0: "cats", 1: "dogs", 2: "owls"}
    fig = figures.embedding_map(rng.normal(size=(12, 2)), labels, "map", class_names=names)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["cats", "dogs", "owls"]
    fig = figures.per_class_bars({0: 0.5, 1: 0.7, 2: 0.9}, top=3, class_names=names)
    assert {t.get_text() for t in fig.axes[0].get_yticklabels()} == {"cats", "dogs", "owls"}
    rows = [{"query": 0, "query_label": 0, "neighbors": [1, 5], "neighbor_labels": [0, 1], "caption": ""}]
    fig = figures.retrieval_gallery(rows, None, class_names=names)
    xlabels = [ax.get_xlabel() for ax in fig.axes[:3]]
    assert xlabels[1].endswith("cats") and "correct" in xlabels[1]
    assert xlabels[2].endswith("dogs") and "wrong" in xlabels[2]
    # two classes sharing a name keep separate bars
    fig = figures.per_class_bars({0: 0.5, 1: 0.7}, top=2, class_names={0: "x", 1: "x"})
    assert {t.get_text() for t in fig.axes[0].get_yticklabels()} == {"x (0)", "x (1)"}


def test_plot_per_class_of_a_file_with_class_names_shows_the_names(files, monkeypatch, tmp_path):
    from dmlkit.report import figures

    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig) or [Path(f"{path}.png")])
    code, out, err = _run(["plot", "per-class", str(files / "strlab.npz"), "--top", "2", "-o", str(tmp_path / "pc")])
    assert code == 0, err
    shown = {t.get_text() for t in drawn[0].axes[0].get_yticklabels()}
    assert shown and shown <= {f"class_{c}" for c in range(N_CLASSES)}


def test_report_tables_bold_only_the_given_cells():
    from dmlkit.report.html import table_html

    rows = [["a", "61.20 ± 1.00", "n/a", "3"], ["b", "60.00 ± 2.00", "40.00", "5"], ["c", "61.20", "39.00", "5"]]
    html = table_html(["method", "P@1", "MAP@R", "n"], rows, bold={(0, 1), (2, 1), (1, 2)})
    assert html.count('<td class="best">') == 3 and 'class="best"><td>' not in html
    assert '<td class="best">40.00</td>' in html and "<tr class" not in html
    assert '<td class="best">61.20</td>' in html and "<td>39.00</td>" in html


# -- embedding files (audit of the file paths) -------------------------------------------------
def test_a_labels_file_beyond_int64_is_one_error(tmp_path):
    """``12345678901234567890`` (or ``1e30``) in a labels file was numpy's OverflowError."""
    np.save(tmp_path / "e.npy", np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32))
    for big in ("12345678901234567890", "1e30"):
        (tmp_path / "big.txt").write_text(f"7\n{big}\n7\n7\n")
        line = check_one_error(*_run(["evaluate", str(tmp_path / "e.npy"), "--labels", str(tmp_path / "big.txt")]))
        assert f"label '{big}' on line 2 is beyond int64's range" in line


def test_a_shard_directory_is_named_as_one_where_one_file_is_read(tmp_path):
    """``dmlkit fewshot SHARDS`` said "a directory without a shard manifest.json ... a shard
    write that was interrupted (write it again)" of a complete shard directory."""
    from dmlkit.embedding_shards import write_shards

    rng = np.random.default_rng(0)
    write_shards(tmp_path / "sh", rng.normal(size=(60, 16)).astype(np.float32), np.repeat(np.arange(10), 6),
                 shard_rows=7)
    for command in (["fewshot"], ["verify"]):
        line = check_one_error(*_run([*command, str(tmp_path / "sh")]))
        assert "is a shard directory (dmlkit embed --format shards)" in line and "interrupted" not in line


def test_a_manifest_listing_a_shard_twice_is_refused(tmp_path):
    """A hand-merged manifest naming one shard twice had its rows counted twice (67 queries for
    60 rows, another MAP@R)."""
    import json

    from dmlkit.embedding_shards import write_shards

    rng = np.random.default_rng(0)
    write_shards(tmp_path / "dup", rng.normal(size=(60, 16)).astype(np.float32), np.repeat(np.arange(10), 6),
                 shard_rows=7)
    path = tmp_path / "dup" / "manifest.json"
    m = json.loads(path.read_text())
    m["shards"].append(m["shards"][0])
    m["count"] += m["shards"][0]["rows"]
    path.write_text(json.dumps(m))
    line = check_one_error(*_run(["evaluate", str(tmp_path / "dup"), "-m", "map_at_r"]))
    assert f"lists the shard file {m['shards'][0]['embeddings']} twice" in line


def test_float64_torch_embeddings_beyond_float32_are_named_so(tmp_path):
    """A .pt of finite float64 values beyond float32 was cast to inf and refused as "NaN or
    infinity ... a diverged training run"; the .npz of the same values named the range."""
    e = torch.from_numpy(np.random.default_rng(0).normal(size=(6, 4)) * 1e300)
    torch.save({"embeddings": e, "labels": torch.tensor([0, 0, 1, 1, 2, 2])}, tmp_path / "big.pt")
    line = check_one_error(*_run(["evaluate", str(tmp_path / "big.pt")]))
    assert "beyond float32's range" in line
