"""Security audit s42, rendered output and the service (F4, F6, F7, F10, F11, F12): method names
that broke ``compare``'s markdown, YAML alias bombs, thumbnails that answered 500, rich markup
in file names, the service's missing security headers and CDN-loaded docs, TorchScript trust."""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
import warnings
import zlib
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
import yaml

from dmlkit.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[1]

# -- F6: compare's markdown ------------------------------------------------------------------------

HOSTILE = ["<script>alert(8)</script>|=cmd", '"><img src=x onerror=alert(9)> a|b',
           "back\\slash|`code` *em* [x](javascript:alert(1)) &amp;", "two\nlines\r\nand\u2028more"]


def _report(names: list[str]) -> dict:
    """A :func:`dmlkit.protocol.compare.compare_results` report over ``names`` (numbers made up)."""
    comparisons = [{"a": a, "b": b, "mode": "concatenated", "metric": "map_at_r", "diff": 0.01,
                    "ci_low": -0.01, "ci_high": 0.03, "p": 0.2, "p_holm": 0.4, "significant": False,
                    "variance": "seeds and queries"} for a in names for b in names if a < b]
    rows = {n: {m: {"map_at_r": 1.5} for m in ("concatenated", "separated")} for n in names}
    return {"confidence": 0.95, "seeds": {n: 3 for n in names}, "queries": 100, "comparisons": comparisons,
            "min_seeds_for_significance": 3, "warnings": [f"{names[0]} has 1 seed: <b>too few</b>"],
            "relative_improvement": {"contrastive": {"method": names[1], "relative_percent": rows}}}


def _cells(row: str) -> list[str]:
    """A GFM table row's cells: split at ``|`` that no backslash escapes (GFM spec 4.10)."""
    cells, cell, i = [], "", 0
    body = row.strip()[1:-1]
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            cell += body[i:i + 2]
            i += 2
            continue
        if body[i] == "|":
            cells.append(cell)
            cell = ""
        else:
            cell += body[i]
        i += 1
    return [*cells, cell]


def _unescape(cell: str) -> str:
    """What a Markdown renderer shows for a cell :func:`markdown_text` wrote."""
    text = re.sub(r"\\(.)", r"\1", cell.strip())
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def test_compare_markdown_keeps_method_names_as_text_in_their_cells():
    """Was: ``compare -o x.md`` wrote the names raw: a ``<script>`` element in the file, and rows
    of 10 or 11 cells under a header of 9 (b_bench_names.py)."""
    from dmlkit.protocol.compare import render_compare_markdown

    md = render_compare_markdown(_report(HOSTILE))
    assert "<script" not in md and "<img" not in md and "<b>" not in md
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in md.split("\n\n")]
    tables = [t for t in tables if t]
    assert len(tables) == 2
    shown = set()
    for table in tables:
        width = len(_cells(table[0]))
        assert all(len(_cells(row)) == width for row in table), table
        shown |= {_unescape(_cells(row)[0]) for row in table[2:]}
    assert shown == {" ".join(n.splitlines()) for n in HOSTILE}  # a name with line breaks: one row


def test_markdown_text_leaves_plain_method_names_alone():
    from dmlkit.protocol.compare import markdown_text

    for name in ("multi_similarity", "ms+miner", "arcface.v2", "proxy-anchor"):
        assert markdown_text(name) == name


# -- F7: YAML alias bombs --------------------------------------------------------------------------

def _laughs(levels: int, fan: int = 10, indent: str = "") -> str:
    """A "billion laughs": anchor ``l0`` and ``levels`` levels of ``fan`` aliases each."""
    return f"{indent}l0: &l0 [lol]\n" + "".join(
        f"{indent}l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * fan) + "]\n" for i in range(1, levels + 1))


def test_a_yaml_alias_bomb_is_refused_in_one_line(tmp_path):
    """Was: 1 KB of YAML with 10^9 leaves loaded (shared objects) and then ran for minutes
    where pydantic's ``model_dump`` copied them (a_yaml.py)."""
    from dmlkit.config_yaml import load_yaml, read_yaml_mapping

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("name: x\nloss:\n  name: triplet\n  params:\n" + _laughs(9, indent="    "))
    with pytest.raises(ConfigError, match=r"bomb.yaml is not valid YAML: .*its aliases \(\*name\) would copy "
                                          r"\d+ nodes, more than the 10000") as info:
        read_yaml_mapping(bomb, "settings", "docs/configuration.md")
    assert "\n" not in str(info.value)
    for text in ("a: &a [*a]\n", "a: &a {b: [1, *a]}\n"):  # a node inside itself
        with pytest.raises(yaml.YAMLError, match="an alias names a node that contains it"):
            load_yaml(text)


def test_the_train_command_refuses_an_alias_bomb_in_a_free_form_section(tmp_path, run_cli):
    """10^5 leaves in ``loss.params``: one line and exit 2, before the config is validated
    (the 10^9 of a_yaml.py ran past 60 s)."""
    config = tmp_path / "c.yaml"
    config.write_text("name: x\nloss:\n  name: triplet\n  params:\n    margin: 0.2\n" + _laughs(5, indent="    "))
    code, out, err = run_cli(["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "its aliases (*name) would copy" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_shared_sections_presets_and_documented_configs_still_load():
    from dmlkit.config_yaml import MAX_ALIAS_EXPANSION, PRESET_DIR, load_yaml, read_yaml_mapping

    text = ("base: &d {x: 1, y: [1, 2, 3]}\nc:\n  <<: *d\n  x: 3\nd: *d\n" + _laughs(3))  # 1,110 copies
    data = load_yaml(text)
    assert data["c"] == {"x": 3, "y": [1, 2, 3]} and data["d"] == data["base"] and len(data["l3"]) == 10
    assert MAX_ALIAS_EXPANSION == 10_000
    presets = sorted(PRESET_DIR.glob("*.yaml"))
    assert len(presets) >= 10
    for path in presets:
        assert read_yaml_mapping(path, "settings", "docs")
    blocks = [b for doc in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
              for b in re.findall(r"```ya?ml\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)]
    assert blocks
    for block in blocks:
        try:
            expected = yaml.safe_load(block)
        except yaml.YAMLError:  # an excerpt with "..." in it: not a whole file
            continue
        assert load_yaml(block) is not None or expected is None
