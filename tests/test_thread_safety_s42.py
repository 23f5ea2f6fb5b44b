"""Thread safety and global state (audit s42): HNSW's deferred graph insertion under concurrent
searches, faiss ids the index never issued, the report's random numbers, matplotlib's backend."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from _reference import TINY_ATT_FACES_RUN
from dmlkit.apps.index import EmbeddingIndex
from dmlkit.exceptions import DataError

faiss = pytest.importorskip("faiss")

SRC = Path(__file__).resolve().parents[1] / "src"


# -- F1: concurrent first searches of an HNSW graph -----------------------------------------------
class _SlowAdd:
    """A faiss index whose ``add_with_ids`` takes 0.3 s: the window in which other threads search."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def add_with_ids(self, x, ids) -> None:
        time.sleep(0.3)
        self.inner.add_with_ids(x, ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_concurrent_first_searches_of_a_fresh_hnsw_graph_equal_serial_searches():
    """4 threads search a graph whose held-out rows the first search inserts: each gets what a
    serial search of the complete graph gets (the reserve was emptied before the insertion, so
    the others searched a graph without those rows: recall@10 0.86-0.93 against 0.997)."""
    x = np.random.default_rng(0).standard_normal((2000, 16)).astype(np.float32)
    idx = EmbeddingIndex(dim=16, kind="hnsw", recall_queries=200)
    idx.add(x)
    held = idx._rows_of_keys(idx._graph_reserve)
    assert held.size == 200
    queries = x[held]  # the held-out rows themselves: each is its own nearest item
    idx._faiss_index = _SlowAdd(idx._faiss_index)
    barrier = threading.Barrier(4)
    got: dict[int, object] = {}

    def search(j: int) -> None:
        barrier.wait()
        got[j] = idx.search(queries, 5)

    threads = [threading.Thread(target=search, args=(j,)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    idx._faiss_index = idx._faiss_index.inner
    assert idx._graph_reserve.size == 0 and idx._faiss_index.ntotal == 2000  # inserted once
    serial = idx.search(queries, 5)
    np.testing.assert_array_equal(serial.indices[:, 0], held)
    for j in range(4):
        np.testing.assert_array_equal(got[j].indices, serial.indices)
        np.testing.assert_array_equal(got[j].scores, serial.scores)


# -- security F9: faiss ids that are no keys of the index -------------------------------------------
def test_rows_of_keys_refuses_keys_the_index_never_issued():
    from dmlkit.apps.index_faiss import rows_of_keys

    np.testing.assert_array_equal(rows_of_keys(np.arange(4), np.array([[3, 0, -1]])), [[3, 0, -1]])
    removed = np.array([2, 5, 9])  # after removals: looked up
    np.testing.assert_array_equal(rows_of_keys(removed, np.array([[9, -1, 2, 5]])), [[2, -1, 0, 1]])
    for own, bad in ((np.arange(4), 4), (np.arange(4), -5), (removed, 3), (removed, 10), (removed, -2),
                     (np.empty(0, dtype=np.int64), 0)):
        with pytest.raises(DataError, match=f"returned key {bad}, which is no item's"):
            rows_of_keys(own, np.array([[own[0] if own.size else -1, bad]]))


def _tamper_id_map(directory: Path, value: int) -> None:
    outer = faiss.deserialize_index(np.fromfile(directory / "faiss.index", dtype=np.uint8))
    ids = faiss.vector_to_array(outer.id_map)
    ids[::7] = value
    faiss.copy_array_to_vector(ids, outer.id_map)
    faiss.serialize_index(outer).tofile(directory / "faiss.index")


@pytest.mark.parametrize("value", [10**12, -5, "removed"])
def test_a_faiss_id_map_naming_other_keys_is_one_data_error(tmp_path, run_cli, value):
    x = np.random.default_rng(0).normal(size=(300, 16)).astype(np.float32)
    idx = EmbeddingIndex(x, ids=[f"i{i}" for i in range(300)], kind="hnsw", recall_queries=20)
    if value == "removed":  # keys 0-2 removed: the others are looked up, and 1 is no item's
        idx.remove(["i0", "i1", "i2"])
        value = 1
    idx.save(tmp_path / "idx")
    _tamper_id_map(tmp_path / "idx", value)
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    with pytest.raises(DataError, match=f"returned key {value}, which is no item's"):
        loaded.search(x[:50], 10)
    code, out, err = run_cli(["query", str(tmp_path / "idx"), "--id", "i10", "--id", "i20", "-k", "50"])
    assert code == 2 and "Traceback" not in err and "IndexError" not in err
    assert f"returned key {value}" in err and len(err.strip().splitlines()) == 1


def test_ivf_lists_naming_other_keys_are_one_data_error():
    x = np.random.default_rng(1).normal(size=(400, 8)).astype(np.float32)
    idx = EmbeddingIndex(x, kind="ivf_flat", nlist=4, nprobe=4, recall_queries=20)
    idx._keys = idx._keys + 1000  # the lists hold keys 0-399, which no item has now
    with pytest.raises(DataError, match="which is no item's"):
        idx.search(x[:3], 5)


# -- F2: the report's random numbers ------------------------------------------------------------------
def _draws() -> tuple[float, float, float]:
    return float(np.random.random()), float(torch.rand(1)), random.random()


def _seed_caller() -> None:
    np.random.seed(12345)
    torch.manual_seed(12345)
    random.seed(12345)


class _OtherThread:
    """A thread drawing from the global torch RNG (a training loop, an augmentation) meanwhile."""

    def __enter__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._draw)
        self.before = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # switch often: the draws interleave with the report's
        self.thread.start()
        return self

    def _draw(self) -> None:
        while not self.stop.is_set():
            torch.rand(16)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.before)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_thread_random_draws_what_the_seeded_global_generator_draws():
    """:class:`_ThreadRandom` routes a model's initialisation, a DataLoader's base seed and
    torchvision's random transforms to its generator: the draws of ``torch.manual_seed(s)``,
    whatever another thread draws meanwhile, and the caller's generator is left untouched."""
    import torchvision.transforms as T

    from dmlkit.config import ModelConfig
    from dmlkit.report.builder import _ThreadRandom
    from dmlkit.training import build_model
    from dmlkit.utils import seed_everything

    config = ModelConfig(trunk="small_cnn", pretrained=False, embedding_size=16, in_channels=1)
    crop = T.Compose([T.RandomResizedCrop(8, scale=(0.5, 1.0)), T.RandomHorizontalFlip()])
    image = torch.arange(3 * 12 * 12, dtype=torch.float32).reshape(3, 12, 12)

    def draw_all():  # each draw after the earlier ones: one missed would shift the rest
        model = build_model(config)
        list(torch.utils.data.DataLoader(list(range(6)), batch_size=2))  # draws its base seed
        return (_state(model), crop(image), torch.randn(3), torch.randint(0, 100, (4,)), torch.randperm(5),
                torch.empty(3).uniform_(), torch.rand(2))

    seed_everything(3)
    expected = draw_all()
    _seed_caller()
    caller = _draws()
    _seed_caller()
    with _OtherThread():
        with _ThreadRandom(torch.Generator().manual_seed(3)):
            got = draw_all()
    assert _draws()[1] != caller[1]  # the other thread drew from the global generator ...
    _seed_caller()
    with _ThreadRandom(torch.Generator().manual_seed(3)):
        again = draw_all()
    assert _draws() == caller  # ... this thread's draws did not
    for a, b, c in zip(expected, got, again):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c)
        else:
            assert a == b == c


TINY_RUN = {**TINY_ATT_FACES_RUN, "name": "thread-report", "seed": 3}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_root) -> Path:
    import yaml
    from typer.testing import CliRunner

    from dmlkit.cli import app

    base = tmp_path_factory.mktemp("thread_report")
    (base / "tiny.yaml").write_text(yaml.safe_dump(TINY_RUN))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "training did not beat the untrained model": 2 steps
        res = CliRunner().invoke(app, ["train", str(base / "tiny.yaml"), "--run-dir", str(base / "run"),
                                       "--data-root", str(data_root), "--quiet"])
    assert res.exit_code == 0, res.output
    return base / "run"


def test_report_embeddings_leave_the_caller_rngs_and_ignore_other_threads(run_dir, data_root):
    """The report's embeddings (the figures' and tables' numbers) are the run's step-0 model's and
    the trained model's, the same with a thread drawing from the global torch RNG meanwhile, and
    the caller's next Python, numpy and torch draws are those it would have made without the call
    (``seed_everything(config.seed)`` reset all three to the run's seed)."""
    from dmlkit.config import load_config
    from dmlkit.embeddings import embed_split
    from dmlkit.report import ReportOptions
    from dmlkit.report.builder import _run_embeddings
    from dmlkit.training import build_datasets, build_model
    from dmlkit.training.run_identity import with_run_split
    from dmlkit.utils import seed_everything

    options = ReportOptions(maps=("pca",), data_root=data_root, max_points=40, thumbnails=False)
    _seed_caller()
    expected = _draws()
    _seed_caller()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained, untrained = _run_embeddings(run_dir, options, [])
        assert _draws() == expected
        with _OtherThread():
            trained2, untrained2 = _run_embeddings(run_dir, options, [])
    for a, b in ((trained, trained2), (untrained, untrained2)):
        assert a.keys() == b.keys() and a
        for name in a:
            np.testing.assert_array_equal(a[name].embeddings, b[name].embeddings, err_msg=name)
    # the untrained model is the one `dmlkit train` starts from: seeded with the run's seed
    config = with_run_split(load_config(run_dir / "config.yaml"), run_dir)
    seed_everything(config.seed)
    step0 = build_model(config).eval()
    test = build_datasets(config, ("test",), data_root=data_root)["test"]
    emb0, _ = embed_split(step0, test, config, device="cpu")
    np.testing.assert_array_equal(untrained["test"].embeddings, emb0)


# -- F6: matplotlib's backend ------------------------------------------------------------------------
_BACKEND_CHILD = r"""
import json, os, sys
os.environ.pop("MPLBACKEND", None)
import matplotlib
matplotlib.use("svg")
import matplotlib.pyplot as plt
plt.figure()
seen = [(matplotlib.get_backend(), os.environ.get("MPLBACKEND"))]
import dmlkit.report
from dmlkit.report import figures
seen.append((matplotlib.get_backend(), os.environ.get("MPLBACKEND")))
fig = figures.cmc_curve({"a": [0.5, 0.75, 1.0]})
figures.save_figure(fig, sys.argv[1] + "/cmc")
from dmlkit.apps.tracking import plot_ope
from dmlkit.apps.tracking.evaluation import evaluate_ope
import numpy as np
gt = np.array([[0, 0, 10, 10]] * 3, float)
ope = plot_ope({"t": evaluate_ope({"s": gt}, {"s": gt})})
seen.append((matplotlib.get_backend(), os.environ.get("MPLBACKEND")))
print(json.dumps({"seen": seen, "figs": plt.get_fignums(), "axes": len(ope.axes)}))
"""


def test_importing_and_drawing_leave_the_matplotlib_backend_and_environment(tmp_path):
    """``import dmlkit.report`` set ``MPLBACKEND=Agg`` and switched a program's backend (svg here,
    a notebook's inline one) to Agg, and ``plot_ope`` did on every call; the figures are drawn on
    their own Agg canvas now, the PNG saved all the same."""
    import os

    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("MPLBACKEND", None)
    out = subprocess.run([sys.executable, "-c", _BACKEND_CHILD, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["seen"] == [["svg", None]] * 3
    assert got["figs"] == [1] and got["axes"] == 2  # the program's own figure only
    assert (tmp_path / "cmc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "cmc.svg").exists()
