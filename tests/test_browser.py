"""The Explorer in a real browser: Voila serves a notebook, Chromium (Debian's) clicks it.

Checks what the spec tests cannot: the chart draws from bundled JavaScript (no request
leaves 127.0.0.1), a person's dropdown choice and toggle click redraw it in place, and the
page logs no JavaScript errors.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest

import lenscape

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
NOTEBOOK = """\
import numpy as np
from lenscape import schema
from lenscape.widgets import Explorer

values = np.random.default_rng(0).normal(size=(3, 6, 4))
scores = schema.make(values, dims=("cluster", "layer", "head"), n_layers=6, attrs=dict(
    long_name="attribution", units="logit diff", method="synthetic", metric="logit_diff",
    model="synthetic", backend="none", dtype="float64"))
Explorer(scores, x="head", y="layer")
"""
CHART = ".vega-embed svg.marks"
#: Voila's own page template links Font Awesome CSS from a CDN (its bundle also carries the
#: fonts, so the page works without them); every other outside request is a failure.
VOILA_TEMPLATE_CDN = "https://cdn.jsdelivr.net/npm/@fortawesome/fontawesome-free@"


@pytest.fixture
def chromium():
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing; apt-get install -y --no-install-recommends chromium"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def voila_url(tmp_path):
    """Serve a small synthetic-Explorer notebook with Voila; stop it afterwards."""
    notebook = tmp_path / "explorer.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, notebook)
    port = _free_port()
    source = str(Path(lenscape.__file__).parents[1])  # the kernel imports this same lenscape
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [source, *filter(None, [os.environ.get("PYTHONPATH")])])}
    log_path = tmp_path / "voila.log"
    log = open(log_path, "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "voila", str(notebook), "--no-browser", "--Voila.ip=127.0.0.1",
         f"--Voila.port={port}", "--Voila.port_retries=0",
         # Notebook 7's lab extension fails to load inside Voila (a module-federation error
         # unrelated to lenscape) and adds nothing to a dashboard.
         "--VoilaConfiguration.extension_denylist=@jupyter-notebook/lab-extension"],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    raise RuntimeError(f"Voila did not start:\n{log_path.read_text()}")
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=5)
        log.close()


def test_explorer_redraws_in_the_browser_offline(chromium, voila_url, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            def console(msg):
                if msg.type == "error" and not msg.location.get("url", "").startswith(
                        VOILA_TEMPLATE_CDN):
                    errors.append(msg.text)

            page.on("console", console)
            page.on("pageerror", lambda err: errors.append(f"pageerror: {err}"))

            def local_only(route):  # the page must work with no internet
                if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            page.route("**/*", local_only)
            page.goto(voila_url, timeout=120_000)
            chart = page.locator(CHART)
            expect(chart).to_be_visible(timeout=120_000)
            title = chart.locator("text", has_text="attribution ·")
            expect(title).to_have_text("attribution · mean over cluster", timeout=10_000)
            before = chart.inner_html()

            dropdown = page.get_by_label("cluster", exact=True)
            dropdown.select_option(label="2")
            expect(title).to_have_text("attribution · cluster = 2", timeout=20_000)
            assert chart.inner_html() != before

            x_axis = chart.locator("[aria-label^='X-axis titled']")
            expect(x_axis).to_have_attribute("aria-label", re.compile("^X-axis titled 'head'"))
            page.get_by_role("button", name="swap axes").click()
            expect(x_axis).to_have_attribute("aria-label", re.compile("^X-axis titled 'layer'"),
                                             timeout=20_000)
            assert page.locator(".vega-embed").count() == 1  # redrawn in place, never stacked
            page.screenshot(path=tmp_path / "explorer.png", full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "explorer.png").stat().st_size > 0
    assert [u for u in outside if not u.startswith(VOILA_TEMPLATE_CDN)] == [], outside
    assert errors == [], f"JavaScript errors: {errors}"
