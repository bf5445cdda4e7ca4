# Set-up and entry points. Make only prepares the environment and calls the `lenscape` CLI.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv install demo figures docs docs-notebooks test lab bench gpu-check clean

venv: $(PY)

$(PY):
	python3 -m venv $(VENV)
	# torch first, at its locked version: an unpinned resolve may pull a multi-GB CUDA build on CPU machines.
	$(PIP) install --quiet --no-compile -c constraints.txt torch

# pyproject.toml declares ranges; constraints.txt holds the exact tested versions.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install --quiet --no-compile -c constraints.txt -e ".[test,notebooks,dask,docs]"
	# pip compiles the bytecode on one core (115 s of a 314 s install here); compileall on every
	# core takes 57 s. Machines that set PYTHONDONTWRITEBYTECODE never write it at import, so it
	# is compiled here. -qq: a file no Python 3.11 reads (torch's py312 test fixtures) is skipped
	# silently, as pip skips it; its exit status says only that such files exist.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	$(VENV)/bin/lenscape install-models --all
	touch $(STAMP)

install: $(STAMP)

# Writes only under out/ (ignored by git): a clone stays clean.
demo: install
	$(VENV)/bin/lenscape demo --out out

# The README's gallery docs/figures/: F1 and F4 from the shipped recordings (lsc.recorded), the
# others from runs cached under out/figures-cache/ (computed the first time, minutes on a CPU).
figures: install
	$(PY) docs/figures.py

# The documentation site, offline, into site/ (ignored by git), in strict mode: a broken link,
# a missing page or a public name without a docstring fails it (about 20 s; docs/build.py).
# Tutorials show a cached execution of each notebook when docs-notebooks made one from the
# notebook as it is, else its cells and the gallery figures it draws.
docs: install
	$(PY) docs/build.py

# Runs every notebook at its default setting (minutes each) into out/docs-notebooks/, for
# the tutorials' outputs; `make docs` then uses them. Not part of `make test`.
docs-notebooks: install
	$(PY) docs/tutorials.py --execute

# Static checks first, so a lint, format or type finding fails fast, before the long test run
# (any finding fails the target; the settings live in pyproject.toml). The real-browser tests
# need Debian's chromium: .ci/ensure-chromium installs it (as root) or fails loudly, unless
# LENSCAPE_SKIP_BROWSER=1 opts out. Tests run on one pytest-xdist worker per core, each with one
# torch thread (tests/conftest.py); work stealing keeps both cores busy to the end.
# tests/test_site.py builds the documentation site (strict, as `make docs` does) and opens it
# in that Chromium.
test: install
	$(VENV)/bin/ruff check toolkit tests benchmarks
	$(VENV)/bin/ruff format --check toolkit tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	./.ci/ensure-chromium
	$(PY) -m pytest -q -rs --durations=25 -n auto --dist worksteal

# JupyterLab refuses to run as root without --allow-root; pass it only then.
lab: install
	$(VENV)/bin/jupyter lab notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

bench: install
	$(PY) benchmarks/run_all.py

# On a machine with a GPU: the device-marked tests, the scale ladder's 1B (and 8B) rung on it
# and CPU vs GPU agreement, at most 8 minutes; writes the gpu_check section of RESULTS.md
# (without a GPU the section says no GPU figure exists; dry run: gpu_check.py --device cpu --quick).
gpu-check: install
	$(PY) benchmarks/run_all.py --only gpu_check --conditions "make gpu-check"

clean:
	rm -rf $(VENV) out site
