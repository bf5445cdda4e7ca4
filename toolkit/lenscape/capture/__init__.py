"""Per-prompt methods: each takes a model and prompts and returns a validated result.

One module per method family (``patching``: ablation, activation and attribution patching;
``logit``: direct logit attribution; ``edges``: edge attribution and circuits; ``lens``,
``attention``, ``inspection``, ``faithfulness``), all run by ``lenscape.sweep.registry``.
A method registers itself where it is written (``@method``); importing this package imports
every module in it, so ``METHODS`` is complete and every public method is exported here
(and from ``lenscape``) without being listed by hand. ``to_store`` runs a method by name
into a resumable store; ``circuit``, ``circuit_stability`` and ``consensus_circuit`` read
edge scores (no model run).
"""

import importlib
import pkgutil

from ..sweep.registry import METHODS
from .edges import circuit as circuit
from .edges import circuit_stability as circuit_stability
from .edges import consensus_circuit as consensus_circuit
from .to_store import capture_to as capture_to

for _module in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_module.name)

globals().update({name: spec.function for name, spec in METHODS.items() if spec.public})
__all__ = sorted(
    [
        "capture_to",
        "circuit",
        "circuit_stability",
        "consensus_circuit",
        *(n for n, s in METHODS.items() if s.public),
    ]
)
