"""The Explorer in a real browser: Voila serves a notebook, Chromium (Debian's) clicks it.

Checks what the spec tests cannot: the chart draws from bundled JavaScript (no request
leaves 127.0.0.1, and there is no actions menu whose links would), a person's dropdown
choice and toggle click redraw it in place, a click on a heatmap cell brings the cell's
per-prompt values and the head's attention pattern beside the chart (click-to-detail time
measured in the page, median <= 200 ms), a typed custom prompt redraws the chart and a bad
one is explained with the chart kept, and the page logs no JavaScript errors. A page of
synthetic results checks the views cannot mislead: two charts with colour legends keep their
own gradients, a mean over prompts hatches the cells whose interval includes 0 (with its
legend entry, low, high and N on hover, and the interval beside a clicked cell's bars),
prompts the model gets wrong are flagged and can be left out, the details follow the
selection from one prompt to the mean, a threshold past every value is noted, and the logit
lens shows the input tokens in order with the top tokens on hover. Every request
not to 127.0.0.1 is blocked and recorded; the list must be empty (but for Voila's own page
template, below). Screenshots go to ``$LENSCAPE_ARTIFACTS`` (default ``out/test-artifacts``)
with the measured times. A missing /usr/bin/chromium fails the tests unless
``LENSCAPE_SKIP_BROWSER=1`` (``make test`` installs it as root: .ci/ensure-chromium).
"""

import contextlib
import json
import os
import re
import signal
import socket
import statistics
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
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
NOTEBOOK = """\
import numpy as np
from lenscape import schema
from lenscape.views.explorer import Explorer

values = np.random.default_rng(0).normal(size=(3, 6, 4))
scores = schema.make(values, dims=("cluster", "layer", "head"), n_layers=6, attrs=dict(
    long_name="attribution", units="logit diff", method="synthetic", metric="logit_diff",
    model="synthetic", backend="none", dtype="float64"))
Explorer(scores, x="head", y="layer")
"""
#: A tiny random model scored by attribution patching, with the detail view and the prompt
#: form of the quickstart: the real data path, fast enough for a test.
TEACHING_NOTEBOOK = """\
import torch

import lenscape as lsc
from lenscape import models

# A tiny model gains nothing from threads, and on a busy machine two threads wait on each
# other (25 ms vs 50-300 ms per pattern): the timing is of lenscape's click path.
torch.set_num_threads(1)

model = models.tiny("llama", n_layers=3, seed=0)
prompts = lsc.data.prompts("factual")[:3]


def head_pattern(cell):
    pattern = lsc.attention_pattern(model, cell["text"], layer=cell["layer"], head=cell["head"])
    return lsc.heatmap(pattern, x="key_pos", y="query_pos",
                       title=f"Attention of layer {cell['layer']}, head {cell['head']}")


form = lsc.PromptForm(lambda record: lsc.attribution_patching(model, [record], level="head",
                                                              progress=False),
                      example=prompts[0], detail=head_pattern)
form
"""
CHART = ".vega-embed svg.marks"
ROOT = Path(__file__).resolve().parents[1]
#: Click-to-detail target, median over the clicks in the page.
DETAIL_TARGET_MS = 200.0
#: Resolves, after the next click anywhere, with the ms until a chart title starting with
#: ``text`` is in the page (a MutationObserver: no polling delay in the number).
WAIT_FOR_TITLE = """(text) => {
  window.__detailMs = new Promise((resolve) => {
    let start = null;
    document.addEventListener("click", () => { start = performance.now(); },
                              {capture: true, once: true});
    const found = () => [...document.querySelectorAll(".vega-embed text")]
        .some((node) => node.textContent.startsWith(text));
    const observer = new MutationObserver(() => {
      if (start !== null && found()) { observer.disconnect(); resolve(performance.now() - start); }
    });
    observer.observe(document.body, {subtree: true, childList: true, characterData: true});
  });
}"""
#: Voila's own page template links Font Awesome CSS from a CDN (its bundle also carries the
#: fonts, so the page works without them); every other outside request is a failure.
VOILA_TEMPLATE_CDN = "https://cdn.jsdelivr.net/npm/@fortawesome/fontawesome-free@"


@pytest.fixture
def chromium():
    """Debian's Chromium; a missing one fails the test unless LENSCAPE_SKIP_BROWSER=1."""
    if not Path(CHROMIUM).exists():
        message = (
            f"{CHROMIUM} is missing; `make test` installs it as root (.ci/ensure-chromium), "
            "or run: apt-get install -y --no-install-recommends chromium"
        )
        if os.environ.get("LENSCAPE_SKIP_BROWSER") == "1":
            pytest.skip(f"LENSCAPE_SKIP_BROWSER=1: {message}")
        pytest.fail(f"{message}; set LENSCAPE_SKIP_BROWSER=1 to skip the browser tests")
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def artifacts():
    """Folder for screenshots and timings kept after the test."""
    folder = Path(os.environ.get("LENSCAPE_ARTIFACTS", ROOT / "out" / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def voila_url(tmp_path):
    """Serve a small synthetic-Explorer notebook with Voila; stop it afterwards."""
    with _voila(tmp_path, NOTEBOOK) as url:
        yield url


@pytest.fixture
def teaching_url(tmp_path):
    """Serve the tiny-model teaching notebook (prompt form, Explorer, attention detail)."""
    with _voila(tmp_path, TEACHING_NOTEBOOK) as url:
        yield url


@contextlib.contextmanager
def _voila(tmp_path, source):
    """Voila serving a one-cell notebook on 127.0.0.1 until the block ends."""
    notebook = tmp_path / "explorer.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, notebook)
    port = _free_port()
    source = str(Path(lenscape.__file__).parents[1])  # the kernel imports this same lenscape
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    log_path = tmp_path / "voila.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "voila",
                str(notebook),
                "--no-browser",
                "--Voila.ip=127.0.0.1",
                f"--Voila.port={port}",
                "--Voila.port_retries=0",
                # Notebook 7's lab extension fails to load inside Voila (a module-federation error
                # unrelated to lenscape) and adds nothing to a dashboard.
                "--VoilaConfiguration.extension_denylist=@jupyter-notebook/lab-extension",
            ],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
                        raise RuntimeError(
                            f"Voila did not start:\n{log_path.read_text()}"
                        ) from None
                    time.sleep(0.5)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=5)


def _open(browser, url, errors, outside):
    """A page on ``url`` that records JavaScript errors and blocks (and records) every
    request not to 127.0.0.1."""
    page = browser.new_page(viewport={"width": 1400, "height": 1100})

    def console(msg):
        if msg.type == "error" and not msg.location.get("url", "").startswith(VOILA_TEMPLATE_CDN):
            errors.append(msg.text)

    def local_only(route):  # the page must work with no internet
        if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    page.on("console", console)
    page.on("pageerror", lambda err: errors.append(f"pageerror: {err}"))
    page.route("**/*", local_only)
    page.goto(url, timeout=120_000)
    return page


def test_explorer_redraws_in_the_browser_offline(chromium, voila_url, artifacts):
    from playwright.sync_api import expect, sync_playwright

    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = _open(browser, voila_url, errors, outside)
            chart = page.locator(CHART)
            expect(chart).to_be_visible(timeout=120_000)
            title = chart.locator("text", has_text="attribution ·")
            expect(title).to_have_text("attribution · cluster = 0", timeout=10_000)
            before = chart.inner_html()

            dropdown = page.get_by_label("cluster", exact=True)
            dropdown.select_option(label="2")
            expect(title).to_have_text("attribution · cluster = 2", timeout=20_000)
            assert chart.inner_html() != before

            x_axis = chart.locator("[aria-label^='X-axis titled']")
            expect(x_axis).to_have_attribute("aria-label", re.compile("^X-axis titled 'head'"))
            page.get_by_role("button", name="swap axes").click()
            expect(x_axis).to_have_attribute(
                "aria-label", re.compile("^X-axis titled 'layer'"), timeout=20_000
            )
            assert page.locator(".vega-embed").count() == 1  # redrawn in place, never stacked
            assert page.locator(".vega-actions").count() == 0  # no menu, no Vega Editor link
            page.screenshot(path=artifacts / "explorer.png", full_page=True)
        finally:
            browser.close()
    assert (artifacts / "explorer.png").stat().st_size > 0
    assert [u for u in outside if not u.startswith(VOILA_TEMPLATE_CDN)] == [], outside
    assert errors == [], f"JavaScript errors: {errors}"


def test_click_detail_attention_and_custom_prompt_in_the_browser(chromium, teaching_url, artifacts):
    from playwright.sync_api import expect, sync_playwright

    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = _open(browser, teaching_url, errors, outside)
            chart = page.locator(CHART).first
            expect(chart).to_be_visible(timeout=120_000)
            assert page.locator(".vega-actions").count() == 0  # no menu, no Vega Editor link

            times = []
            for layer, head in [(0, 0), (1, 1), (2, 2), (0, 3), (1, 0), (2, 1), (0, 2)]:
                title = f"Attention of layer {layer}, head {head}"
                page.mouse.move(5, 5)  # away from the chart: the last tooltip hides
                expect(page.locator("#vg-tooltip-element.visible")).to_have_count(0)
                page.evaluate(WAIT_FOR_TITLE, title)
                chart.locator(f"[aria-label^='head: {head}; layer: {layer};']").click()
                expect(page.locator(".vega-embed text", has_text=title)).to_be_visible(
                    timeout=30_000
                )
                # one prompt: its value beside the chart (several: a bar per prompt)
                expect(
                    page.get_by_text(re.compile(f" at layer {layer}, head {head}: "))
                ).to_be_visible(timeout=5_000)
                times.append(page.evaluate("window.__detailMs"))
            page.screenshot(path=artifacts / "click_detail.png", full_page=True)
            pattern = page.locator(
                ".vega-embed", has=page.locator("text", has_text="Attention of layer")
            )
            expect(pattern.locator("[aria-label^='Y-axis titled']")).to_have_attribute(
                "aria-label", re.compile("^Y-axis titled 'query_pos \\(query_token\\)'")
            )

            before = chart.inner_html()
            page.get_by_label("clean", exact=True).fill("The capital of Spain is the city of")
            page.get_by_label("target", exact=True).fill(" Madrid")
            page.get_by_label("corrupt", exact=True).fill("The capital of Italy")
            page.get_by_label("distractor", exact=True).fill(" Rome")
            page.get_by_label("distractor", exact=True).press("Tab")
            page.get_by_role("button", name="run").click()
            expect(page.get_by_text("differ in length")).to_be_visible(timeout=30_000)
            assert chart.inner_html() == before  # a bad prompt keeps the chart
            page.screenshot(path=artifacts / "custom_prompt_refused.png", full_page=True)

            page.get_by_label("corrupt", exact=True).fill("The capital of Italy is the city of")
            page.get_by_label("corrupt", exact=True).press("Tab")
            page.get_by_role("button", name="run").click()
            expect(page.get_by_text("differ in length")).to_be_hidden(timeout=30_000)
            expect(page.get_by_label("prompt", exact=True)).to_contain_text(
                "The capital of Spain", timeout=30_000
            )
            page.wait_for_function(
                "(before) => document.querySelector('.vega-embed svg.marks').innerHTML !== before",
                arg=before,
                timeout=30_000,
            )
            assert page.locator(CHART).count() == 1  # redrawn in place; old details cleared
            page.screenshot(path=artifacts / "custom_prompt.png", full_page=True)
        finally:
            browser.close()
    median = statistics.median(times)
    (artifacts / "click_to_detail.json").write_text(
        json.dumps(
            {"clicks_ms": times, "median_ms": median, "target_ms": DETAIL_TARGET_MS}, indent=1
        )
    )
    print(
        f"click-to-detail: median {median:.0f} ms over {len(times)} clicks "
        f"({', '.join(f'{t:.0f}' for t in times)} ms)"
    )
    assert outside == [] or all(u.startswith(VOILA_TEMPLATE_CDN) for u in outside), outside
    assert errors == [], f"JavaScript errors: {errors}"


def test_exported_html_has_no_actions_menu_unless_asked(chromium, tmp_path, artifacts):
    import numpy as np
    from playwright.sync_api import expect, sync_playwright

    from lenscape import schema
    from lenscape.views.heatmaps import heatmap
    from lenscape.views.offline import export

    scores = schema.make(
        np.random.default_rng(0).normal(size=(4, 3)),
        dims=("layer", "head"),
        attrs=dict(
            long_name="attribution",
            units="logit diff",
            method="synthetic",
            metric="logit_diff",
            model="synthetic",
            backend="none",
            dtype="float64",
        ),
    )
    pages = {}
    for actions in (False, True):
        pages[actions] = export(
            heatmap(scores, x="head", y="layer", actions=actions),
            tmp_path / f"actions_{actions}.html",
        )
    outside = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.route(
                "**/*",
                lambda route: (
                    route.continue_()
                    if route.request.url.startswith("file://")
                    else (outside.append(route.request.url), route.abort())
                ),
            )
            for actions, path in pages.items():
                page.goto(path.as_uri())
                expect(page.locator(CHART)).to_be_visible(timeout=30_000)
                assert page.locator(".vega-actions").count() == int(actions)
            page.screenshot(path=artifacts / "exported_html.png")
        finally:
            browser.close()
    assert outside == []  # self-contained: nothing fetched, not even fonts


#: Synthetic results on one page: two charts with different colour scales, an Explorer over
#: prompts one of which the model answers wrong, and a logit lens (layer x input token).
TRUTH_NOTEBOOK = """\
import numpy as np
from IPython.display import display

import lenscape as lsc
from lenscape import schema
from lenscape.views.charts import logit_lens_chart
from lenscape.views.explorer import Explorer
from lenscape.views.heatmaps import heatmap

lsc.enable_offline()
A = dict(method="synthetic", metric="logit_diff", model="synthetic", backend="none",
         dtype="float64")
rng = np.random.default_rng(0)
share = schema.make(rng.uniform(size=(4, 3)), dims=("layer", "head"),
                    attrs=dict(A, long_name="share kept", units="share"))
signed = schema.make(rng.normal(size=(4, 3)), dims=("layer", "head"),
                     attrs=dict(A, long_name="effect", units="logit diff"))
display(heatmap(share, x="head", y="layer", title="First chart", color="greens"))
display(heatmap(signed, x="head", y="layer", title="Second chart"))
texts = ["The capital of France is", "The capital of Peru is", "The capital of Japan is"]
scores = schema.make(rng.normal(size=(3, 4, 3)), dims=("prompt", "layer", "head"), n_layers=4,
                     coords={"text": texts,
                             "correct": ("prompt", [True, False, True])},
                     attrs=dict(A, long_name="attribution", units="logit diff"))
display(Explorer(scores))
shape = (3, 4)
lens = schema.make(np.linspace(0, 0.9, 12).reshape(shape), dims=("layer", "pos"), n_layers=3,
                   coords={"token": ("pos", ["The", " capital", " of", " France"]),
                           "target_rank": (("layer", "pos"), np.arange(12).reshape(shape)),
                           "top_token": (("layer", "pos"), np.full(shape, " Paris")),
                           "top_tokens": (("layer", "pos"),
                                          np.full(shape, "' Paris' 0.41 | ' Rome' 0.12"))},
                   attrs=dict(A, long_name="p(' Paris')", units="probability"))
display(logit_lens_chart(lens))
"""
#: For each drawn chart, whether every ``url(#id)`` its SVG uses (legend gradients, clip
#: paths) resolves, in the whole page, to a definition inside that same chart.
OWN_DEFINITIONS = """() => [...document.querySelectorAll('.vega-embed svg.marks')].map((svg) => {
  const refs = [...svg.querySelectorAll('[fill^="url("], [clip-path^="url("]')]
      .map((node) => node.getAttribute('fill') || node.getAttribute('clip-path'))
      .filter((value) => value.startsWith('url('))
      .map((value) => value.slice(value.lastIndexOf('#') + 1, -1));
  return {refs: refs.length,
          own: refs.every((id) => svg.contains(document.getElementById(id)))};
})"""


@pytest.fixture
def truth_url(tmp_path):
    """Serve the synthetic page of charts that must not mislead."""
    with _voila(tmp_path, TRUTH_NOTEBOOK) as url:
        yield url


def test_views_that_cannot_mislead_in_the_browser(chromium, truth_url, artifacts):
    from playwright.sync_api import expect, sync_playwright

    errors, outside = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = _open(browser, truth_url, errors, outside)
            lens = page.locator(".vega-embed", has=page.locator("text", has_text="Logit lens"))
            expect(lens.locator("svg.marks")).to_be_visible(timeout=120_000)
            expect(page.locator(CHART)).to_have_count(4, timeout=30_000)

            # two charts with colour legends: each legend's gradient is its own
            charts = page.evaluate(OWN_DEFINITIONS)
            assert sum(c["refs"] > 0 for c in charts) >= 3, charts
            assert all(c["own"] for c in charts), charts

            explorer = page.locator(".vega-embed").nth(2)  # its details come after it
            title = explorer.locator("text", has_text="attribution · ")
            expect(title).to_have_text("attribution · mean over 3 prompts, 95% interval")
            _check_interval_marks(page, explorer)
            prompt = page.get_by_label("prompt", exact=True)
            expect(prompt.locator("option", has_text="✗ wrong answer")).to_have_text(
                "1 ✗ wrong answer: The capital of Peru is"
            )  # the wrong answer is flagged ...
            page.get_by_label("only prompts the model gets right").check()
            expect(title).to_contain_text(
                "only the 2 of 3 prompts the model gets right, mean over 2 prompts",
                timeout=20_000,
            )  # ... and one switch leaves it out
            page.get_by_label("only prompts the model gets right").uncheck()
            expect(title).to_have_text(
                "attribution · mean over 3 prompts, 95% interval", timeout=20_000
            )

            # the details follow the selection: one prompt's value, then the mean's bars
            prompt.select_option(label="2: The capital of Japan is")
            expect(title).to_contain_text("prompt 2: The capital of Japan is", timeout=20_000)
            explorer.locator("[aria-label^='head: 1; layer: 2;']").click()
            one = page.get_by_text(re.compile(r" at layer 2, head 1: .*\(prompt 2: "))
            expect(one).to_be_visible(timeout=20_000)
            prompt.select_option(label="mean")
            expect(page.locator("text", has_text="layer 2, head 1: per prompt")).to_be_visible(
                timeout=20_000
            )
            interval = re.compile(r", 95% interval \S+ to \S+ \(N = 3\)")  # the bars' subtitle
            expect(page.locator("text", has_text=interval)).to_be_visible()
            expect(one).to_be_hidden()
            page.screenshot(path=artifacts / "truth_details.png", full_page=True)

            # a threshold past every value says the map is one colour
            page.get_by_label("binarize at").check()
            threshold = page.locator(".widget-text input[type='number']")
            threshold.fill("50")
            threshold.press("Enter")
            note = "threshold 50 is above every |value|"
            expect(page.locator("span", has_text=note)).to_be_visible(timeout=20_000)  # above
            expect(explorer.locator("tspan", has_text=note)).to_be_visible()  # in the subtitle

            # the logit lens: input tokens in order on x, the top tokens on hover
            x_axis = lens.locator("[aria-label^='X-axis titled']")
            expect(x_axis).to_have_attribute(
                "aria-label", re.compile("^X-axis titled 'pos \\(token\\)'")
            )
            labels = lens.locator(".role-axis-label text").all_text_contents()
            assert [t.strip() for t in labels[:4]] == ["The", "capital", "of", "France"], labels
            lens.locator("[aria-label^='pos (token): 1; layer: 2;']").hover()
            tooltip = page.locator("#vg-tooltip-element.visible")
            expect(tooltip).to_contain_text("' Paris' 0.41 | ' Rome' 0.12", timeout=10_000)
            expect(tooltip).to_contain_text("target_rank")
            page.screenshot(path=artifacts / "truth_page.png", full_page=True)
            assert page.locator(".vega-actions").count() == 0  # no menu, no Vega Editor link
        finally:
            browser.close()
    # every request not to 127.0.0.1 was blocked and recorded: none may come from lenscape
    assert [u for u in outside if not u.startswith(VOILA_TEMPLATE_CDN)] == [], outside
    assert errors == [], f"JavaScript errors: {errors}"


def _unsure_cells():
    """The (layer, head) cells of the truth page's Explorer whose 95% interval includes 0,
    from the same seeded data (the notebook's third draw)."""
    import numpy as np

    from lenscape import aggregate, schema

    rng = np.random.default_rng(0)
    rng.uniform(size=(4, 3)), rng.normal(size=(4, 3))
    scores = schema.make(
        rng.normal(size=(3, 4, 3)),
        dims=("prompt", "layer", "head"),
        n_layers=4,
        attrs=dict(
            long_name="attribution",
            units="logit diff",
            method="synthetic",
            metric="logit_diff",
            model="synthetic",
            backend="none",
            dtype="float64",
        ),
    )
    interval = aggregate.mean(scores)
    unsure = (interval.sel(bound="low") <= 0) & (interval.sel(bound="high") >= 0)
    return [
        (int(layer), int(head))
        for layer in unsure["layer"]
        for head in unsure["head"]
        if unsure.sel(layer=layer, head=head)
    ]


def _check_interval_marks(page, explorer):
    """A mean over prompts: one hatch per unsure cell and a legend entry that says what it
    means; hovering a cell shows mean, low, high and N; a click on a hatched cell (on its
    hatch's strokes, as a hurried click lands) still selects the cell and brings its bars
    with the interval in words."""
    from playwright.sync_api import expect

    unsure = _unsure_cells()
    assert 0 < len(unsure) < 12, unsure  # the page shows both kinds of cell
    expect(explorer.locator("g.mark-symbol.role-mark path")).to_have_count(len(unsure))
    legend = explorer.locator(".role-legend text", has_text="95% interval includes 0")
    expect(legend).to_be_visible()
    layer, head = unsure[0]
    cell = explorer.locator(f"[aria-label^='head: {head}; layer: {layer};']")
    box = cell.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    tooltip = page.locator("#vg-tooltip-element.visible")
    for text in ("95% interval: low", "95% interval: high", "N (prompts computed)"):
        expect(tooltip).to_contain_text(text, timeout=10_000)
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    bars = page.locator("text", has_text=f"layer {layer}, head {head}: per prompt")
    expect(bars).to_be_visible(timeout=20_000)
    expect(
        page.locator("text", has_text=re.compile(r", 95% interval \S+ to \S+ \(N = 3\)"))
    ).to_be_visible()
    page.mouse.move(5, 5)


#: The text boxes of every SVG text of the page, as Chromium lays them out.
TEXT_BOXES = """() => [...document.querySelectorAll('svg text')].map(t => {
  const b = t.getBoundingClientRect();
  return {text: t.textContent, x: b.x, y: b.y, w: b.width, h: b.height};
})"""


def _circuit_charts():
    """The circuit pictures of a SmolLM2-shaped edge graph (30 layers, 9 heads, 3 key/value
    heads), with the long score description of EAP-IG: the graph, the edge grid of the 40
    busiest senders and 60 busiest receivers (notebook 05's), and a faithfulness curve."""
    import numpy as np
    import xarray as xr

    from lenscape.capture.edges.graph import Graph
    from lenscape.views.circuit import circuit_graph, edge_heatmap, faithfulness_curve

    graph = Graph(30, 9, 3)
    values = np.random.default_rng(0).standard_t(2, size=graph.valid.shape)
    scores = xr.DataArray(
        np.where(graph.valid, values, np.nan),
        dims=("sender", "receiver"),
        coords=graph.coords(),
        attrs={
            "long_name": "EAP-IG (5 steps) edge score (clean -> corrupt) of logit difference "
            "(target - distractor)",
            "units": "logits",
            "method": "edge_attribution",
            "estimator": "eap-ig",
            "steps": 5,
        },
    )
    weight = abs(scores).fillna(0)
    busiest = scores.isel(
        sender=weight.sum("receiver").argsort()[-40:].values,
        receiver=weight.sum("sender").argsort()[-60:].values,
    )
    curve = xr.Dataset(
        {
            "faithfulness": (("budget",), [0.5, 0.9, 1.0]),
            "random_faithfulness": (("seed", "budget"), [[0.0, 0.1, 1.0]]),
            **dict.fromkeys(("cpr", "cmd", "random_cpr", "random_cmd"), 0.5),
        },
        coords={"budget": [0.001, 0.02, 1.0], "n_edges": ("budget", [70, 1400, 70000])},
        attrs={"method": "circuit_faithfulness", "scored_by": "eap-ig"},
    )
    return {
        "graph": circuit_graph(scores, edges=60),
        "grid": edge_heatmap(busiest),
        "curve": faithfulness_curve(curve),
    }, [str(r) for r in busiest["receiver"].values]


def _overlaps(boxes):
    """Pairs of boxes that overlap (by more than half a pixel each way)."""
    return [
        (a["text"], b["text"])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"]) > 0.5
        and min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"]) > 0.5
    ]


def test_circuit_pictures_read_in_the_browser(chromium, tmp_path, artifacts):
    """Drawn by Chromium with its own fonts: every node of the graph is named (columns,
    rows, the embeddings and the logits), no title, legend or label is cut short ("…"),
    the grid's 60 rotated receiver labels do not overlap, and no picture offers the actions
    menu or fetches anything."""
    from playwright.sync_api import expect, sync_playwright

    charts, receivers = _circuit_charts()
    pages = {}
    for name, chart in charts.items():
        pages[name] = tmp_path / f"{name}.html"
        chart.save(pages[name], format="html", inline=True, embed_options={"renderer": "svg"})
    outside, texts = [], {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1400})
            page.route(
                "**/*",
                lambda route: (
                    route.continue_()
                    if route.request.url.startswith("file://")
                    else (outside.append(route.request.url), route.abort())
                ),
            )
            for name, path in pages.items():
                page.goto(path.as_uri())
                expect(page.locator(CHART)).to_be_visible(timeout=30_000)
                assert page.locator(".vega-actions").count() == 0, name
                texts[name] = page.evaluate(TEXT_BOXES)
                page.screenshot(path=artifacts / f"circuit_{name}.png", full_page=True)
        finally:
            browser.close()
    assert outside == []
    for name, boxes in texts.items():
        cut = [box["text"] for box in boxes if box["text"].endswith("…")]
        assert not cut, f"{name}: cut short: {cut}"
    shown = {box["text"] for box in texts["graph"]}
    named = {f"H{h}" for h in range(9)} | {f"L{n}" for n in range(30)}
    assert named | {"MLP", "embeddings", "logits"} <= shown
    labels = [box for box in texts["grid"] if box["text"] in receivers]
    assert len(labels) == len(receivers)
    assert _overlaps(labels) == []


def _collisions(boxes):
    """Every pair of a chart's texts that overlap (``_overlaps``), as Chromium lays them out;
    the white outline drawn under a name (the same text in the same box) is no collision."""
    seen, texts = set(), []
    for box in boxes:
        key = (box["text"], *(round(box[k]) for k in ("x", "y", "w", "h")))
        if box["text"].strip() and box["w"] > 0 and box["h"] > 0 and key not in seen:
            seen.add(key)
            texts.append(box)
    return _overlaps(texts)


#: The chart's drawn width (its SVG) and the number of lines of its first rule mark.
CHART_SIZE = """() => {
  const svg = document.querySelector('.vega-embed svg.marks');
  return {width: svg.getBoundingClientRect().width,
          lines: document.querySelectorAll('.vega-embed .mark-rule line').length};
}"""


def _page_charts(report):
    """The pictures of issue 61 at the notebooks' sizes, from synthetic results: a head map
    with one outlier, two side by side, a circuit graph of a SmolLM2-shaped and of a
    Gemma-shaped 1% circuit (hundreds of edges), the per-prompt bars of 16 prompts whose
    texts begin alike, a token map pooled over prompts and the agreement chart of four
    estimators."""
    import numpy as np
    import xarray as xr
    from test_page_fit import edge_scores, heavy_heads
    from test_views_positions import each

    from lenscape.views.charts import bars

    both = xr.concat([heavy_heads(0), heavy_heads(1)], dim="prompts").assign_coords(
        prompts=["all 16 prompts", "the 12 prompts the model answers right"]
    )
    texts = [
        f"The chemical symbol of element number {i} in the periodic table is" for i in range(3)
    ]
    texts += [f"The currency used in the country called number {i} is the" for i in range(13)]
    per_prompt = lenscape.schema.make(
        np.linspace(-1, 1, 16),
        dims=("prompt",),
        coords={"text": texts},
        attrs={
            **dict.fromkeys(lenscape.schema.PROVENANCE_ATTRS[2:], "synthetic"),
            "long_name": "attribution",
            "units": "logit diff",
        },
    )
    smol, gemma = edge_scores(30, 9, 3), edge_scores(18, 4, 1)
    return {
        "head_map": lenscape.heatmap(heavy_heads(), x="head", y="layer"),
        "head_maps": lenscape.heatmap(both, x="head", y="layer", facet_col="prompts"),
        "graph_smollm2": lenscape.circuit_graph(smol, lenscape.circuit(smol, fraction=0.01)),
        "graph_gemma3": lenscape.circuit_graph(gemma, lenscape.circuit(gemma, fraction=0.1)),
        "bars": bars(per_prompt, y="prompt", title="layer 23, head 4: per prompt"),
        "tokens": lenscape.heatmap(
            lenscape.aggregate.mean(each(), "prompt").mean("head"), x="pos", y="layer"
        ),
        "agreement": lenscape.agreement_chart(report),
    }


def test_every_picture_fits_the_page_and_no_labels_overlap(
    chromium, tmp_path, artifacts, tiny_llama, factual
):
    """Issue 61, drawn by Chromium: every picture is at most the notebook output area's
    width, no two of its texts overlap, and the circuit graph draws at most
    ``DRAWN_EDGES`` lines by default."""
    from playwright.sync_api import expect, sync_playwright
    from test_notebooks import OUTPUT_WIDTH

    from lenscape.views.circuit import DRAWN_EDGES

    report = lenscape.faithfulness(
        tiny_llama,
        factual[:4],
        estimators=("atp", "ig:2", "relp:relp", "relp:secant-0.9"),
        progress=False,
    )
    found = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1068, "height": 1400})
            for name, chart in _page_charts(report).items():
                path = tmp_path / f"{name}.html"
                chart.save(path, format="html", inline=True, embed_options={"renderer": "svg"})
                page.goto(path.as_uri())
                expect(page.locator(CHART)).to_be_visible(timeout=30_000)
                found[name] = {**page.evaluate(CHART_SIZE), "boxes": page.evaluate(TEXT_BOXES)}
                page.screenshot(path=artifacts / f"fit_{name}.png", full_page=True)
        finally:
            browser.close()
    (artifacts / "fit_widths.json").write_text(
        json.dumps({name: f["width"] for name, f in found.items()}, indent=1)
    )
    wide = {name: f["width"] for name, f in found.items() if f["width"] > OUTPUT_WIDTH}
    assert not wide, f"wider than the output area ({OUTPUT_WIDTH} px): {wide}"
    for name, f in found.items():
        assert _collisions(f["boxes"]) == [], name
    for name in ("graph_smollm2", "graph_gemma3"):
        assert 0 < found[name]["lines"] <= DRAWN_EDGES, name
