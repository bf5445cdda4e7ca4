"""Explorer redraw latency: time from a control change to the new chart spec.

A (model 2 x cluster 16 x layer 36 x head 32) array is explored with x=head, y=layer.
Setting a dropdown runs the whole redraw synchronously (reduce -> heatmap -> the
JupyterChart's ``to_dict`` into its ``spec`` trait), so the time of the assignment is the
latency a person waits for, minus the browser's drawing. Target: median <= 50 ms.

Run: ``python benchmarks/redraw.py``
"""

import statistics
import time

import numpy as np

from lenscape import schema
from lenscape.widgets import Explorer

TARGET_MS = 50.0


def main(repeats: int = 5) -> None:
    values = np.random.default_rng(0).normal(size=(2, 16, 36, 32)).astype(np.float32)
    da = schema.make(values, dims=("model", "cluster", "layer", "head"), n_layers=36,
                     coords={"model": ["model-a", "model-b"]},
                     attrs=dict(long_name="attribution", units="logit diff", method="synthetic",
                                metric="logit_diff", model="synthetic", backend="none",
                                dtype="float32"))
    explorer = Explorer(da, x="head", y="layer")
    choices = list(range(16)) + ["mean", "max", "min", "any", "all"]
    cases = {
        "cluster dropdown, 1 panel (1152 cells)": None,
        "cluster dropdown, facet=model (2304 cells)": "model",
    }
    print(f"Explorer redraw, array {dict(da.sizes)}")
    for label, facet in cases.items():
        explorer.controls["facet"].value = facet
        times = []
        for _ in range(repeats):
            for choice in choices:
                start = time.perf_counter()
                explorer.controls["cluster"].value = choice
                times.append((time.perf_counter() - start) * 1e3)
                assert explorer.view.pick["cluster"] == choice
        median = statistics.median(times)
        verdict = "OK" if median <= TARGET_MS else "OVER TARGET"
        print(f"  {label}: median {median:.1f} ms, p90 {np.percentile(times, 90):.1f} ms "
              f"over {len(times)} changes  [{verdict}, target <= {TARGET_MS:.0f} ms]")


if __name__ == "__main__":
    main()
