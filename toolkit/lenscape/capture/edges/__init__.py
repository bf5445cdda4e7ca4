"""Edges: which component reads what from which, through its query, key or value input.

The residual stream is a sum of *senders*' outputs: the embeddings (the stream entering
block 0: tokens, and learned positions where the family has them), every attention head's
output (its slice of the ``o_proj`` input times its columns of W_O) and every MLP's (a
mixture-of-experts block, router and experts together, is one MLP). *Receivers* read it:
each query head's q projection, each key/value head's k and v projections (under
grouped-query attention the key/value head itself, shared by its query group, so nothing is
counted once per query head), each MLP and the logits. An edge ``s -> r`` is sender ``s``
as read by receiver ``r``; ``r`` reads every sender upstream of it (an earlier layer, or
the same layer's heads for an MLP in a sequential block; not under a parallel residual).

Every family is read from its description (``lenscape.models.layouts.Computation``, which
the self-check verifies on load): where the norms sit and their formula, fused q/k/v
projections and their column order, QK-norms, the residual topology. Post-norms (Gemma 2
and 3, OLMo 2) make a head's own output ambiguous, the norm not being linear across heads:
a head's sender output is its o_proj share times the norm's per-position scale and gain
*in that run* (computed from the whole attention output), so the heads sum exactly to the
block's output, patching every edge gives the other run, and patching all of a block's
heads' edges is patching the block; patching one head's outgoing edges is not patching the
head (which also moves the scale the other heads share: docs/site/explanation/families.md gives the
size of the difference on gemma3-270m).

One module per job:

- ``graph``: senders, receivers, which edges exist, their labels, and reading an edge
  result back by label (``aligned``);
- ``hooks``: the forward hooks that give every receiver its own residual stream (for its
  input gradient, or for patching any set of edges in one pass);
- ``scores``: EAP and EAP-IG (``edge_attribution``), a planned method;
- ``by_span``: the same by (component, span) node (``positions="spans"``; the graph:
  ``graph.SpanGraph``): each key/value gradient split by the query span it reaches;
- ``circuits``: the top edges on a path embeddings -> logits (``circuit``), pure numpy;
- ``patching``: exact edge patching of edge-set variants (``edge_patching``,
  ``circuit_faithfulness``);
- ``agreement``: each estimator against exact single-edge patching (``edge_agreement``);
- ``stability``: how often each edge enters the circuit over bootstrap resamples of the
  prompts (``circuit_stability``), the consensus circuit (``consensus_circuit``) and its
  faithfulness over budgets (``consensus_faithfulness``);
- ``cut``: a circuit's boundary decided by exact single-edge patching (``exact_cut``).
"""

from .agreement import edge_agreement
from .circuits import circuit
from .cut import exact_cut
from .patching import circuit_faithfulness, edge_patching
from .scores import edge_attribution
from .stability import circuit_stability, consensus_circuit, consensus_faithfulness

__all__ = [
    "circuit",
    "circuit_faithfulness",
    "circuit_stability",
    "consensus_circuit",
    "consensus_faithfulness",
    "edge_agreement",
    "edge_attribution",
    "edge_patching",
    "exact_cut",
]
