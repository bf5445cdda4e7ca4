"""Distributed capture on a dask LocalCluster against one process, same machine.

Attribution patching over every head of the model for a prompt list cycling through the
built-in factual pairs (batches of 8), three ways: in one process (torch using every
core), and with ``client=`` on a ``LocalCluster`` of N worker processes (one thread each,
as dask starts them), into a zarr store. The first distributed call includes the workers
loading the model (once per worker); the second reuses them. On a CPU machine the workers
share the cores the single process uses, so any gain here comes from single-threaded
processes using small matrices better than one multi-threaded process; distribution pays
off with one worker per GPU or across machines. Results are compared to the single process.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _report
import numpy as np

import lenscape as lsc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    args = _report.parse_args(parser, model="tiny", prompts=32)
    from distributed import Client, LocalCluster

    model = (
        lsc.models.tiny("llama", n_layers=4)
        if args.model == "tiny"
        else lsc.load(args.model, device="cpu")
    )
    factual = lsc.data.prompts("factual")
    prompts = lsc.data.PromptSet(
        [factual[i % len(factual)] for i in range(args.prompts)], name=f"factual-x{args.prompts}"
    )
    start = time.perf_counter()
    single = lsc.attribution_patching(model, prompts, batch_size=8, progress=False)
    t_single = time.perf_counter() - start
    rows = [
        [
            *_report.stamp(),
            model.name,
            args.prompts,
            "one process",
            f"{t_single:.1f} s",
            "1.00",
            "-",
        ]
    ]
    print(f"one process: {t_single:.1f} s")
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        for label in ("cold (workers load the model)", "warm"):
            start = time.perf_counter()
            result = lsc.attribution_patching(
                model,
                prompts,
                batch_size=8,
                progress=False,
                store=f"{tmp}/{label[:4]}.zarr",
                client=client,
            )
            took = time.perf_counter() - start
            diff = float(np.abs(result.values - single.values).max())
            print(f"{args.workers} workers, {label}: {took:.1f} s, max |diff| {diff:.1e}")
            rows.append(
                [
                    *_report.stamp(),
                    model.name,
                    args.prompts,
                    f"LocalCluster, {args.workers} workers x 1 thread, {label}",
                    f"{took:.1f} s",
                    f"{took / t_single:.2f}",
                    f"{diff:.1e}",
                ]
            )
    body = _report.table(
        [
            "date",
            "machine",
            "model",
            "prompts",
            "run",
            "wall time",
            "time / one process",
            "max abs diff vs one process",
        ],
        rows,
    )
    _report.emit(
        args,
        _report.section(
            "dask_cluster",
            "Distributed capture on dask (issue 7)",
            __doc__.split("\n\n", 1)[1],
            body,
        ),
    )


if __name__ == "__main__":
    main()
