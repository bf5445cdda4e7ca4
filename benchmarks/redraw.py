"""Explorer redraw latency: time from a control change to the new chart spec.

A (model 2 x cluster 16 x layer 36 x head 32) array is explored with x=head, y=layer.
Setting a dropdown runs the whole redraw synchronously (reduce -> heatmap -> the
JupyterChart's ``to_dict`` into its ``spec`` trait), so the time of the assignment is the
latency a person waits for, minus the browser's drawing. Target: median <= 50 ms.

Run: ``python benchmarks/redraw.py``; writes the ``redraw`` section of RESULTS.md (see
_report.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _report
import numpy as np

from lenscape import schema
from lenscape.views.explorer import Explorer

TARGET_MS = 50.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = _report.parse_args(parser, repeats=1)
    values = np.random.default_rng(0).normal(size=(2, 16, 36, 32)).astype(np.float32)
    da = schema.make(
        values,
        dims=("model", "cluster", "layer", "head"),
        n_layers=36,
        coords={"model": ["model-a", "model-b"]},
        attrs=dict(
            long_name="attribution",
            units="logit diff",
            method="synthetic",
            metric="logit_diff",
            model="synthetic",
            backend="none",
            dtype="float32",
        ),
    )
    explorer = Explorer(da, x="head", y="layer")
    choices = [*list(range(16)), "mean", "max", "min"]
    cases = {
        "1 panel (1152 cells)": None,
        "facet=model (2304 cells)": "model",
    }
    print(f"Explorer redraw, array {dict(da.sizes)}")
    rows = []
    for label, facet in cases.items():
        explorer.controls["facet"].value = facet
        times = []
        for _ in range(args.repeats):
            for choice in choices:
                start = time.perf_counter()
                explorer.controls["cluster"].value = choice
                times.append((time.perf_counter() - start) * 1e3)
                assert explorer.view.pick["cluster"] == choice
        median, p90 = statistics.median(times), np.percentile(times, 90)
        verdict = "OK" if median <= TARGET_MS else "OVER TARGET"
        print(
            f"  cluster dropdown, {label}: median {median:.1f} ms, p90 {p90:.1f} ms "
            f"over {len(times)} changes  [{verdict}, target <= {TARGET_MS:.0f} ms]"
        )
        rows.append([*_report.stamp(), label, f"{median:.0f} ms", f"{p90:.0f} ms"])
    intro = f"""\
`python benchmarks/redraw.py`: time from an Explorer control change to the new chart spec
(reduce -> heatmap -> `JupyterChart` `to_dict`), for a (model 2 x cluster 16 x layer 36 x
head 32) array, x=head, y=layer, changing the `cluster` dropdown through its 16 values and 3
score reducers, {args.repeats} times each. Target: median <= {TARGET_MS:.0f} ms.

Not included: the browser's own drawing of the SVG after the spec arrives. Medians varied
by about 5 ms between runs on the shared 2-core machine of 2026-11-22."""
    _report.emit(
        args,
        _report.section(
            "redraw",
            "Redraw",
            intro,
            _report.table(["date", "machine", "case", "median", "p90"], rows),
        ),
    )


if __name__ == "__main__":
    main()
