"""The documentation site (mkdocs.yml, docs/site/, docs/hooks.py): built offline in strict
mode, every public name in its reference, every docstring example run, and the built pages
read in a real browser with nothing fetched from outside the machine.

The site is built once per test run (``built_site``: one build shared by the pytest-xdist
workers, about 20 s). Without the docs extra the build fails, saying what to install.
"""

from __future__ import annotations

import base64
import contextlib
import doctest
import functools
import http.server
import importlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import build as site_build  # noqa: E402  (docs/build.py)
import reference  # noqa: E402  (docs/reference.py)
import tutorials  # noqa: E402  (docs/tutorials.py)

#: One page of each kind the browser opens: home, a tutorial, a how-to guide, a reference page.
BROWSED = (
    "index.html",
    "tutorials/01_quickstart.html",
    "how-to/trust-estimators.html",
    "reference/lenscape.html",
)


@pytest.fixture(scope="session")
def built_site(tmp_path_factory, worker_id) -> Path:
    """The site built by ``docs/build.py`` (strict), once for all workers of this run (their
    base folders share a parent made for the run; without workers, the run's own)."""
    shared = tmp_path_factory.getbasetemp()
    shared = shared if worker_id == "master" else shared.parent
    out, record = shared / "site", shared / "site.json"
    with FileLock(str(shared / "site.lock")):
        if not record.exists():
            try:
                done = site_build.build(out)
            except RuntimeError as err:  # the docs extra is missing: say what to install
                pytest.fail(str(err))
            record.write_text(
                json.dumps({"returncode": done.returncode, "log": done.stdout + done.stderr})
            )
    result = json.loads(record.read_text())
    assert result["returncode"] == 0, f"the strict docs build failed:\n{result['log'][-4000:]}"
    return out


def _nav_pages(nav: list) -> list[str]:
    found = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        found += _nav_pages(value) if isinstance(value, list) else [value]
    return found


def test_the_strict_build_has_every_page(built_site):
    """Every page of the navigation, one tutorial per notebook and one reference page per
    documented module are built; the config is strict and checks links and anchors."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True and config["use_directory_urls"] is False
    assert set(config["validation"].values()) == {"warn"}  # warnings fail a strict build
    assert config["theme"]["font"] is False  # no web fonts fetched from a CDN
    expected = [p.removesuffix(".md") + ".html" for p in _nav_pages(config["nav"])]
    expected += [f"tutorials/{p.stem}.html" for p in tutorials.NOTEBOOKS.glob("*.ipynb")]
    expected += [f"reference/{slug}.html" for slug in reference.MODULES.values()]
    assert sorted(p for p in expected if not (built_site / p).is_file()) == []


def test_every_public_name_has_a_reference_entry(built_site):
    """Each name of ``lenscape.__all__`` (and every public name of the documented modules)
    has an entry on its module's page, headed by the name a user types."""
    import lenscape as lsc

    assert [e.name for e in reference.entries("lenscape")] == lsc.__all__
    for module, slug in reference.MODULES.items():
        html = (built_site / "reference" / f"{slug}.html").read_text()
        names = reference.public_names(module)
        assert names, module
        lacking = [
            n
            for n, e in zip(names, reference.entries(module), strict=True)
            if f'id="{reference.anchor(e)}"' not in html or e.shown not in html
        ]
        assert lacking == [], f"{module}: no reference entry for {lacking}"
    # A registered method's entry shows its whole signature and the shared options' text.
    page = (built_site / "reference" / "lenscape.html").read_text()
    entry = next(e for e in reference.entries("lenscape") if e.name == "ablation")
    ablation = page.split(f'id="{reference.anchor(entry)}"')[1].split("doc-heading")[1]
    assert "batch_size" in ablation and "padding_side" in ablation


def test_public_names_without_all_are_what_the_module_defines(tmp_path, monkeypatch):
    """A module without ``__all__``: the functions, classes and constants its own source
    binds, not what it imports, not private names; one without a docstring is reported."""
    (tmp_path / "fake_documented.py").write_text(
        "from os.path import join\nimport json\n\n"
        "#: A constant.\nLIMIT = 3\n_PRIVATE = 1\n\n"
        "def documented():\n    '''Says what it does.'''\n\n"
        "def bare():\n    pass\n\n"
        "class Thing:\n    '''A thing.'''\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_documented", raising=False)
    assert reference.public_names("fake_documented") == ["LIMIT", "documented", "bare", "Thing"]
    assert reference.undocumented("fake_documented") == ["fake_documented.bare"]


def _documented_objects() -> list[tuple[str, object]]:
    found = []
    for module in reference.MODULES:
        for entry in reference.entries(module):
            if entry.kind in ("function", "class"):
                found.append((entry.shown, getattr(importlib.import_module(module), entry.name)))
    return found


def test_every_docstring_example_runs():
    """The ``>>>`` examples in the docstrings of every documented name run and print what
    they say (doctest), so no example in the reference is wrong."""
    finder, runner = doctest.DocTestFinder(recurse=True), doctest.DocTestRunner(verbose=False)
    examples = 0
    for name, value in _documented_objects():
        for test in finder.find(value, name, globs={"lsc": importlib.import_module("lenscape")}):
            examples += len(test.examples)
            runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert failed == 0
    assert attempted == examples and examples >= 1  # the reference shows at least one


def test_tutorials_use_a_cached_execution_only_when_it_is_of_the_notebook(tmp_path, monkeypatch):
    """A cached execution made from the notebook as it is shows its outputs (PNG pictures,
    text, no widget views); one made from another version of it is not used."""
    source = tutorials.NOTEBOOKS / "01_quickstart.ipynb"
    nb = json.loads(source.read_text())
    code = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
    png = (ROOT / "docs" / "figures" / "agreement.png").read_bytes()

    nb["cells"][code]["outputs"] = [
        {"output_type": "stream", "name": "stdout", "text": "hello from the cache\n"},
        {
            "output_type": "display_data",
            "metadata": {},
            "data": {
                "application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                "image/png": base64.b64encode(png).decode(),
                "text/plain": "JupyterChart(...)",
            },
        },
    ]
    monkeypatch.setattr(tutorials, "CACHE", tmp_path)
    nb["metadata"][tutorials.SOURCE_KEY] = "another version"
    (tmp_path / source.name).write_text(json.dumps(nb))
    stale = tutorials.notebook_page(source)
    assert not stale.executed and "hello from the cache" not in stale.markdown
    assert "../figures/agreement.png" in stale.markdown  # the gallery stands in
    nb["metadata"][tutorials.SOURCE_KEY] = tutorials.source_sha256(source)
    (tmp_path / source.name).write_text(json.dumps(nb))
    page = tutorials.notebook_page(source)
    assert page.executed and "hello from the cache" in page.markdown
    assert list(page.images.values()) == [png] and "JupyterChart" not in page.markdown


def test_the_build_says_what_to_install_without_the_docs_extra(monkeypatch):
    monkeypatch.setattr(site_build, "NEEDED", {"no_such_docs_module": "mkdocs-nothing"})
    with pytest.raises(
        RuntimeError, match=r"needs mkdocs-nothing \(the docs extra\).*make install"
    ):
        site_build.build(Path("unused"))


@contextlib.contextmanager
def _serve(folder: Path):
    """The folder over HTTP on 127.0.0.1 (a free port) until the block ends."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no line per request in the test output
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


browser_tests = importlib.import_module("test_browser")
chromium = browser_tests.chromium  # Debian's Chromium, or a loud failure (skip: opt-in)
artifacts = browser_tests.artifacts


@pytest.mark.browser
def test_the_site_reads_offline_in_a_browser(built_site, chromium, artifacts):
    """Home, a tutorial, a how-to guide and a reference page, served on 127.0.0.1: no
    console error, no request leaving the machine, no request failing, every figure loaded."""
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    outside: list[str] = []
    failed: list[str] = []
    broken: dict[str, list[str]] = {}
    images: dict[str, int] = {}
    with _serve(built_site) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=browser_tests.CHROMIUM_ARGS)
        try:
            for path in BROWSED:
                page = browser_tests._open(browser, f"{url}/{path}", errors, outside)
                page.on("response", lambda r: failed.append(r.url) if r.status >= 400 else None)
                page.reload(wait_until="networkidle")
                images[path] = page.evaluate("document.images.length")
                broken[path] = page.evaluate(
                    "Array.from(document.images)"
                    ".filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
                )
                shot = path.replace("/", "_").removesuffix(".html")
                page.screenshot(path=artifacts / f"site_{shot}.png")
                page.close()
        finally:
            browser.close()
    assert errors == [] and outside == [] and failed == []
    assert {path: srcs for path, srcs in broken.items() if srcs} == {}
    assert images["index.html"] >= 7 and images["tutorials/01_quickstart.html"] >= 1


def test_docs_sources_are_lint_clean():
    """docs/*.py follow the repository's ruff settings (``make test`` lints toolkit, tests and
    benchmarks; the site's generators are checked here)."""
    ruff = Path(sys.executable).parent / "ruff"
    files = [str(p) for p in sorted((ROOT / "docs").glob("*.py"))]
    for command in ([str(ruff), "check", *files], [str(ruff), "format", "--check", *files]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
