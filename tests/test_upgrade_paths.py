"""Files an older dmlkit wrote, used with this one: a ``csv`` run's embeddings files and indexes
stored absolute item ids (now relative to the list's image folder), and an index recorded its
run by folder only (no ``run`` digest). The older artifacts are written here in their format.

Before: ``evaluate`` of an older and a newer file of the same items saw no shared item (P@1
100 %, exit 0); ``index --add`` of the very file an older csv index was built from added every
item again, ``query --exclude-self``/``--id`` found none; an older index whose run was moved
refused the run's own files as "another run"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _reference import FOLDER_CLASSES, one_step_run
from dmlkit.apps.service import ServiceConfig, create_app
from dmlkit.embeddings import save_embeddings
from dmlkit.training.trainer import embed_run

pytestmark = pytest.mark.usefixtures("one_thread")

CLASSES = FOLDER_CLASSES


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory) -> tuple[Path, Path]:
    """A one-step ``csv`` run whose images lie in the list's folder: ``(run_dir, list folder)``."""
    base = tmp_path_factory.mktemp("upgrade")
    data = base / "csvin"
    rng = np.random.default_rng(0)
    rows = ["path,label"]
    for i, name in enumerate(CLASSES):
        (data / "imgs" / name).mkdir(parents=True)
        for j in range(3):
            img = np.clip(40 + 50 * i + rng.normal(0, 20, (16, 16)), 0, 255).astype(np.uint8)
            Image.fromarray(img, mode="L").save(data / "imgs" / name / f"img{j}.png")
            rows.append(f"imgs/{name}/img{j}.png,{name}")
    (data / "list.csv").write_text("\n".join(rows) + "\n")
    return one_step_run("upgrade", "csv", base / "run", data / "list.csv"), data


def _older_run(csv_run: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the run whose test file stores absolute paths, as an older dmlkit wrote them."""
    run = Path(shutil.copytree(csv_run[0], tmp_path / "run"))
    test = run / "embeddings" / "test.npz"
    with np.load(test) as z:
        arrays = dict(z)
    assert not str(arrays["paths"][0]).startswith("/")  # today: relative to the list's folder
    arrays["paths"] = np.asarray([str(csv_run[1] / p) for p in arrays["paths"].tolist()])
    np.savez(test, **arrays)
    return run


def _moved(vectors: np.ndarray) -> np.ndarray:
    """Another device's embedding of the same items (1e-5 apart)."""
    return (vectors + np.float32(1e-5)).astype(np.float32)


# -- finding 1: evaluate of an older and a newer file of the same items ---------------------------
def test_evaluate_finds_the_items_an_older_csv_runs_file_shares(csv_run, tmp_path, run_cli):
    run = _older_run(csv_run, tmp_path)
    with np.load(csv_run[0] / "embeddings" / "test.npz") as z:  # today's file of the same items
        save_embeddings(tmp_path / "new.npz", _moved(z["embeddings"]), z["labels"], paths=z["paths"])
    code, out, err = run_cli(["evaluate", str(run / "embeddings" / "test.npz"), "-r", str(tmp_path / "new.npz"),
                              "-m", "precision_at_1", "--json"])
    assert code == 2 and out == "", out
    assert "6 of the 6 query items are also in the reference set" in err and "'imgs/c_coffee/img0.png'" in err, err


def test_evaluate_matches_an_absolute_path_to_a_relative_one_of_the_same_label(tmp_path, run_cli):
    """Files outside a run: an absolute path is the relative path it ends with, labels equal."""
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 4)
    x = rng.normal(size=(24, 8)).astype(np.float32)
    rel = np.asarray([f"imgs/c{c}/{i}.png" for c in range(6) for i in range(4)])
    save_embeddings(tmp_path / "old.npz", x, y, paths=np.asarray([f"/data/list/{p}" for p in rel]))
    save_embeddings(tmp_path / "new.npz", _moved(x), y, paths=rel)
    save_embeddings(tmp_path / "other.npz", _moved(x), (y + 1) % 6, paths=rel)  # other classes there
    code, _, err = run_cli(["evaluate", str(tmp_path / "old.npz"), "-r", str(tmp_path / "new.npz"), "-m", "precision_at_1"])
    assert code == 2 and "24 of the 24 query items are also in the reference set" in err, err
    code, out, err = run_cli(["evaluate", str(tmp_path / "new.npz"), "-r", str(tmp_path / "old.npz"),
                              "-m", "precision_at_1", "--shared-items", "keep", "--json"])
    assert code == 0 and "24 of the 24 query items" in err, err
    code, out, err = run_cli(["evaluate", str(tmp_path / "old.npz"), "-r", str(tmp_path / "other.npz"),
                              "-m", "precision_at_1", "--json"])
    assert code == 0 and "query items" not in err and json.loads(out)["num_queries"] == 24, err


# -- finding 2: an older csv run's index (absolute ids) --------------------------------------------
def _as_older_index(index: Path, info: dict, ids=None) -> None:
    """Rewrite the index file ``index`` as an older dmlkit wrote it: ``info`` as its source
    record, and its ids through ``ids`` (a function of the list of ids) where given."""
    with np.load(index) as z:
        arrays = dict(z)
    meta = json.loads(str(arrays["meta"]))
    meta["info"] = info
    arrays["meta"] = np.array(json.dumps(meta))
    if ids is not None:
        arrays["ids"] = np.asarray(ids(arrays["ids"].tolist()))
    np.savez(index, **arrays)


def _older_csv_index(run_cli, csv_run: tuple[Path, Path], tmp_path: Path) -> str:
    """An index of the run's test file as an older dmlkit wrote it: absolute ids, the list
    file as ``data_root``, no ``run`` digest nor ``source_sha256``."""
    run, data = csv_run
    index = tmp_path / "old_idx.npz"
    code, _, err = run_cli(["index", str(run / "embeddings" / "test.npz"), "-o", str(index)])
    assert code == 0, err
    _as_older_index(index, {"run_dir": str(run.resolve()), "data_root": str((data / "list.csv").resolve()),
                            "dataset": "csv", "source": str(run / "embeddings" / "test.npz")},
                    lambda ids: [str(data.resolve() / p) for p in ids])
    return str(index)


def test_an_older_csv_index_matches_the_runs_ids(csv_run, tmp_path, run_cli):
    index = _older_csv_index(run_cli, csv_run, tmp_path)
    test = str(csv_run[0] / "embeddings" / "test.npz")
    code, out, err = run_cli(["index", test, "-o", index, "--add"])
    assert code == 2 and "6 id(s) are already in the index, e.g. 'imgs/c_coffee/img0.png'" in err, (out, err)
    code, out, err = run_cli(["query", index, test, "--exclude-self", "-k", "1", "--json"])
    assert code == 0, err
    assert json.loads(out)[0]["query"] == "imgs/c_coffee/img0.png"
    assert json.loads(out)[0]["results"][0]["id"] != "imgs/c_coffee/img0.png"  # itself left out
    code, out, err = run_cli(["query", index, "--id", "imgs/c_coffee/img0.png", "-k", "1", "--json"])
    assert code == 0 and json.loads(out)[0]["results"][0]["id"].startswith("imgs/"), err


# -- finding 4: an older index (no run digest) whose run was moved with it --------------------------
def _moved_run_index(run_cli, csv_run: tuple[Path, Path], tmp_path: Path) -> tuple[Path, str]:
    """The run moved to another folder, with an older index of it naming the old folder only."""
    run = Path(shutil.copytree(csv_run[0], tmp_path / "moved"))
    index = tmp_path / "idx.npz"
    code, _, err = run_cli(["index", str(run / "embeddings" / "test.npz"), "-o", str(index)])
    assert code == 0, err
    with np.load(index) as z:
        info = json.loads(str(z["meta"]))["info"]
    _as_older_index(index, {**{k: v for k, v in info.items() if k not in ("run", "source_sha256")},
                            "run_dir": str(tmp_path / "before-the-move")})
    return run, str(index)


def test_an_older_index_takes_its_moved_runs_own_files(csv_run, tmp_path, run_cli):
    run, index = _moved_run_index(run_cli, csv_run, tmp_path)
    test = str(run / "embeddings" / "test.npz")
    code, out, err = run_cli(["query", index, test, "--exclude-self", "-k", "1", "--json"])
    assert code == 0 and len(json.loads(out)) == 6, err
    train_items = embed_run(run / "checkpoints" / "best.pt", "train", output=run / "embeddings" / "train.npz")[0]
    code, out, err = run_cli(["index", str(train_items), "-o", index, "--add"])
    assert code == 0 and "added" in out, err
    code, out, err = run_cli(["verify", test, "--pairs", "20", "--folds", "2", "--json"])
    assert code == 0, err
    (tmp_path / "verify.json").write_text(out)
    with pytest.warns(UserWarning, match="records no identity to compare it with.*not checked against the index"):
        create_app(ServiceConfig(index=index, verification=tmp_path / "verify.json"))
