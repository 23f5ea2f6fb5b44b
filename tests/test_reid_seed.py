"""``dmlkit reid --examples 0 --seed 3`` on a query/gallery source: the seed draws only the
example queries there, so with none stored it changed nothing and was silently accepted."""

from __future__ import annotations

import numpy as np
import pytest

from dmlkit.embeddings import save_embeddings


@pytest.fixture
def groups_npz(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(4), 4)
    path = tmp_path / "all.npz"
    save_embeddings(path, rng.normal(size=(16, 5)).astype(np.float32), ids,
                    cams=np.tile(np.arange(4), 4), groups=np.array(["query", "gallery"] * 8))
    return path


def test_seed_without_examples_is_refused_in_one_line(groups_npz, run_cli):
    code, out, err = run_cli(["reid", str(groups_npz), "--examples", "0", "--seed", "3"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()]
    assert "--seed does not apply here" in err and "--examples 0 stores none" in err


@pytest.mark.parametrize("args", [["--examples", "2", "--seed", "3"], ["--examples", "0"], ["--seed", "3"]])
def test_seed_with_examples_or_examples_alone_still_run(groups_npz, run_cli, args):
    code, out, err = run_cli(["reid", str(groups_npz), "--json", *args])
    assert code == 0, err
    assert '"mAP"' in out or '"map"' in out
