"""Follow-ups of an audit of train / evaluate / plot: a NaN step-0 metric read back from
baseline.json (null) prints as nan, a labels file replacing a shard directory's labels warns as
it does for an .npz, --k without a metric that uses K is refused, and a log with nothing to draw
is refused instead of writing a blank figure."""

from __future__ import annotations

import numpy as np
import pytest
from rich.console import Console

from dmlkit.commands.train import _metrics_table
from dmlkit.embedding_shards import write_shards
from dmlkit.embeddings import save_embeddings
from dmlkit.training.trainer import baseline_warnings


def _render(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def test_a_nan_step0_metric_read_back_as_null_prints_as_nan():
    """Was: a TypeError traceback after a resumed run (null * 100), its table lost."""
    text = _render(_metrics_table("t", {"step 0": {"map_at_r": 0.25, "recall_at_500": None},
                                        "test": {"map_at_r": 0.5, "recall_at_500": float("nan")}}))
    assert "25.00" in text and "50.00" in text and text.count("nan") == 2
    assert baseline_warnings({"val": {"map_at_r": None}}, {"val": {"map_at_r": 0.3}}) == []


def _emb(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 4)).astype(np.float32)
    y = np.arange(40) % 10
    return x, y


def test_labels_replacing_a_shard_directorys_labels_warn(tmp_path, run_cli):
    """Was: silent for a shard directory (an .npz warned)."""
    x, y = _emb(tmp_path)
    write_shards(tmp_path / "sh", x, y, shard_rows=7)
    np.savetxt(tmp_path / "lab.txt", np.random.default_rng(1).permutation(y), fmt="%d")
    code, _, err = run_cli(["evaluate", str(tmp_path / "sh"), "--labels", str(tmp_path / "lab.txt"),
                            "-m", "map_at_r", "--json"])
    assert code == 0, err
    assert "lab.txt replaces the 40 labels stored in" in err


@pytest.mark.parametrize("metrics", ["map_at_r", "recall_at_4"])
def test_k_without_a_metric_that_uses_it_is_refused(tmp_path, run_cli, metrics):
    """Was: --k 5 with -m map_at_r (or recall_at_4) was dropped without a word."""
    x, y = _emb(tmp_path)
    save_embeddings(tmp_path / "e.npz", x, y)
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npz"), "-m", metrics, "--k", "5", "--json"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "--k sets the K values of recall_at_k" in err
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npz"), "-m", "recall_at_k", "--k", "5", "--json"])
    assert code == 0 and "recall_at_5" in out


def test_curves_of_a_log_with_nothing_to_draw_are_refused(tmp_path, run_cli):
    """Was: three empty panels written, exit 0."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "log.jsonl").write_text('{"event":"train","step":1}\n{"event":"eval","step":1,"split":"val"}\n')
    code, out, err = run_cli(["plot", "curves", str(tmp_path / "c"), "-o", str(tmp_path / "out" / "c")])
    assert code != 0 and "nothing to draw" in err
    assert not (tmp_path / "out" / "c.png").exists()
