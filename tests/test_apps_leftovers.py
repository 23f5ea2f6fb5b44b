"""Follow-ups of the applications audit: each test pins an option that was silently ignored or
did not do what its docs say, a file that a kill could leave half-written, or a result field that
counted something else than its name (re-id, patches, verification, tracking)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dmlkit.embeddings import save_embeddings

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


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
    line = _one_error_line(code, err)
    assert extra[0] in line and "drop it" in line


def test_market_refuses_repeats_and_rerank_settings_without_rerank(reid_files, run_cli) -> None:
    """--repeats counts VehicleID's gallery draws; --k1/--k2/--lambda set the re-ranking."""
    _, market = reid_files
    code, _, err = run_cli(["reid", str(market), "--repeats", "3", "--json"])
    assert "--repeats" in _one_error_line(code, err)
    code, _, err = run_cli(["reid", str(market), "--k1", "5", "--json"])
    assert "--rerank" in _one_error_line(code, err)


def test_reid_options_that_apply_still_run(reid_files, run_cli, tmp_path: Path) -> None:
    vid, market = reid_files
    code, out, err = run_cli(["reid", str(vid), "--repeats", "2", "--seed", "1", "--json"])
    assert code == 0, err
    assert '"vehicleid"' in out
    code, out, err = run_cli(["reid", str(market), "--rerank", "--k1", "3", "--k2", "2", "--lambda", "0.5",
                              "--no-camera-rule", "--examples", "2", "-o", str(tmp_path / "r.json"), "--json"])
    assert code == 0, err
    assert '"rerank"' in out
