"""Per-prompt methods: each takes a model and prompts and returns a validated DataArray.

One module per method family (``patching``: ablation, activation and attribution patching;
``logit``: direct logit attribution; ``edges``: edge attribution and circuits; ``attention``,
``lens``, ``inspection``, ``faithfulness``), all built on ``lenscape.sweep``; ``to_store``
runs a method by name into a resumable store."""

from .edges import circuit, circuit_faithfulness, edge_agreement, edge_attribution, edge_patching
from .logit import direct_logit_attribution
from .patching import ablation, activation_patching, attribution_patching
from .to_store import capture_to

__all__ = [
    "ablation",
    "activation_patching",
    "attribution_patching",
    "capture_to",
    "circuit",
    "circuit_faithfulness",
    "direct_logit_attribution",
    "edge_agreement",
    "edge_attribution",
    "edge_patching",
]
