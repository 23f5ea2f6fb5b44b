"""Follow-ups of the applications audit: each test pins an option that was silently ignored or
did not do what its docs say, a file that a kill could leave half-written, or a result field that
counted something else than its name (re-id, patches, verification, tracking)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from _reference import one_error_line, tiny_patch_run
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


# -- reid: options the protocol does not use ----------------------------------------------------
@pytest.fixture(scope="module")
def reid_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A VehicleID file (groups all 'test') and a Market-style file (query/gallery, cams)."""
    folder = tmp_path_factory.mktemp("reid")
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(8), 3)
    emb = rng.normal(size=(ids.size, 4)).astype(np.float32) + ids[:, None]
    vid = save_embeddings(folder / "vid.npz", emb, ids, groups=np.array(["test"] * ids.size))
    groups = np.array(["query" if k % 3 == 0 else "gallery" for k in range(ids.size)])
    cams = np.arange(ids.size) % 3
    market = save_embeddings(folder / "market.npz", emb, ids, groups=groups, cams=cams)
    return vid, market


@pytest.mark.parametrize("extra", [["--no-camera-rule"], ["--examples", "3"], ["--k1", "5"],
                                   ["--k2", "2"], ["--lambda", "0.5"]])
def test_vehicleid_refuses_options_it_does_not_use(reid_files, run_cli, extra) -> None:
    """Was: the VehicleID path of ``dmlkit reid`` silently ignored --no-camera-rule, --examples
    and --k1/--k2/--lambda (it refused only --rerank)."""
    vid, _ = reid_files
    code, _, err = run_cli(["reid", str(vid), "--repeats", "2", "--json", *extra])
    line = one_error_line(code, err)
    assert extra[0] in line and "drop it" in line


def test_market_refuses_repeats_and_rerank_settings_without_rerank(reid_files, run_cli) -> None:
    """--repeats counts VehicleID's gallery draws; --k1/--k2/--lambda set the re-ranking."""
    _, market = reid_files
    code, _, err = run_cli(["reid", str(market), "--repeats", "3", "--json"])
    assert "--repeats" in one_error_line(code, err)
    code, _, err = run_cli(["reid", str(market), "--k1", "5", "--json"])
    assert "--rerank" in one_error_line(code, err)


def test_reid_options_that_apply_still_run(reid_files, run_cli, tmp_path: Path) -> None:
    vid, market = reid_files
    code, out, err = run_cli(["reid", str(vid), "--repeats", "2", "--seed", "1", "--json"])
    assert code == 0, err
    assert '"vehicleid"' in out
    code, out, err = run_cli(["reid", str(market), "--rerank", "--k1", "3", "--k2", "2", "--lambda", "0.5",
                              "--no-camera-rule", "--examples", "2", "-o", str(tmp_path / "r.json"), "--json"])
    assert code == 0, err
    assert '"rerank"' in out


# -- patches: scores written atomically ---------------------------------------------------------
@pytest.fixture(scope="module")
def patch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small subsets and a trained run (one siam-l2 model, a few steps)."""
    return tiny_patch_run(tmp_path_factory.mktemp("patches"))


def test_patches_scores_are_written_atomically(patch_run, tmp_path: Path, monkeypatch) -> None:
    """Was: ``scores/<arch>/<train>__<test>.npz`` was written in place with ``np.savez``: a run
    killed while writing it left a truncated file that ``patches evaluate --figure`` read."""
    from dmlkit.apps.patches.protocol import load_patch_config, run_patch_protocol

    cfg_path, run = patch_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    scores = copy / "scores" / "siam-l2" / "a__b.npz"
    scores.unlink()
    real = np.savez

    def killed(file, *args, **kwargs):  # the process dies half-way through the write
        real(file, *args, **kwargs)
        if isinstance(file, str | os.PathLike):
            with open(file, "r+b") as fh:
                fh.truncate(os.path.getsize(file) // 2)
        else:
            file.truncate(len(file.getvalue()) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed)
    with pytest.raises(KeyboardInterrupt):
        run_patch_protocol(load_patch_config(cfg_path), copy, resume=True)  # the model is loaded
    assert not scores.exists()
    assert not [p for p in scores.parent.iterdir() if p.suffix == ".npz"]


def test_patches_damaged_scores_file_is_one_error_line(patch_run, tmp_path: Path, run_cli) -> None:
    """A scores file damaged by other means (an older dmlkit, a cut copy) is one line naming it
    and --rescore, not a BadZipFile traceback."""
    _, run = patch_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    scores = copy / "scores" / "siam-l2" / "a__b.npz"
    scores.write_bytes(scores.read_bytes()[: scores.stat().st_size // 2])
    code, _, err = run_cli(["patches", "evaluate", str(copy), "--figure", str(tmp_path / "f.png")])
    line = one_error_line(code, err)
    assert "a__b.npz" in line and "--rescore" in line


# -- verify: a CSV fold column with one value ---------------------------------------------------
def _csv_list(tmp_path: Path, fold_values: list[int] | None) -> tuple[Path, Path]:
    """8 images of 4 people, a CSV of 8 pairs (4 matched) with an optional fold column, and an
    embeddings .npz with their paths."""
    from PIL import Image

    names = [f"p{k // 2}_{k % 2}.png" for k in range(8)]
    for n in names:
        Image.new("L", (4, 4)).save(tmp_path / n)
    rows = [(names[2 * p], names[2 * p + 1], 1) for p in range(4)]
    rows += [(names[2 * p], names[(2 * p + 2) % 8], 0) for p in range(4)]
    head = "path1,path2,same" + (",fold" if fold_values is not None else "")
    lines = [head] + [f"{a},{b},{s}" + (f",{fold_values[k]}" if fold_values is not None else "")
                      for k, (a, b, s) in enumerate(rows)]
    csv = tmp_path / "pairs.csv"
    csv.write_text("\n".join(lines) + "\n")
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(8, 3)).astype(np.float32) + np.repeat(np.arange(4), 2)[:, None]
    npz = save_embeddings(tmp_path / "emb.npz", emb, np.repeat(np.arange(4), 2),
                          paths=np.array([str(tmp_path / n) for n in names]))
    return csv, npz


def test_csv_fold_column_with_one_value_is_refused(tmp_path: Path, run_cli) -> None:
    """Was: a CSV whose fold column held one value was silently dealt into --folds stratified
    folds (fold_source 'stratified'), ignoring the folds the file gave."""
    from dmlkit.apps.verification import verify_pair_list
    from dmlkit.data.pairs import load_pair_list

    csv, npz = _csv_list(tmp_path, [7] * 8)
    plist = load_pair_list(csv)  # reading the list is fine: it holds one fold
    assert plist.num_folds == 1
    with pytest.raises(ConfigError, match="single given fold"):
        verify_pair_list(np.zeros((len(plist.paths), 3)) + np.arange(len(plist.paths))[:, None], plist)
    code, _, err = run_cli(["verify", str(npz), "--pair-list", str(csv), "--folds", "2"])
    line = one_error_line(code, err)
    assert "pairs.csv" in line and "fold" in line


def test_csv_without_or_with_two_folds_still_runs(tmp_path: Path, run_cli) -> None:
    csv, npz = _csv_list(tmp_path, None)
    code, out, err = run_cli(["verify", str(npz), "--pair-list", str(csv), "--folds", "2", "--json"])
    assert code == 0, err
    assert '"fold_source": "stratified"' in out
    csv, npz = _csv_list(tmp_path, [0, 1] * 4)
    code, out, err = run_cli(["verify", str(npz), "--pair-list", str(csv), "--json"])
    assert code == 0, err
    assert '"fold_source": "list"' in out and '"folds": 2' in out


def test_one_fold_lfw_list_has_no_folds(tmp_path: Path) -> None:
    """LFW's development lists (header 'N') define no folds: they are dealt into stratified
    folds as documented, not refused like a CSV fold column of one value."""
    from PIL import Image

    from dmlkit.data.pairs import parse_lfw_pairs, resolve_lfw_pairs

    for name in ("Al", "Bo"):
        (tmp_path / name).mkdir()
        for k in (1, 2):
            Image.new("L", (4, 4)).save(tmp_path / name / f"{name}_{k:04d}.png")
    (tmp_path / "pairs.txt").write_text("1\nAl 1 2\nAl 1 Bo 1\n")
    plist = resolve_lfw_pairs(parse_lfw_pairs(tmp_path / "pairs.txt"), tmp_path)
    assert plist.folds is None and plist.num_folds == 0


# -- track: --scales and the frame counts ---------------------------------------------------------
def test_scales_3_is_the_papers_search_over_a_custom_three_scale_checkpoint(tmp_path: Path) -> None:
    """Was: ``--scales 3`` over a checkpoint with 3 scales and its own step kept that step (the
    docs promise the paper's 3-scale search: step 1.0375, penalty 0.9745)."""
    from dmlkit.apps.tracking import SiamFC, TrackerConfig, save_siamfc
    from dmlkit.commands.track import _tracker

    ckpt = save_siamfc(tmp_path / "c.pt", SiamFC(width=0.1),
                       TrackerConfig(num_scales=3, scale_step=1.08, scale_penalty=0.95, window_influence=0.3))
    own = _tracker("siamfc", ckpt, None, 0, "cpu").config
    assert (own.scale_step, own.scale_penalty) == (1.08, 0.95)  # without --scales: the checkpoint's
    three = _tracker("siamfc", ckpt, 3, 0, "cpu").config
    assert (three.num_scales, three.scale_step, three.scale_penalty) == (3, 1.0375, 0.9745)
    assert three.window_influence == 0.3
    five = _tracker("siamfc", ckpt, 5, 0, "cpu").config
    assert (five.num_scales, five.scale_step, five.scale_penalty) == (5, 1.025, 0.962)


@pytest.mark.parametrize("method", ["siamfc", "ncc"])
def test_other_scale_counts_are_refused(tmp_path: Path, method: str) -> None:
    """Was: ``--scales 7`` ran 7 scales with the checkpoint's step (the docs offer 3 or 5), and
    ``--method ncc`` ignored any --scales value."""
    from dmlkit.apps.tracking import SiamFC, save_siamfc
    from dmlkit.commands.track import _tracker

    ckpt = save_siamfc(tmp_path / "c.pt", SiamFC(width=0.1))
    with pytest.raises(ConfigError, match="--scales must be 3"):
        _tracker(method, ckpt, 7, 0, "cpu")


def test_frames_count_the_tracked_frames_and_scored_frames_the_ground_truth() -> None:
    """Was: per-sequence ``frames`` (and ``num_frames``) counted only the frames with ground
    truth, though the docs call it the tracked frames (and fps is measured over those)."""
    from dmlkit.apps.tracking import evaluate_ope

    gt = np.tile(np.array([10.0, 10.0, 20.0, 20.0]), (6, 1))
    gt[[2, 3]] = np.nan  # target absent in two frames
    res = evaluate_ope({"s": gt.copy()}, {"s": gt}, fps={"s": 10.0})
    d = res.to_dict()
    assert d["per_sequence"]["s"]["frames"] == 6 and d["per_sequence"]["s"]["scored_frames"] == 4
    assert d["num_frames"] == 6 and d["num_scored_frames"] == 4
    assert res.sequences[0].updates == 5


@pytest.mark.parametrize("extra", [["--data-root", "/tmp"], ["--device", "cpu"]])
def test_reid_of_an_embeddings_file_refuses_run_options(reid_files, run_cli, extra) -> None:
    """Was: --data-root and --device (they read and embed a run's test split) were silently
    ignored for an embeddings file."""
    _, market = reid_files
    code, _, err = run_cli(["reid", str(market), "--json", *extra])
    assert extra[0] in one_error_line(code, err)


def test_verify_pair_list_with_a_damaged_npz_says_damaged_not_pickled(tmp_path: Path, run_cli) -> None:
    """Was: 'cannot read embeddings from X: ... contains pickled (object) data ... allow_pickle'
    for a text or truncated file named .npz (np.load takes any such file for a pickle)."""
    csv, npz = _csv_list(tmp_path, None)
    npz.write_text("embeddings,labels\n1,2\n")
    code, _, err = run_cli(["verify", str(npz), "--pair-list", str(csv)])
    line = one_error_line(code, err)
    assert "not a readable .npz" in line and "pickle" not in line
