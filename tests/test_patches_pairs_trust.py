"""Trust in what ``patches evaluate`` shows and in fixed verification pair lists: each test pins a
bug that gave a silent wrong answer (an option ignored, a figure of other patches captioned with
the run's scores, a pair list whose self or repeated pairs inflated the accuracy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from _reference import brown_subset, one_error_line, tiny_patch_run
from dmlkit.apps.verification import verify_pair_list
from dmlkit.data.pairs import PairList, load_pair_list, read_pair_csv
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import DataError

pytestmark = pytest.mark.usefixtures("one_thread")


# -- patches evaluate: options that need another option ------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small subsets and a trained run (one siam-l2 model, a few steps)."""
    return tiny_patch_run(tmp_path_factory.mktemp("tiny"))


def test_evaluate_refuses_data_root_and_k_it_would_ignore(tiny, tmp_path: Path, run_cli) -> None:
    """Was: ``--data-root`` without ``--rescore``/``--figure`` and ``-k`` without ``--figure``
    were ignored: the stored table came back with exit 0, even for a root that does not exist."""
    _, run = tiny
    code, out, err = run_cli(["patches", "evaluate", str(run), "--data-root", str(tmp_path / "nowhere")])
    line = one_error_line(code, err)
    assert "--data-root" in line and "--rescore" in line and "--figure" in line and out == ""
    code, out, err = run_cli(["patches", "evaluate", str(run), "-k", "3"])
    line = one_error_line(code, err)
    assert "-k" in line and "--figure" in line and out == ""
    # with the option they need they still run
    code, _, err = run_cli(["patches", "evaluate", str(run), "--figure", str(tmp_path / "f.png"), "-k", "2"])
    assert code == 0, err


# -- patches evaluate --figure: the run's scores index the patches of its own test subset ----------
@pytest.fixture(scope="module")
def two_roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """``(root1, root2, run)``: a run trained on ``root1/pd/{a,b}`` (a relative ``data.root``);
    ``root2/pd`` holds the same training subset ``a`` and another test subset ``b``."""
    from dmlkit.cli import main

    base = tmp_path_factory.mktemp("roots")
    root1, root2 = base / "root1", base / "root2"
    brown_subset(root1 / "pd" / "a", 24, (64, 32), seed=1)
    brown_subset(root1 / "pd" / "b", 24, (64, 32), seed=2)
    shutil.copytree(root1 / "pd" / "a", root2 / "pd" / "a")
    brown_subset(root2 / "pd" / "b", 24, (64, 32), seed=3)
    cfg = {"seed": 0, "data": {"root": "pd", "combinations": [["a", "b"]]},
           "model": {"architectures": ["siam-l2"], "patch_size": 32, "width": 0.125},
           "training": {"epochs": 1, "batch_size": 16, "threads": 1, "augment": False}}
    path = base / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = base / "run"
    try:
        main(["patches", "train", str(path), "-o", str(run), "--data-root", str(root1), "--json", "-q"])
    except SystemExit as exc:
        assert not exc.code
    return root1, root2, run


def test_figure_refuses_a_test_subset_other_than_the_one_scored(two_roots, tmp_path: Path, run_cli) -> None:
    """Was: ``--figure`` without ``--rescore`` drew the run's pair indices from the test subset of
    whatever ``--data-root`` named: other patches, captioned with the run's scores, exit 0."""
    root1, root2, run = two_roots
    fig = tmp_path / "f.png"
    code, out, err = run_cli(["patches", "evaluate", str(run), "--figure", str(fig), "--data-root", str(root2)])
    line = one_error_line(code, err)
    assert "--rescore" in line and str(root2 / "pd" / "b") in line and not fig.exists()
    with np.load(run / "scores" / "siam-l2" / "a__b.npz") as z:  # the SHA-256 the run stored
        assert len(str(z["test_data_sha256"])) == 64
    # the data it was tested on, here or copied to another root (a content hash, not a path)
    code, out, err = run_cli(["patches", "evaluate", str(run), "--figure", str(fig), "--data-root", str(root1)])
    assert code == 0 and err == "" and fig.is_file()
    moved = tmp_path / "moved"
    shutil.copytree(root1, moved)
    code, _, err = run_cli(["patches", "evaluate", str(run), "--figure", str(tmp_path / "g.png"),
                            "--data-root", str(moved)])
    assert code == 0 and err == ""
    # --rescore scores the other root's pairs itself: its figure is right
    code, _, err = run_cli(["patches", "evaluate", str(run), "--rescore", "--figure", str(tmp_path / "h.png"),
                            "--data-root", str(root2)])
    assert code == 0, err


def test_figure_of_a_run_without_a_stored_test_hash_warns(two_roots, tmp_path: Path, run_cli) -> None:
    """A scores file of an older dmlkit records no test subset: the figure is drawn as before,
    with one warning line that says so and names --rescore."""
    _, root2, run = two_roots
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    scores = copy / "scores" / "siam-l2" / "a__b.npz"
    with np.load(scores) as z:
        old = {k: z[k] for k in ("left", "right", "label", "scores")}
    np.savez(scores, **old)
    code, _, err = run_cli(["patches", "evaluate", str(copy), "--figure", str(tmp_path / "f.png"),
                            "--data-root", str(root2)])
    assert code == 0 and (tmp_path / "f.png").is_file()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "--rescore" in lines[0], err


# -- fixed verification pair lists: self pairs and repeated pairs ---------------------------------
def _images(folder: Path, names: list[str]) -> None:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for k, n in enumerate(names):
        Image.new("L", (4, 4), color=10 * k).save(folder / n)


def test_csv_self_and_repeated_pairs_are_refused_with_their_lines(tmp_path: Path) -> None:
    """Was: a CSV pair ``a.png,a.png,1`` and the same pair listed twice (either order) were scored
    silently: a trivial match and a pair counted twice (in two folds, perhaps), more accuracy."""
    _images(tmp_path, ["a.png", "b.png", "c.png", "d.png"])
    (tmp_path / "sub").mkdir()
    good = ["path1,path2,same", "a.png,b.png,1", "c.png,d.png,1", "a.png,c.png,0", "b.png,d.png,0"]
    (tmp_path / "good.csv").write_text("\n".join(good) + "\n")
    assert len(read_pair_csv(tmp_path / "good.csv")) == 4
    (tmp_path / "self.csv").write_text("\n".join([*good, "a.png,a.png,1"]) + "\n")
    with pytest.raises(DataError, match=r"itself \(line 6\)"):
        read_pair_csv(tmp_path / "self.csv")
    (tmp_path / "again.csv").write_text("\n".join([*good, "d.png,b.png,0"]) + "\n")
    with pytest.raises(DataError, match="line 6 repeats line 5"):
        read_pair_csv(tmp_path / "again.csv")
    (tmp_path / "spelt.csv").write_text("\n".join([*good, "sub/../a.png,a.png,1"]) + "\n")  # one file
    with pytest.raises(DataError, match=r"itself \(line 6\)"):
        load_pair_list(tmp_path / "spelt.csv")


def test_lfw_self_and_repeated_pairs_are_refused_with_their_lines(tmp_path: Path) -> None:
    """The same for an LFW-format list (``name 1 1``; ``A 1 B 2`` then ``B 2 A 1``)."""
    for name in ("Ann", "Bob"):
        _images(tmp_path / "lfw" / name, [f"{name}_{n:04d}.png" for n in (1, 2, 3)])
    matched = ["Ann\t1\t2", "Bob\t1\t2", "Ann\t2\t3"]
    mismatched = ["Ann\t1\tBob\t2", "Ann\t3\tBob\t3", "Bob\t1\tAnn\t2"]
    (tmp_path / "pairs.txt").write_text("\n".join(["3", *matched, *mismatched]) + "\n")
    assert len(load_pair_list(tmp_path / "pairs.txt")) == 6
    (tmp_path / "self.txt").write_text("\n".join(["3", *matched[:2], "Bob\t3\t3", *mismatched]) + "\n")
    with pytest.raises(DataError, match=r"itself \(line 4\)"):
        load_pair_list(tmp_path / "self.txt", tmp_path)
    (tmp_path / "again.txt").write_text("\n".join(["3", *matched, *mismatched[:2], "Bob\t2\tAnn\t1"]) + "\n")
    with pytest.raises(DataError, match="line 7 repeats line 5"):
        load_pair_list(tmp_path / "again.txt", tmp_path)


def test_python_pair_lists_name_positions(tmp_path: Path) -> None:
    """``PairList.from_path_pairs`` names 0-based pair positions; ``verify_pair_list`` refuses a
    list built directly (or two spellings of one file mapped to one embedding row)."""
    paths = [f"/img/{i}.png" for i in range(8)]
    a, b, same = paths[0::2], paths[1::2], [True, False, True, False]
    with pytest.raises(DataError, match=r"itself \(pair 4\)"):
        PairList.from_path_pairs([*a, a[0]], [*b, a[0]], [*same, True], None, "api")
    with pytest.raises(DataError, match="pair 4 repeats pair 0; pair 5 repeats pair 1"):
        PairList.from_path_pairs([*a, b[0], b[1]], [*b, a[0], a[1]], [*same, True, False], None, "api")
    ok = PairList.from_path_pairs(a, b, same, None, "api")
    x = np.random.default_rng(0).normal(size=(8, 3))
    direct = PairList(ok.paths, np.r_[ok.left, ok.right[2]], np.r_[ok.right, ok.left[2]],
                      np.r_[ok.same, True], None, "direct")
    with pytest.raises(DataError, match="pair 4 repeats pair 2"):
        verify_pair_list(x, direct, folds=2)


def test_verify_cli_refuses_a_repeated_pair_in_one_line(tmp_path: Path, run_cli) -> None:
    names = [f"p{k // 2}_{k % 2}.png" for k in range(8)]
    _images(tmp_path, names)
    rows = [f"{names[2 * p]},{names[2 * p + 1]},1" for p in range(4)]
    rows += [f"{names[2 * p]},{names[(2 * p + 2) % 8]},0" for p in range(4)]
    (tmp_path / "pairs.csv").write_text("\n".join([*rows, f"{names[1]},{names[0]},1"]) + "\n")
    emb = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    npz = save_embeddings(tmp_path / "emb.npz", emb, np.repeat(np.arange(4), 2),
                          paths=np.array([str(tmp_path / n) for n in names]))
    code, out, err = run_cli(["verify", str(npz), "--pair-list", str(tmp_path / "pairs.csv"), "--folds", "2"])
    line = one_error_line(code, err)
    assert "line 9 repeats line 1" in line and out == ""
