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
    from dmlkit.protocol.results import markdown_text

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


# -- F10: thumbnails of files PIL refuses ------------------------------------------------------------

def _png(*chunks: tuple[bytes, bytes]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", 4, 4, 8, 0, 0, 0, 0)
    pixels = zlib.compress(b"\x00\x80\x80\x80\x80" * 4)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + b"".join(chunk(k, d) for k, d in chunks)
            + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


@pytest.fixture()
def served_files(tmp_path):
    pytest.importorskip("fastapi")
    from PIL import Image

    from dmlkit.apps import EmbeddingIndex

    root = tmp_path / "root"
    root.mkdir()
    Image.new("L", (20, 20), 128).save(root / "ok.png")
    text_bomb = b"k\x00\x00" + zlib.compress(b"A" * 2 * 2**20)  # 2 MB of text, PIL's limit is 1 MB
    (root / "ztxt.png").write_bytes(_png((b"zTXt", text_bomb)))
    (root / "iccp.png").write_bytes(_png((b"iCCP", text_bomb)))
    ids = ["ok.png", "ztxt.png", "iccp.png"]
    x = np.random.default_rng(0).normal(size=(len(ids), 8)).astype(np.float32)
    return EmbeddingIndex(x, labels=np.arange(len(ids)), ids=ids), root


def _client(index, root):
    from fastapi.testclient import TestClient

    from dmlkit.apps.service import ServiceConfig, create_app

    return TestClient(create_app(ServiceConfig(index="unused", data_root=root), index=index),
                      raise_server_exceptions=False)


def test_a_thumbnail_pil_refuses_with_valueerror_is_a_404_with_one_log_line(served_files, caplog):
    """Was: PIL's ``ValueError`` (a zTXt or iCCP chunk that decompresses past its limit) answered
    500 and logged a traceback (e_serve.py)."""
    c = _client(*served_files)
    assert c.get("/api/items/ok.png/thumbnail").status_code == 200
    with caplog.at_level(logging.WARNING):
        for item in ("ztxt.png", "iccp.png"):
            r = c.get(f"/api/items/{item}/thumbnail")
            assert r.status_code == 404, r.text
            assert r.json()["detail"] == (f"no image for {item!r}: its file cannot be read as an image "
                                          "(ValueError; the server's log says more)")
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in caplog.records)


def test_a_thumbnail_pil_refuses_with_syntaxerror_is_a_404(served_files, monkeypatch, caplog):
    """PIL raises ``SyntaxError`` for some damaged files while it decodes them."""
    import dmlkit.data

    def broken(img, what):
        raise SyntaxError("broken PNG file")

    monkeypatch.setattr(dmlkit.data, "upright_8bit", broken)
    c = _client(*served_files)
    with caplog.at_level(logging.WARNING):
        r = c.get("/api/items/ok.png/thumbnail")
    assert r.status_code == 404 and "SyntaxError" in r.json()["detail"], r.text
    assert all(r.exc_info is None for r in caplog.records)


# -- F12: security headers and no CDN docs -----------------------------------------------------------

def test_every_response_has_nosniff_and_a_restrictive_csp_and_docs_load_no_cdn(served_files):
    """Was: no ``X-Content-Type-Options`` or CSP header, and ``/docs`` loaded Swagger UI from
    cdn.jsdelivr.net."""
    from dmlkit.apps.service.middleware import CONTENT_SECURITY_POLICY

    c = _client(*served_files)
    for path, status in (("/", 200), ("/static/app.js", 200), ("/api/health", 200), ("/openapi.json", 200),
                         ("/api/items/ok.png/thumbnail", 200), ("/api/items/nope/thumbnail", 404)):
        r = c.get(path)
        assert r.status_code == status, path
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert r.headers["referrer-policy"] == "no-referrer"
    for directive in ("default-src 'none'", "script-src 'self';", "frame-ancestors 'none'", "base-uri 'none'"):
        assert directive in CONTENT_SECURITY_POLICY
    assert "unsafe-eval" not in CONTENT_SECURITY_POLICY and "http" not in CONTENT_SECURITY_POLICY
    for path in ("/docs", "/redoc"):
        r = c.get(path)
        assert r.status_code == 404 and "cdn" not in r.text
    assert c.get("/openapi.json").json()["info"]["title"] == "dmlkit visual search"
    # the page itself links nothing outside the service
    page = c.get("/").text + c.get("/static/app.js").text
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    r = c.get("/", headers={"host": "evil.example"})  # the host check's answer carries them too
    assert r.headers["x-content-type-options"] == "nosniff"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_the_page_works_under_its_csp_which_blocks_inline_script(served_files, tmp_path):
    """The page in headless Chromium: its script, styles, API calls, thumbnails and previews of
    picked files load under the policy, with no violation; an inline script does not run."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    from PIL import Image

    from dmlkit.apps.service import ServiceConfig, create_app, start_background_server

    index, root = served_files
    srv, thread, url = start_background_server(create_app(ServiceConfig(index="unused", data_root=root),
                                                          index=index))
    picked = tmp_path / "pick.png"
    Image.new("RGB", (30, 20), (200, 10, 10)).save(picked)
    errors: list[str] = []
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                      "--disable-component-update", "--disable-sync", "--no-first-run"])
            try:
                page = browser.new_page()
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("requestfailed", lambda r: errors.append(f"failed request {r.url}"))
                page.add_init_script("window.__violations = [];"
                                     "document.addEventListener('securitypolicyviolation',"
                                     " e => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")
                page.goto(url + "/")
                # predicates as functions: Playwright evals a polled string in the page, which the
                # policy (no 'unsafe-eval') refuses
                page.wait_for_function("() => document.getElementById('status').textContent.includes('items')",
                                       timeout=20000)
                assert "3 items" in page.inner_text("#status")
                page.wait_for_function("() => document.getElementById('k').max !== ''", timeout=20000)  # /api/info
                # the inline <style> block and the style attribute apply
                assert page.eval_on_selector("header", "e => getComputedStyle(e).backgroundColor") == "rgb(29, 35, 48)"
                assert page.eval_on_selector("#k", "e => e.style.width") == "4em"
                # a picked file's preview (blob:) and a thumbnail (the service) load
                page.set_input_files("#verify-file-1", str(picked))
                page.wait_for_function("() => { const i = document.getElementById('verify-preview-1');"
                                       " return !i.hidden && i.complete && i.naturalWidth === 30; }",
                                       timeout=20000)
                page.evaluate("(() => { const i = document.createElement('img'); i.id = 'thumb';"
                              f" i.src = '/api/items/{quote('ok.png', safe='')}/thumbnail';"
                              " document.body.append(i); })()")
                page.wait_for_function("() => document.getElementById('thumb').complete"
                                       " && document.getElementById('thumb').naturalWidth > 0", timeout=20000)
                assert page.evaluate("window.__violations") == []
                # markup that slipped into the page could not run script
                page.evaluate("(() => { const s = document.createElement('script');"
                              " s.textContent = 'window.__ran = 1'; document.body.append(s); })()")
                page.wait_for_function("() => window.__violations.length > 0", timeout=10000)
                assert page.evaluate("window.__ran") is None
                assert any("script-src" in v for v in page.evaluate("window.__violations"))
            finally:
                browser.close()
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
    # the one error expected: Chromium's console line for the inline script it refused
    assert [e for e in errors if "Content Security Policy" not in e] == [], errors
    assert len(errors) == 1 and "inline script" in errors[0], errors


# -- F11: rich markup in file names ------------------------------------------------------------------

MARKUP_NAME = "emb[red]HIDDEN[blink]"


@pytest.fixture()
def markup_embeddings(tmp_path):
    from dmlkit.embeddings import save_embeddings

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 6)
    x = (rng.normal(size=(6, 5))[y] + 0.5 * rng.normal(size=(36, 5))).astype(np.float32)
    path = tmp_path / f"{MARKUP_NAME}.npz"
    save_embeddings(path, x, y)
    return path


def test_evaluate_and_fewshot_print_file_names_as_text(markup_embeddings, run_cli):
    """Was: ``evaluate 'emb[red]HIDDEN[blink].npz'`` titled its table ``embHIDDEN.npz`` (and
    ``fewshot`` the same)."""
    code, out, err = run_cli(["evaluate", str(markup_embeddings), "-m", "precision_at_1"])
    assert code == 0, err
    assert f"{MARKUP_NAME}.npz (leave-one-out)" in " ".join(out.split())  # the title wraps at the table's width
    code, out, err = run_cli(["fewshot", str(markup_embeddings), "--way", "3", "--episodes", "5"])
    assert code == 0, err
    assert f"3-way 1-shot: {MARKUP_NAME}.npz" in " ".join(out.split())


def test_track_evaluate_prints_its_root_as_text(tmp_path, run_cli):
    from dmlkit.apps.tracking import build_offline_dataset

    root = tmp_path / "d[/x][red]R"
    build_offline_dataset(root, num_train=1, num_test=1, train_frames=2, test_frames=3, seed=1,
                          frame_size=(96, 96))
    code, out, err = run_cli(["track", "evaluate", str(root / "test"), "--dataset", "otb", "--methods", "ncc"])
    assert code == 0, err
    assert "d[/x][red]R" in "".join(out.split()), out


# -- F4: a TorchScript export is code --------------------------------------------------------------

def test_serve_notes_that_a_torchscript_export_is_a_program(tmp_path, capsys):
    """``serve --model x.pt`` (TorchScript) says in one line that the file is a program to
    trust; the port here is out of range, so the server stops right after."""
    pytest.importorskip("fastapi")
    torch = pytest.importorskip("torch")
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.service import ServiceConfig
    from dmlkit.apps.service.app import run_server

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4))).save(str(tmp_path / "m.pt"))
    (tmp_path / "m.pt.json").write_text(json.dumps(
        {"format": "torchscript", "preprocessing": {"transform": None, "image_size": 8, "in_channels": 1}}))
    EmbeddingIndex(np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32), labels=np.arange(3),
                   ids=["a", "b", "c"]).save(tmp_path / "idx")
    with pytest.raises(ConfigError, match="cannot listen"):
        run_server(ServiceConfig(index=tmp_path / "idx", model=tmp_path / "m.pt"), port=70000)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {tmp_path / 'm.pt'} is a TorchScript export: a program, run as it is loaded and "
                     "called (it can read the server's files); serve only exports you made, ONNX for models "
                     "from others"]
    assert "TorchScript export is a program" in (REPO / "docs" / "search.md").read_text(encoding="utf-8")

