"""What tying every result to the exact model costs: the weights hash and dtype per call.

Every public call hashes the model's weights once (``LensModel.one_call``: a write through
``param.data`` moves no version counter, so nothing cheaper sees every change) and reads
the dtype from the parameters. This script times both, fastest of ``--repeats`` rounds,
on the bundled SmolLM2-135M (float32) and on random-weight models of published shapes
(``_shapes.py``; Llama-3-8B's in bfloat16, about 15 GB), beside one forward pass of 4
prompts of 16 tokens, the least any call runs.

Run: ``python benchmarks/model_identity.py`` (``--shapes smollm2-135m`` for the bundled
model alone); writes the ``model_identity`` section of RESULTS.md (see _report.py).
"""

from __future__ import annotations

import argparse
import time

import _report
import _shapes
import torch


def _fastest(fn, repeats: int) -> float:
    """Fastest wall-clock seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _forward(model) -> None:
    """One forward pass of 4 prompts of 16 tokens."""
    ids = torch.randint(
        0, model.spec.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        model.hf(input_ids=ids.to(model.device))


def measure(name: str, repeats: int) -> list:
    """One table row for model ``name``: its size, the hash, the dtype read, a forward."""
    model = _shapes.build(name)
    params = sum(p.numel() for p in model.hf.parameters())
    hash_s = _fastest(lambda: model.weights_fingerprint, repeats)
    dtype_s = _fastest(lambda: model.dtype, repeats)
    forward_s = _fastest(lambda: _forward(model), repeats)
    dtype = str(model.dtype).removeprefix("torch.")
    print(
        f"{name} ({params / 1e9:.2f}B, {dtype}): hash {hash_s:.3f} s, dtype read "
        f"{dtype_s * 1e3:.2f} ms, one forward (4 x 16 tokens) {forward_s:.3f} s",
        flush=True,
    )
    row = [
        *_report.stamp(),
        name,
        f"{params / 1e9:.2f}B",
        dtype,
        torch.get_num_threads(),
        f"{hash_s:.3f} s",
        f"{dtype_s * 1e3:.2f} ms",
        f"{forward_s:.3f} s",
        f"{hash_s / forward_s:.2f}",
    ]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="smollm2-135m,llama-3-8b")
    parser.add_argument("--repeats", type=int, default=3)
    args = _report.parse_args(parser, shapes="smollm2-135m", repeats=1)
    rows = [measure(name, args.repeats) for name in args.shapes.split(",")]
    columns = ["date", "machine", "model", "parameters", "dtype", "threads", "hash per call"]
    columns += ["dtype read", "one forward (4 x 16)", "hash / forward"]
    body = _report.table(columns, rows)
    intro = (
        "Every public call hashes the weights once (`LensModel.one_call`) and reads the dtype "
        "from the parameters, so a model changed in place (`param.data` writes included) or "
        "cast behind the `LensModel` is seen, and stores and checkpoints are keyed by the "
        f"weights and dtype. Fastest of {args.repeats}. A call runs at least one forward "
        "pass, usually hundreds: the last column is the most the hash can add."
    )
    _report.emit(args, _report.section("model_identity", "Model identity per call", intro, body))


if __name__ == "__main__":
    main()
