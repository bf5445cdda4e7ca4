"""The hooks that give every receiver its own copy of the residual stream.

Each receiver gets its own copy of the residual stream: module hooks on the Hugging Face
model recompute q, k and v head by head from ``norm(resid + delta_r)`` and add ``delta_r``
to the input of the MLP's norm and of the final norm (only the receiver sees it; the
residual stream itself flows on unchanged). With ``delta_r`` a zero leaf tensor,
d(metric)/d(delta_r) is the gradient at ``r``'s input, through ``r``'s own norm. With
``delta_r = -sum over patched senders s of (current_s - other_s)``, ``r`` reads those
senders' values from another run and every other sender as it is in this one: exact edge
patching of any set of edges in one forward pass.

Supported: sequential pre-norm blocks with separate q, k and v projections (Llama,
Mistral, Qwen 2 and 3 families), on the nnsight backend, whose passes run the Hugging
Face module these hooks sit on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

from ... import _validate
from ...models import LensModel
from ...sweep import metrics
from ...sweep.backend import BACKENDS, TokenBatch, get_backend
from ...sweep.inputs import Batch, Inputs
from .graph import Graph

#: Runs that can hook the Hugging Face module the edge hooks sit on.
EDGE_BACKENDS = ("nnsight",)


@dataclass
class Pass:
    """What the hooks of one forward pass read and write.

    Attributes:
        graph: the model's edges.
        deltas: zero leaves whose gradients are the receivers' input gradients:
            ("attn", layer) -> (batch, pos, n_heads + 2 n_kv_heads, d_model) for its q, k, v
            receivers; ("mlp", layer) and ("logits", -1) -> (batch, pos, d_model).
        other: (batch, pos, n_senders, d_model) sender outputs of another run; with
            ``patched``, receivers read the patched senders from it.
        patched: (n_senders, n_receivers) weight of ``other - current`` added to each
            receiver's input (1: the edge reads the other run; 0: this run).
        embed_path: replaces the embeddings (integrated gradients' interpolation).
        senders: (batch, pos, n_senders, d_model), filled with this pass's sender outputs.
        differences: with ``patched``, (n_senders, batch, pos, d_model) other - current.
    """

    graph: Graph
    deltas: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    other: torch.Tensor | None = None
    patched: torch.Tensor | None = None
    embed_path: Callable[[torch.Tensor], torch.Tensor] | None = None
    senders: torch.Tensor | None = None
    resid: torch.Tensor | None = None
    qkv_delta: torch.Tensor | None = None
    differences: torch.Tensor | None = None
    total: torch.Tensor | None = None
    recorded: int = 0

    def start(self, embeddings: torch.Tensor) -> None:
        """Allocate the per-pass buffers for ``embeddings`` (batch, pos, d_model)."""
        rows, width, d_model = embeddings.shape
        self.senders = embeddings.new_zeros((rows, width, len(self.graph.senders), d_model))
        self.recorded = 0
        if self.patched is not None:
            # (n_senders, batch, pos, d_model): other - current, sender-major so that a
            # receiver's patch is one matrix product over the senders it treats specially.
            self.differences = embeddings.new_zeros((len(self.graph.senders), rows, width, d_model))
            self.total = embeddings.new_zeros((rows, width, d_model))

    def record(self, first: int, outputs: torch.Tensor) -> None:
        """Keep senders ``first..`` of this pass: outputs (batch, pos, n, d_model)."""
        assert self.senders is not None and first == self.recorded
        outputs = outputs.detach()
        count = outputs.shape[2]
        self.senders[:, :, first : first + count] = outputs
        self.recorded += count
        if self.differences is not None and self.total is not None:
            assert self.other is not None
            difference = self.other[:, :, first : first + count] - outputs
            self.differences[first : first + count] = difference.permute(2, 0, 1, 3)
            self.total += difference.sum(2)

    def receiver_delta(self, key: tuple[str, int], columns: slice) -> torch.Tensor | None:
        """What receivers ``columns`` add to their input: (batch, pos, n, d_model), or
        (batch, pos, d_model) for a single receiver, or None.

        Patched: sum over upstream senders s of weight[s, r] (other_s - current_s), computed
        as the column's typical weight (its median) times the running total of differences
        plus a product over the few senders whose weight differs from it (the circuit's own
        edges when most edges are patched, the patched ones when few are).
        """
        delta = self.deltas.get(key)
        if self.patched is not None:
            assert self.differences is not None and self.total is not None
            count = int(self.graph.upstream[columns.start])
            assert count == self.recorded  # receivers read every sender recorded so far
            weights = self.patched[:count, columns].to(self.total.dtype)
            typical = weights.median(0).values  # (receivers,)
            rows = torch.nonzero((weights != typical).any(1)).flatten()
            patch = typical[:, None, None, None] * self.total
            if len(rows):
                upstream = self.differences[rows]
                n_rows, batch, width, d_model = upstream.shape
                extra = (weights[rows] - typical).T @ upstream.reshape(n_rows, -1)
                patch = patch + extra.view(-1, batch, width, d_model)
            if bool(weights.any()):
                patch = patch[0] if columns.stop - columns.start == 1 else patch.permute(1, 2, 0, 3)
                delta = patch if delta is None else delta + patch
        return delta


def _per_head(projection: torch.nn.Linear, normed: torch.Tensor) -> torch.Tensor:
    """Each head's projection of its own input: (batch, pos, n, d_model) -> (batch, pos,
    n * d_head), as ``projection`` (a Linear over all n heads) lays it out."""
    n = normed.shape[2]
    weight = projection.weight
    out = torch.einsum("bpnd,nkd->bpnk", normed, weight.view(n, -1, weight.shape[1]))
    if projection.bias is not None:
        out = out + projection.bias.view(n, -1)
    return out.flatten(2)


def _parts(model: LensModel, layer: int) -> dict[str, torch.nn.Module]:
    """The modules of block ``layer`` the hooks use.

    Raises:
        ValueError: a family without sequential pre-norm blocks and separate q/k/v.
    """
    layout = model.spec.layout
    attention = layout.o_proj.rsplit(".", 1)[0]
    names = {
        "norm": "input_layernorm",
        "q": f"{attention}.q_proj",
        "k": f"{attention}.k_proj",
        "v": f"{attention}.v_proj",
        "o": layout.o_proj,
        "mlp_norm": "post_attention_layernorm",
        "mlp": layout.mlp_out,
    }
    try:
        parts = {key: model.module(path, layer) for key, path in names.items()}
    except AttributeError:
        parts = {}
    if not parts or layout.post_attn_norm or layout.qkv_split or layout.norm_offset:
        raise ValueError(
            f"Edge attribution needs sequential pre-norm blocks with separate q_proj, "
            f"k_proj and v_proj and heads added straight to the residual stream (Llama, "
            f"Mistral, Qwen 2/3); {model.spec.architecture!r} ({model.name}) is not one. "
            "Use lsc.attribution_patching for head-level scores on it."
        )
    return parts


def _layer_hooks(model: LensModel, state: Pass, layer: int) -> list[RemovableHandle]:
    """Hooks of block ``layer``: its q/k/v receivers rebuilt from their own input, its heads'
    and MLP's outputs recorded as senders, its MLP receiver's input patched."""
    graph, spec = state.graph, model.spec
    n_heads, n_kv = spec.n_heads, spec.n_kv_heads
    parts = _parts(model, layer)
    first = graph.head_sender(layer)
    columns = {
        "q": slice(0, n_heads),
        "k": slice(n_heads, n_heads + n_kv),
        "v": slice(n_heads + n_kv, n_heads + 2 * n_kv),
    }

    def keep_resid(module, args):
        state.resid = args[0]
        state.qkv_delta = None

    def qkv_hook(module, args, output, *, kind):
        if kind == "q":
            state.qkv_delta = state.receiver_delta(("attn", layer), graph.attn_receivers(layer))
        delta = state.qkv_delta
        if delta is None:
            return output
        assert state.resid is not None
        # ``forward``, not a call: the norm's own hook keeps the block's input.
        normed = parts["norm"].forward(state.resid[:, :, None] + delta[:, :, columns[kind]])
        return _per_head(module, normed)

    def head_outputs(module, args):
        z = args[0]
        w_o = module.weight.view(spec.d_model, n_heads, spec.d_head)
        heads = torch.einsum("bphk,dhk->bphd", z.view(*z.shape[:2], n_heads, spec.d_head), w_o)
        state.record(first, heads)

    def mlp_input(module, args):
        receiver = graph.mlp_receiver(layer)
        delta = state.receiver_delta(("mlp", layer), slice(receiver, receiver + 1))
        return None if delta is None else (args[0] + delta, *args[1:])

    def mlp_output(module, args, output):
        state.record(first + n_heads, output[:, :, None])

    return [
        parts["norm"].register_forward_pre_hook(keep_resid),
        *(
            parts[kind].register_forward_hook(functools.partial(qkv_hook, kind=kind))
            for kind in ("q", "k", "v")
        ),
        parts["o"].register_forward_pre_hook(head_outputs),
        parts["mlp_norm"].register_forward_pre_hook(mlp_input),
        parts["mlp"].register_forward_hook(mlp_output),
    ]


@contextlib.contextmanager
def edge_hooks(model: LensModel, state: Pass) -> Iterator[None]:
    """Install the edge hooks on ``model.hf`` for the passes run inside the block."""
    graph, layout = state.graph, model.spec.layout

    def embed_hook(module, args, output):
        if state.embed_path is not None:
            output = state.embed_path(output)
        state.start(output)
        state.record(0, output[:, :, None])
        return output

    def logits_input(module, args):
        last = len(graph.receivers) - 1
        delta = state.receiver_delta(("logits", -1), slice(last, last + 1))
        return None if delta is None else (args[0] + delta, *args[1:])

    handles = [model.module(layout.embed).register_forward_hook(embed_hook)]
    for layer in range(graph.n_layers):
        handles += _layer_hooks(model, state, layer)
    handles.append(model.module(layout.final_norm).register_forward_pre_hook(logits_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_pass(
    model: LensModel, backend: str, tokens: TokenBatch, state: Pass, *, grad: bool
) -> torch.Tensor:
    """One pass with the edge hooks: logits at the read positions, (batch, vocab)."""
    with edge_hooks(model, state):
        return get_backend(model, backend).run(tokens, grad=grad).logits


def check_supported(model: LensModel, backend: str) -> None:
    """Refuse a backend or an architecture the edge hooks cannot serve.

    Raises:
        ValueError: backend="transformer_lens", or a family without sequential pre-norm
            blocks and separate q/k/v projections.
    """
    _validate.choice("backend", backend, BACKENDS)
    if backend not in EDGE_BACKENDS:
        raise ValueError(
            f"backend={backend!r} cannot express edges: each receiver reads its own copy of "
            "the residual stream through module hooks on the Hugging Face model, which the "
            "TransformerLens bridge does not run (it runs its own copy), and TransformerLens "
            "4.3's split q/k/v inputs are per query head, which double-counts key/value heads "
            "shared under grouped-query attention. Use backend='nnsight'."
        )
    _parts(model, 0)


def metric_of(inputs: Inputs, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    value = metrics.compute(inputs.metric, logits, batch.target, batch.distractor)
    return metrics.check_finite(value, batch.index, inputs.metric)


def unedited(inputs: Inputs, tokens: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """An unedited pass: (sender outputs (batch, pos, n_senders, d_model), logits)."""
    state = Pass(Graph.of(inputs.model))
    with torch.no_grad():
        logits = run_pass(inputs.model, inputs.backend, tokens, state, grad=False)
    assert state.senders is not None
    return state.senders, logits
