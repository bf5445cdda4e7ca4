"""The scale ladder: every method on models of growing size, its memory against the plan.

Rungs: SmolLM2-135M with its real weights, then random-weight models with the shapes of
Llama-3.2-1B (float32) and Llama-3-8B (bfloat16), built from their published configs
(``shapes/*.json``, ``_shapes.py``). Per rung and method, on ``--prompts`` short IOI pairs
with ``batch_size=None``: the peak memory and wall time, and the peak ``lsc.estimate``
predicted before the run with its error. Methods: attribution patching (heads, blocks),
exact head ablation of the top ``--refine`` heads (``refine=``), EAP edge attribution, the
logit lens, weight importance, and 3 updates per stage of head gating (1 seed) and of block
masks (2 clusters). A plain forward and a forward + backward of the same prompts give each
rung's 2 forward + 1 backward floor, which EAP's time is compared with.

On the smaller rungs, the cost against prompt length (filler text before each IOI prompt)
and against batch (that many prompts in one batch); a log-log fit of cost against
parameters, length and batch gives each method's exponent (memory: what the run holds
beyond the loaded weights). Last, the largest rung each method ran on with this machine's
memory and what stopped the next.

Every measurement runs in its own process (``--measure``), so peaks are clean and one that
runs out of memory does not end the ladder: on CPU the peak resident memory of that process
(its high-water mark reset after the model is built and the backend booted), on a GPU
``torch.cuda.max_memory_allocated``. Results are appended to a progress file as each
finishes (``scale_ladder_data/progress-<device>.jsonl``, committed): running the ladder
again skips what is there, so an interrupted ladder resumes. ``--rungs`` picks rungs,
``--sweep-rungs`` those of the sweeps, ``--device`` the device, ``--quick`` SmolLM2 alone
with four methods and two prompts for a smoke check (its own progress file, in a temporary
folder). Writes the ``scale_ladder`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _report
import _shapes

HERE = Path(__file__).resolve().parent
#: The rungs, smallest first.
LADDER = (_shapes.REAL, "llama-3.2-1b", "llama-3-8b")
DATA = HERE / "scale_ladder_data"
#: Filler text put before each IOI prompt (clean and corrupt alike) to lengthen it.
FILLER = (
    "The weather was mild and the streets were quiet that morning, so the shops opened "
    "late and the market filled slowly with people who had nowhere else to be. "
)
GIB = 2**30
#: glibc malloc with a fixed mmap threshold: a freed tensor goes back to the system at once,
#: so a CPU peak is that of the tensors alive together, not of heap fragmentation (with the
#: default dynamic threshold the logit lens's peak on SmolLM2 ranged 0.13-0.33 GiB for the
#: same run; with this setting 0.04-0.05 GiB).
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclass(frozen=True)
class Method:
    """One method of the ladder: the lenscape function by name and its options."""

    function: str
    options: dict = field(default_factory=dict)
    #: the options that take the number of prompts (a fit's batch, clusters)
    per_prompts: tuple[str, ...] = ()


METHODS = {
    "forward": Method("forward"),
    "forward_backward": Method("forward_backward"),
    "atp_heads": Method("attribution_patching", {"level": "head"}),
    "atp_blocks": Method("attribution_patching", {"level": "block"}),
    "ablation_refine": Method("ablation", {"level": "head"}),
    "eap": Method("edge_attribution"),
    "logit_lens": Method("logit_lens"),
    "weight_importance": Method("weight_importance", per_prompts=("batch_size",)),
    "head_gating": Method(
        "head_gating", {"seeds": 1, "max_steps": 3, "window": 3}, per_prompts=("batch_size",)
    ),
    "block_masks": Method(
        "block_masks", {"max_steps": 3, "window": 3}, per_prompts=("batch_size", "clusters")
    ),
}
#: The floor methods: plain Hugging Face passes, not lenscape methods (no estimate).
FLOOR = ("forward", "forward_backward")


def _libc_trim() -> None:
    """Give freed heap memory back to the system, so the next peak starts clean."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status(field_name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field_name}:\s+(\d+)", text)[1]) * 1024


def prompts_of(n: int, length: int, tokenizer):
    """``n`` IOI pairs, each lengthened with filler to about ``length`` tokens (0: as they
    are)."""
    import lenscape as lsc

    base = lsc.data.prompts("ioi")
    pairs = [base[i % len(base)] for i in range(n)]
    if not length:
        return lsc.data.PromptSet(pairs, name="ioi")
    words = (FILLER * (length // 8 + 2)).split()
    out = []
    for pair in pairs:
        missing = length - len(tokenizer(pair.text)["input_ids"])
        prefix = " ".join(words[: max(0, int(missing * 0.8))]) + " " if missing > 0 else ""
        out.append(
            lsc.data.Prompt(
                prefix + pair.text,
                pair.target,
                corrupt=prefix + pair.corrupt,
                distractor=pair.distractor,
                category=pair.category,
            )
        )
    return lsc.data.PromptSet(out, name=f"ioi+{length}")


def call_of(spec: dict, prompts) -> tuple[str, dict]:
    """``(function name, options)`` of measurement ``spec`` (a fit's clusters included)."""
    import lenscape as lsc

    method = METHODS[spec["method"]]
    options = dict(method.options)
    if method.function in FLOOR:
        return method.function, options
    options["progress"] = False
    options["batch_size"] = spec["batch"]
    if "batch_size" in method.per_prompts:
        options["batch_size"] = spec["batch"] or len(prompts)
    if method.function == "ablation":
        options["refine"] = spec["refine"]
    if "clusters" in method.per_prompts:
        embedded = lsc.cluster.embed(prompts)
        options["clusters"] = lsc.cluster.kmeans(embedded, min(2, len(prompts)), prompts=prompts)
    return method.function, options


def _floor_pass(model, prompts, *, backward: bool) -> None:
    """A plain Hugging Face forward (and backward) of the prompts' clean texts, all of the
    logits kept, as ``edges.py`` measures the floor."""
    import torch

    batch = model.tokenizer([p.text for p in prompts], return_tensors="pt", padding=True)
    batch = batch.to(model.device)
    with torch.set_grad_enabled(backward):
        embeds = model.hf.get_input_embeddings()(batch["input_ids"])
        if backward:
            embeds.requires_grad_(True)
        logits = model.hf(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits
        if backward:
            logits[:, -1].sum().backward()


def _run(model, function: str, prompts, options: dict) -> None:
    """Run ``function`` (a lenscape function's name, or a floor pass) once."""
    import lenscape as lsc

    if function in FLOOR:
        _floor_pass(model, prompts, backward=function == "forward_backward")
    else:
        getattr(lsc, function)(model, prompts, **options)


def measure(spec: dict) -> dict:
    """One measurement, in this process: build the model, then ``measure_on`` it.

    Args:
        spec: ``sweep``, ``rung``, ``method``, ``device``, ``prompts``, ``length``,
            ``batch`` (None: the method chooses), ``refine``, ``threads``, ``repeats``
            (timed runs: the fastest time is kept; the peak is the first run's).

    Returns:
        As ``measure_on``.
    """
    import torch

    torch.set_num_threads(spec["threads"])
    return measure_on(*built(spec["rung"], spec["device"]), spec)


def built(rung: str, device: str) -> tuple:
    """``(model, bytes it took)``: rung ``rung`` built on ``device`` (memory allocated on a
    GPU, resident memory on CPU)."""
    import nnsight  # noqa: F401  imported before the baseline: the backend's first use needs it
    import torch

    import lenscape as lsc

    # lenscape imports its parts on first use (lenscape._lazy): all of them (transformers'
    # model code with them) are imported before the baseline, as ``import lenscape`` once
    # did, so that it counts the model's bytes, not the code's.
    for name in lsc.__all__:
        getattr(lsc, name)
    cuda = torch.device(device).type == "cuda"
    gc.collect()
    base = torch.cuda.memory_allocated(device) if cuda else _status("VmRSS")
    model = _shapes.build(rung, device=device)
    return model, (torch.cuda.memory_allocated(device) if cuda else _status("VmRSS")) - base


def _error(error: BaseException, cuda: bool) -> dict:
    """A refusal or an out-of-memory error as a result row (its first line)."""
    import torch

    if cuda:
        torch.cuda.empty_cache()
    return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def measure_on(model, weights: int, spec: dict) -> dict:
    """Run ``spec``'s method on ``model`` once on one prompt (the warm-up: the backend
    boots and one-time set-up happens there), then once on the prompts, recording that
    run's peak memory (CPU: the process's resident high-water mark, reset first; GPU:
    ``torch.cuda.max_memory_allocated``), its wall time and the estimate made before it.
    On a GPU many measurements can share a process and its model; on CPU each needs a
    fresh process (``run_one``).

    Args:
        weights: bytes the built model took.
        spec: as ``measure``'s.

    Returns:
        The spec with ``time_s``, ``weights``, ``width`` (tokens of the longest prompt),
        ``parameters``, ``needed`` (bytes the run held beyond the loaded model at its peak),
        ``peak`` (weights + needed), the estimate's ``predicted_*`` fields, ``available``
        and ``batch_size``; or ``error`` with the first line of a refusal or an
        out-of-memory error.
    """
    import torch

    import lenscape as lsc

    device = model.device
    cuda = device.type == "cuda"
    prompts = prompts_of(spec["prompts"], spec["length"], model.tokenizer)
    width = max(len(model.tokenizer(p.text)["input_ids"]) for p in prompts)
    function, options = call_of(spec, prompts)
    result = dict(spec, weights=weights, width=width, parameters=_shapes.parameters(spec["rung"]))
    try:
        # A warm-up call on one prompt: the backend boots and one-time set-up (imports,
        # caches) happens there, not in the measured run.
        _run(model, function, prompts[:1], call_of(spec, prompts[:1])[1])
    except (MemoryError, torch.OutOfMemoryError) as error:
        return result | _error(error, cuda)
    if function not in FLOOR:
        estimate = lsc.estimate(model, function, prompts, **options)
        result |= {
            "batch_size": estimate.batch_size,
            "predicted_weights": estimate.weights,
            "predicted_activations": estimate.activations,
            "predicted_buffers": estimate.buffers,
            "predicted_optimizer": estimate.optimizer,
            "available": estimate.available,
        }
    gc.collect()
    _libc_trim()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
        start_bytes = _status("VmRSS")
    start = time.perf_counter()
    try:
        _run(model, function, prompts, options)
        if cuda:
            torch.cuda.synchronize(device)
    except (MemoryError, torch.OutOfMemoryError) as error:
        return result | _error(error, cuda)
    took = time.perf_counter() - start
    high = torch.cuda.max_memory_allocated(device) if cuda else _status("VmHWM")
    for _ in range(spec["repeats"] - 1):  # the same allocations again: the peak stays
        start = time.perf_counter()
        _run(model, function, prompts, options)
        if cuda:
            torch.cuda.synchronize(device)
        took = min(took, time.perf_counter() - start)
    needed = max(0, high - start_bytes)
    return result | {"time_s": took, "needed": needed, "peak": weights + needed}


def key(spec: dict) -> str:
    """A measurement's identity in the progress file."""
    return json.dumps({k: spec[k] for k in spec if k not in ("threads", "repeats")}, sort_keys=True)


def load_progress(path: Path) -> dict[str, dict]:
    """Finished measurements of ``path``, by ``key``."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["key"]: row for row in rows}


def run_one(spec: dict, *, timeout: float) -> dict:
    """``measure(spec)`` in a fresh process; a crash (killed for memory, say) or a timeout
    becomes an ``error``."""
    command = [sys.executable, str(Path(__file__)), "--measure", json.dumps(spec)]
    allocator = {} if spec["sweep"] == "timing" else ALLOCATOR
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), **allocator}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        killed = " (killed: out of memory?)" if done.returncode in (-9, 137) else ""
        return dict(spec, error=f"exit {done.returncode}{killed}: {tail[:300]}")
    return json.loads(lines[-1])


def plan(args: argparse.Namespace) -> list[dict]:
    """Every measurement of this ladder, in the order they run: each method on each rung
    (``sweep="ladder"``, ``batch_size=None``), EAP and its floor again under the default
    allocator (``sweep="timing"``, the fastest of at least 3 runs; ``timing_table``), then
    on the smaller rungs each method against
    prompt length (``--lengths``, one batch of ``--prompts``) and against batch
    (``--batches`` prompts in one batch), on ``--sweep-rungs``."""
    common = dict(device=args.device, threads=args.threads, refine=args.refine)
    common |= {"repeats": args.repeats}
    specs = [
        dict(common, sweep="ladder", rung=rung, method=name, prompts=args.prompts, length=0)
        | {"batch": None}
        for rung in args.rungs
        for name in args.methods
    ]
    specs += [  # EAP against its floor under the default allocator, as users run it
        dict(common, sweep="timing", rung=rung, method=name, prompts=args.prompts, length=0)
        | {"batch": None, "repeats": max(3, args.repeats)}
        for rung in args.rungs
        for name in (*FLOOR, "eap")
        if name in args.methods
    ]
    for rung in args.sweep_rungs:
        for name in args.methods:
            specs += [
                dict(common, sweep="length", rung=rung, method=name, prompts=args.prompts)
                | {"length": length, "batch": args.prompts}
                for length in args.lengths
            ]
            specs += [
                dict(common, sweep="batch", rung=rung, method=name, prompts=batch, length=0)
                | {"batch": batch}
                for batch in args.batches
            ]
    return specs


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.2f}"


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Slope of log(y) against log(x) (least squares), or None with fewer than 2 points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(points) < 2 or len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return covariance / sum((x - mean_x) ** 2 for x, _ in points)


def predicted(row: dict) -> int | None:
    if "predicted_weights" not in row:
        return None
    return (
        row["predicted_weights"]
        + row["predicted_activations"]
        + row["predicted_buffers"]
        + row["predicted_optimizer"]
    )


def ladder_table(rows: list[dict], rungs: list[str], methods: list[str]) -> str:
    """Per rung and method: batch, peak, predicted peak and its error, what the run held
    beyond the weights (measured / predicted), wall time."""
    out = []
    floors = {}
    for rung in rungs:
        plain = {r["method"]: r for r in rows if r["rung"] == rung and r["sweep"] == "ladder"}
        if all(m in plain and "time_s" in plain[m] for m in FLOOR):
            floors[rung] = plain["forward"]["time_s"] + plain["forward_backward"]["time_s"]
    for row in rows:
        if row["rung"] not in rungs or row["method"] not in methods:
            continue
        name = f"{row['rung']} ({row['parameters'] / 1e9:.2f}B)"
        if "error" in row:
            out.append([*_report.stamp(), name, row["method"], "-", "-", "-", "-", "-", "-", "-"])
            out[-1][-1] = row["error"][:160].replace("|", "/")
            continue
        plan = predicted(row)
        error = "-" if plan is None else f"{(plan - row['peak']) / row['peak']:+.0%}"
        needed = f"{_gib(row['needed'])} / " + (
            "-" if plan is None else _gib(plan - row["predicted_weights"])
        )
        took = f"{row['time_s']:.1f} s"
        if row["method"] == "eap" and row["rung"] in floors:
            took += f" ({row['time_s'] / floors[row['rung']]:.2f}x floor)"
        out.append(
            [
                *_report.stamp(),
                name,
                row["method"],
                str(row.get("batch_size", row["prompts"])),
                _gib(row["peak"]),
                "-" if plan is None else _gib(plan),
                error,
                needed,
                took,
                "",
            ]
        )
    columns = [
        "date",
        "machine",
        "model",
        "method",
        "batch",
        "peak GiB",
        "predicted GiB",
        "error",
        "beyond weights GiB (measured / predicted)",
        "time",
        "stopped by",
    ]
    return _report.table(columns, out)


def timing_table(rows: list[dict], rungs: list[str]) -> str:
    """Per rung: EAP's time against its floor (one forward + one forward and backward), each
    the fastest of the ``sweep="timing"`` runs under the default allocator."""
    out = []
    for rung in rungs:
        timed = {r["method"]: r for r in rows if r["rung"] == rung and r["sweep"] == "timing"}
        if not all("time_s" in timed.get(m, {}) for m in (*FLOOR, "eap")):
            continue
        floor = sum(timed[m]["time_s"] for m in FLOOR)
        eap = timed["eap"]["time_s"]
        name = f"{rung} ({timed['eap']['parameters'] / 1e9:.2f}B)"
        runs = timed["eap"]["repeats"]
        out.append(
            [
                *_report.stamp(),
                name,
                str(runs),
                f"{floor:.2f} s",
                f"{eap:.2f} s",
                f"{eap / floor:.2f}x",
            ]
        )
    columns = [
        "date",
        "machine",
        "model",
        "runs (fastest kept)",
        "floor (2F + 1B)",
        "EAP",
        "EAP / floor",
    ]
    return _report.table(columns, out)


def growth_table(rows: list[dict], methods: list[str]) -> str:
    """Fitted exponents per method: time and memory beyond the weights against parameters
    (the ladder's rows), prompt length (tokens of the longest prompt) and batch (the sweeps,
    per rung)."""
    out = []
    for method in methods:
        ok = [r for r in rows if r["method"] == method and "time_s" in r]
        ladder = [r for r in ok if r["sweep"] == "ladder"]
        cells = [method]
        for what in ("time_s", "needed"):
            by_params = exponent([r["parameters"] for r in ladder], [r[what] for r in ladder])
            cells.append("-" if by_params is None else f"{by_params:.2f}")
        for sweep, x in (("length", "width"), ("batch", "prompts")):
            parts = []
            for rung in dict.fromkeys(r["rung"] for r in ok if r["sweep"] == sweep):
                chosen = [r for r in ok if r["rung"] == rung and r["sweep"] == sweep]
                xs = [r[x] for r in chosen]
                time_exp = exponent(xs, [r["time_s"] for r in chosen])
                memory_exp = exponent(xs, [r["needed"] for r in chosen])
                if time_exp is not None:
                    memory = "-" if memory_exp is None else f"{memory_exp:.2f}"
                    parts.append(f"{rung}: {time_exp:.2f} / {memory}")
            cells.append("; ".join(parts) or "-")
        out.append(cells)
    columns = [
        "method",
        "time vs parameters",
        "memory vs parameters",
        "vs prompt length (time / memory)",
        "vs batch (time / memory)",
    ]
    return _report.table(columns, out)


def planned(rung: str, method: str, args: argparse.Namespace) -> str:
    """What ``lsc.estimate`` says of ``method`` on ``rung`` (built on the meta device: no
    memory behind it) with this ladder's prompts, against this machine's memory."""
    import lenscape as lsc

    spec = dict(method=method, batch=None, refine=args.refine)
    model = _shapes.build(rung, device="meta")
    prompts = prompts_of(args.prompts, 0, model.tokenizer)
    function, options = call_of(spec, prompts)
    if function in FLOOR:
        return "not measured"
    estimate = lsc.estimate(model, function, prompts, **options)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return (
        f"not measured; planned peak {_gib(estimate.peak)} GiB (weights "
        f"{_gib(estimate.weights)}) of this machine's {_gib(total)} GiB"
    )


def reach_table(rows: list[dict], args: argparse.Namespace) -> str:
    """Per method: the largest rung it ran on, and what stopped the next (its error, or
    where it was not measured, what its plan needs)."""
    out = []
    for method in args.methods:
        ladder = {r["rung"]: r for r in rows if r["method"] == method and r["sweep"] == "ladder"}
        ran = [rung for rung in args.rungs if "time_s" in ladder.get(rung, {})]
        largest = ran[-1] if ran else "none"
        later = LADDER[LADDER.index(largest) + 1 :] if ran else args.rungs
        if not later:
            stop = "the top rung of this ladder"
        elif later[0] in ladder:
            stop = f"{later[0]}: " + ladder[later[0]].get("error", "ran")[:200].replace("|", "/")
        else:
            stop = f"{later[0]}: {planned(later[0], method, args)}"
        out.append([method, largest, stop])
    return _report.table(["method", "largest rung run", "what stops the next"], out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rungs", default=",".join(LADDER), help="models, smallest first")
    parser.add_argument(
        "--sweep-rungs",
        default=None,
        help="rungs of the length and batch sweeps (default: "
        "every rung but the largest; the only one if there is one)",
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=4, help="IOI pairs per ladder run")
    parser.add_argument("--refine", type=int, default=8, help="heads ablation measures exactly")
    parser.add_argument("--lengths", default="0,32,64,128", help="prompt lengths (0: as is)")
    parser.add_argument("--batches", default="1,4,16", help="batches (smaller rungs)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs (the fastest kept)")
    parser.add_argument("--progress", type=Path, default=None, help="the progress file")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = _report.parse_args(
        parser,
        rungs=_shapes.REAL,
        methods="forward,forward_backward,atp_heads,eap",
        prompts=2,
        lengths="0,24",
        batches="1,2",
    )
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))), flush=True)
        return
    args.rungs = args.rungs.split(",")
    default_sweeps = args.rungs[:-1] if len(args.rungs) > 1 else args.rungs
    args.sweep_rungs = args.sweep_rungs.split(",") if args.sweep_rungs else default_sweeps
    args.methods = args.methods.split(",")
    args.lengths = [int(n) for n in args.lengths.split(",") if n]
    args.batches = [int(n) for n in args.batches.split(",") if n]
    unknown = sorted(set(args.rungs + args.sweep_rungs) - set(_shapes.names())) + sorted(
        set(args.methods) - set(METHODS)
    )
    if unknown:
        parser.error(f"unknown rungs or methods {unknown}")
    folder = Path(tempfile.mkdtemp()) if args.quick else DATA
    folder.mkdir(exist_ok=True)
    progress = args.progress or folder / f"progress-{args.device}.jsonl"
    done = load_progress(progress)
    for spec in plan(args):
        if key(spec) in done:
            continue
        row = run_one(spec, timeout=args.timeout) | {"key": key(spec)}
        done[row["key"]] = row
        with progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = row.get("error") or (
            f"{row['time_s']:.1f} s, peak {_gib(row['peak'])} GiB"
            + (f", predicted {_gib(predicted(row))}" if predicted(row) else "")
        )
        where = f"{row['sweep']} {row['rung']} {row['method']} len {row['length']}"
        print(f"{where} batch {row['batch']}: {shown}", flush=True)
    rows = [row for row in done.values() if row["device"] == args.device]
    body = "\n\n".join(
        [
            f"Device: {args.device}; {args.threads} torch threads; {args.prompts} IOI pairs per "
            f"ladder run, batch_size=None; ablation refines the top {args.refine} heads; the "
            "fits run 3 updates per stage (head gating: 1 seed, 3 stages; block masks: 2 "
            "clusters). 'beyond weights': what the run held over the loaded model.",
            ladder_table([r for r in rows if r["sweep"] == "ladder"], args.rungs, args.methods),
            "EAP against its floor as users run it: the ladder's runs above use glibc malloc "
            f"with a fixed mmap threshold ({ALLOCATOR['MALLOC_MMAP_THRESHOLD_']} bytes) so "
            "that a peak is that of the tensors alive together; every freed tensor then goes "
            "back to the system and each allocation touches fresh pages, which slows code "
            "that allocates often. Here the same runs with the default allocator, the fastest "
            "of several:",
            timing_table(rows, args.rungs),
            "Growth: fitted exponents of log(cost) against log(parameters) over the rungs, "
            "and against log(prompt length) and log(batch) per smaller rung (time / memory "
            "beyond the weights):",
            growth_table(rows, args.methods),
            "Reach on this machine:",
            reach_table(rows, args),
        ]
    )
    intro = (
        "Every method on SmolLM2-135M (real weights) and random-weight models of the shapes of "
        "Llama-3.2-1B (float32) and Llama-3-8B (bfloat16): peak memory measured in a fresh "
        "process per run (CPU: the process's peak resident memory; GPU: "
        "torch.cuda.max_memory_allocated), the peak lsc.estimate predicted before the run "
        "and its error, wall time (EAP also as a multiple of the rung's 2 forward + 1 "
        "backward floor), growth exponents and the largest rung each method reaches."
    )
    _report.emit(args, _report.section("scale_ladder", "Scale ladder", intro, body))


if __name__ == "__main__":
    main()
