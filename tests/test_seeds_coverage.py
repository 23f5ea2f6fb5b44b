"""The seed coverage guard: every dmlkit name in docs/seeds.md must exist (issue 19, point 3).

docs/seeds.md lists each loss, miner, sampler, distance, metric, protocol step and application
the seed documents name, with the dmlkit name implementing it. This module parses that table
and checks each reference: registry names must be registered (and build with the listed
parameters), Python paths must import, CLI commands must be registered.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "seeds.md"
KINDS = ("loss", "miner", "distance", "metric", "dataset", "trunk", "transform", "cli", "py")
_REF = re.compile(rf"^({'|'.join(KINDS)}):([A-Za-z0-9_.:]+)(?:\((.*)\))?$")
_NOT_COVERED = "## Named in the seeds but not in dmlkit"


def parse_seed_table(text: str) -> list[dict[str, object]]:
    """Rows ``{kind, method, refs, seeds, line}`` of every table whose header is
    ``| kind | method ... | dmlkit | seeds |`` before the "not in dmlkit" section."""
    rows: list[dict[str, object]] = []
    covered = text.split(_NOT_COVERED)[0]
    in_table = False
    for number, line in enumerate(covered.splitlines(), start=1):
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "kind" and len(cells) == 4 and cells[2] == "dmlkit":
            in_table = True
            continue
        if not in_table or set(cells[0]) <= {"-", " "}:
            continue
        refs = re.findall(r"`([^`]+)`", cells[2])
        rows.append({"kind": cells[0], "method": cells[1], "refs": refs, "seeds": cells[3], "line": number})
    return rows


def _params(text: str | None) -> dict[str, object]:
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def _with_sizes(cls: type, params: dict[str, object]) -> dict[str, object]:
    """Proxy/classification losses need the number of classes and the embedding size."""
    sig = inspect.signature(cls.__init__).parameters
    extra = {k: v for k, v in (("num_classes", 4), ("embedding_size", 8)) if k in sig and k not in params}
    return {**extra, **params}


def check_reference(ref: str) -> None:
    """Raise AssertionError (with what is missing) unless ``ref`` names something in dmlkit."""
    m = _REF.match(ref)
    assert m, f"{ref!r} is not of the form kind:name[(k=v, ...)] with kind in {KINDS}"
    kind, name, raw = m.groups()
    params = _params(raw)
    if kind == "loss":
        from dmlkit.losses import LOSSES, get_loss

        assert name in LOSSES, f"loss {name!r} is not registered (LOSSES: {sorted(LOSSES)})"
        get_loss(name, **_with_sizes(LOSSES[name], params))
    elif kind == "miner":
        from dmlkit.miners import MINERS, get_miner

        assert name in MINERS, f"miner {name!r} is not registered (MINERS: {sorted(MINERS)})"
        get_miner(name, **params)
    elif kind == "distance":
        from dmlkit.distances import get_distance

        get_distance(name, **params)
    elif kind == "metric":
        from dmlkit.metrics import evaluate

        x = np.random.default_rng(0).normal(size=(24, 4)).astype(np.float32)
        y = np.repeat(np.arange(4), 6)
        out = evaluate(x, y, metrics=[name], k_values=(1, 2))
        assert out, f"metric {name!r} produced nothing"
    elif kind == "dataset":
        from dmlkit.data import DATASETS

        assert name in DATASETS, f"dataset {name!r} is not registered ({sorted(DATASETS)})"
    elif kind == "trunk":
        import torchvision

        from dmlkit.models import TRUNKS

        known = set(TRUNKS) | set(torchvision.models.list_models())
        assert name in known, f"trunk {name!r} is neither registered ({sorted(TRUNKS)}) nor a torchvision model"
    elif kind == "transform":
        from dmlkit.data.transforms import PRESETS

        assert name in PRESETS, f"transform preset {name!r} is unknown ({PRESETS})"
    elif kind == "cli":
        from typer.main import get_command

        from dmlkit.cli import app

        commands = get_command(app).commands  # type: ignore[attr-defined]
        assert name in commands, f"`dmlkit {name}` is not a command ({sorted(commands)})"
    else:  # py
        module, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module)
        except ImportError as exc:
            raise AssertionError(f"cannot import {module}: {exc}") from exc
        for part in filter(None, attr.split(".")):
            assert hasattr(obj, part), f"{module} has no attribute {attr!r}"
            obj = getattr(obj, part)


ROWS = parse_seed_table(DOC.read_text())


def test_the_table_is_there_and_covers_every_kind():
    kinds = {r["kind"] for r in ROWS}
    assert {"loss", "miner", "sampler", "distance", "metric", "protocol", "application"} <= kinds
    assert len(ROWS) >= 90
    for r in ROWS:
        assert r["refs"], f"docs/seeds.md line {r['line']}: {r['method']!r} names no dmlkit entry"
        assert re.fullmatch(r"\d{3}(, \d{3})*", str(r["seeds"])), f"line {r['line']}: seeds {r['seeds']!r}"


# names issue 19 lists explicitly: they must stay in the table
REQUIRED = {
    "loss:contrastive", "loss:triplet", "loss:nca", "loss:lifted_structure", "loss:n_pairs",
    "loss:angular", "loss:margin", "loss:multi_similarity", "loss:snr_contrastive", "loss:proxy_nca",
    "loss:proxy_anchor", "loss:normalized_softmax", "loss:sphereface", "loss:cosface",
    "loss:arcface", "loss:large_margin_softmax", "loss:soft_triple", "loss:fastap", "loss:ntxent",
    "loss:tuplet_margin", "loss:circle", "loss:prototypical", "loss:coupled_clusters",
    "loss:distance_logistic", "loss:cosine_similarity", "loss:ranked_list",
    "miner:batch_all", "miner:batch_hard", "miner:semi_hard", "miner:distance_weighted",
    "miner:multi_similarity", "miner:all_pairs", "miner:hard_negative_pairs",
    "py:dmlkit.apps.reid", "py:dmlkit.apps.patches", "py:dmlkit.apps.tracking", "py:dmlkit.metrics.roc:fpr95",
}


def test_the_issue_19_names_are_listed():
    listed = {re.sub(r"\(.*\)$", "", ref) for r in ROWS for ref in r["refs"]}
    assert REQUIRED <= listed, f"missing from docs/seeds.md: {sorted(REQUIRED - listed)}"


@pytest.mark.parametrize("ref", sorted({ref for r in ROWS for ref in r["refs"]}))
def test_every_listed_name_exists(ref):
    check_reference(ref)


def test_the_guard_catches_a_missing_name():
    with pytest.raises(AssertionError, match="not registered"):
        check_reference("loss:no_such_loss")
    with pytest.raises(AssertionError, match="cannot import"):
        check_reference("py:dmlkit.apps.no_such_app")
    with pytest.raises(AssertionError, match="no attribute"):
        check_reference("py:dmlkit.apps.verification:no_such_function")
    with pytest.raises(TypeError):
        check_reference("loss:triplet(no_such_option=1)")
    with pytest.raises(AssertionError, match="not a command"):
        check_reference("cli:no_such_command")
    with pytest.raises(AssertionError, match="nor a torchvision model"):
        check_reference("trunk:no_such_trunk")
    with pytest.raises(AssertionError, match="not of the form"):
        check_reference("method:contrastive")
    rows = parse_seed_table("| kind | method | dmlkit | seeds |\n| --- | --- | --- | --- |\n"
                            "| loss | X | `loss:a` + `miner:b(k=1)` | 000 |\n\n" + _NOT_COVERED +
                            "\n| kind | method | dmlkit | seeds |\n| loss | Y | `loss:c` | 003 |\n")
    assert [r["refs"] for r in rows] == [["loss:a", "miner:b(k=1)"]]
