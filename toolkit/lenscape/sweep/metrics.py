"""Scalar metrics of a forward pass, one value per prompt.

Each metric maps logits at the read position, (batch, vocab), and the target and
distractor token ids, (batch,), to (batch,). Attribution scores are changes in one of
these, so their ``units`` attr comes from ``UNITS``.
"""

from __future__ import annotations

import torch

METRICS = ("logit_diff", "logprob", "loss", "logit")
LONG_NAMES = {
    "logit_diff": "logit difference (target - distractor)",
    "logprob": "target log-probability",
    "loss": "loss on the target token",
    "logit": "target logit",
}
UNITS = {"logit_diff": "logits", "logprob": "nats", "loss": "nats", "logit": "logits"}


def compute(
    metric: str, logits: torch.Tensor, target: torch.Tensor, distractor: torch.Tensor
) -> torch.Tensor:
    """Evaluate ``metric``; logits (batch, vocab), target/distractor (batch,) -> (batch,).

    Computed in float32 whatever the model dtype, so bf16 runs do not lose the metric.
    """
    logits = logits.float()
    rows = torch.arange(logits.shape[0], device=logits.device)
    if metric == "logit_diff":
        return logits[rows, target] - logits[rows, distractor]
    if metric == "logit":
        return logits[rows, target]
    logprob = torch.log_softmax(logits, dim=-1)[rows, target]
    return logprob if metric == "logprob" else -logprob


def read_ids(metric: str, target: torch.Tensor, distractor: torch.Tensor) -> torch.Tensor | None:
    """The token ids whose logits ``metric`` reads, (batch, 2) [target, distractor], for a
    pass that unembeds only those (``Backend.run(vocab=)``); None when it reads every logit
    (a log-softmax)."""
    if metric in ("logit_diff", "logit"):
        return torch.stack([target, distractor], 1)
    return None


def compute_read(
    metric: str,
    logits: torch.Tensor,
    target: torch.Tensor,
    distractor: torch.Tensor,
    read: torch.Tensor | None,
) -> torch.Tensor:
    """``compute`` on the logits of a pass run with ``vocab=read`` (``read_ids``): (batch, 2)
    when ``read`` is not None, (batch, vocab) otherwise."""
    if read is None:
        return compute(metric, logits, target, distractor)
    first = torch.zeros_like(target)
    return compute(metric, logits, first, first + 1)


def check_finite(values: torch.Tensor, index: torch.Tensor, metric: str) -> torch.Tensor:
    """Raise if a metric value is NaN/inf instead of letting it propagate silently.

    Args:
        values: (batch, ...) metric values. index: (batch,) prompt indices for the message.
    """
    bad = ~torch.isfinite(values)
    if bad.any():
        rows = bad.reshape(bad.shape[0], -1).any(-1)
        raise ValueError(
            f"metric '{metric}' is not finite (NaN/inf) for prompt(s) "
            f"{index[rows.cpu()].tolist()}; this usually means a float16 overflow "
            "or broken weights: try dtype='float32' or 'bfloat16'."
        )
    return values
