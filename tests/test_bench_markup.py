"""A trial's error text is printed as text, not rich markup.

Every gloo error names its source as ``[/path/pair.cc:561]``, which rich read as a closing tag:
the bench stopped with ``rich.errors.MarkupError`` after recording the failed trial, instead of
saying so and going on with the search."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from _reference import tiny_alphadigits_bench
from dmlkit.exceptions import DmlkitError
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.runner import Bench

pytestmark = pytest.mark.usefixtures("one_thread")

GLOO = "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer"


def test_a_failed_trial_with_brackets_in_its_error_is_said_and_the_search_goes_on(tmp_path, data_root):
    cfg = bench_config_from_dict(tiny_alphadigits_bench(
        "markup", {"num_classes": 16, "folds": 2, "trials": 2, "n_startup_trials": 1, "seeds": [0]},
        [{"name": "contrastive", "loss": {"name": "contrastive"},
          "search": {"loss.neg_margin": {"low": 0.5, "high": 1.5}}}],
        model={"embedding_size": 8}, sampler={"samples_per_class": 2, "batches_per_epoch": 1}))
    calls = []

    def train_fn(*args, **kwargs):
        calls.append(1)
        raise RuntimeError(GLOO)

    out = io.StringIO()
    console = Console(file=out, width=300, color_system=None)
    with pytest.raises(DmlkitError, match="every search trial failed"):  # said at the end, as one line
        Bench(cfg, tmp_path / "bench", data_root=data_root, console=console,
              train_fn=train_fn).run(stage="search")
    said = out.getvalue()
    assert said.count("failed: RuntimeError: " + GLOO) + said.count("failed: " + GLOO) == 2, said
    assert len(calls) == 2  # both trials ran
