"""The search page in headless Chromium: upload an image, see the results grid; verify two images."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from dmlkit.cli import app as cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, data_root):
    pytest.importorskip("fastapi")
    from dmlkit.apps.service import ServiceConfig, create_app, start_background_server
    from test_service import trained_run

    run = trained_run(tmp_path_factory, data_root)
    base = tmp_path_factory.mktemp("browser")
    res = CliRunner().invoke(cli, ["index", str(run / "embeddings" / "test.npz"), "-o", str(base / "index"),
                                   "--kind", "ivf_flat", "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["verify", str(run / "embeddings" / "test.npz"), "--pairs", "400", "--json"])
    assert res.exit_code == 0, res.output
    threshold = json.loads(res.stdout)["threshold"]
    app = create_app(ServiceConfig(index=base / "index", model=run, threshold=threshold))
    srv, thread, url = start_background_server(app)
    yield {"url": url, "app": app, "data_root": data_root, "base": base}
    srv.should_exit = True
    thread.join(timeout=10)


def test_upload_shows_the_results_grid_and_verify_shows_the_decision(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    from PIL import Image

    idx = server["app"].state.index
    item = idx.ids[42]
    query = tmp_path / "query.png"  # browsers do not preview PGM; PNG is lossless, same pixels
    with Image.open(server["data_root"] / item) as img:
        img.save(query)
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"failed request {r.url}"))
            page.goto(server["url"] + "/")
            # predicates as functions: Playwright evals a polled string in the page, which the
            # service's Content-Security-Policy (no 'unsafe-eval') refuses
            page.wait_for_function("() => document.getElementById('status').textContent.includes('items')", timeout=20000)
            assert f"{len(idx)} items" in page.inner_text("#status")

            page.set_input_files("#query-file", str(query))
            page.wait_for_function("() => document.querySelectorAll('#results .card').length === 8", timeout=30000)
            page.wait_for_function(
                "() => [...document.querySelectorAll('#results .card img')].every(i => i.complete && i.naturalWidth > 0)",
                timeout=30000)
            cards = page.eval_on_selector_all("#results .card", "els => els.map(e => e.innerText)")
            assert item in cards[0] and "#1" in cards[0]
            assert "nearest items" in page.inner_text("#query-message")

            page.set_input_files("#verify-file-1", str(query))
            page.set_input_files("#verify-file-2", str(query))
            page.click("#verify-button")
            page.wait_for_function("() => document.getElementById('verify-result').className !== ''", timeout=30000)
            result = page.inner_text("#verify-result")
            assert page.get_attribute("#verify-result", "class") == "same"
            assert "threshold" in result and "score 1.0000" in result

            page.set_input_files("#query-file", {"name": "notes.png", "mimeType": "image/png", "buffer": b"not an image"})
            page.wait_for_function("() => document.getElementById('query-message').className === 'error'", timeout=30000)
            assert "400" in page.inner_text("#query-message")
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    # the deliberate bad upload logs one failed resource (400) and the broken preview image
    unexpected = [e for e in errors if "400" not in e and "notes.png" not in e and "blob:" not in e]
    assert not unexpected, errors
    assert shot.stat().st_size > 20000
