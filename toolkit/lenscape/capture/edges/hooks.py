"""The hooks that give every receiver its own copy of the residual stream.

Each receiver gets its own copy of the residual stream: module hooks on the Hugging Face
model recompute q, k and v head by head from ``norm(resid + delta_r)`` and add ``delta_r``
to the input of the MLP's norm and of the final norm (only the receiver sees it; the
residual stream itself flows on unchanged). With ``delta_r = -sum over patched senders s of
(current_s - other_s)``, ``r`` reads those senders' values from another run and every other
sender as it is in this one: exact edge patching of any set of edges in one forward pass.

Edge attribution needs the gradient at each receiver's own input, d(metric)/d(delta_r) at
``delta_r = 0``, without the per-receiver copies: the pass runs unedited, with zero leaf
tensors added to the outputs of q_proj, k_proj and v_proj and to the inputs of the MLP's
norm and of the final norm. A q, k or v receiver's input gradient is then its head's
output gradient taken back through its rows of the projection and through the block's
norm at that block's input (``receiver_gradients``: the norm's input gradient in closed
form per chunk of receivers), the same numbers as the copies would give, in the memory
of one ordinary backward pass.

Supported: sequential pre-norm blocks with separate q, k and v projections (Llama,
Mistral, Qwen 2 and 3 families), on the nnsight backend, whose passes run the Hugging
Face module these hooks sit on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch.utils.hooks import RemovableHandle

from ... import _validate
from ...models import LensModel
from ...models.parts import per_head
from ...sweep import metrics
from ...sweep.backend import BACKENDS, TokenBatch, get_backend
from ...sweep.inputs import Batch, Inputs
from ...sweep.relevance import norm_input_gradient
from .graph import Graph

#: Runs that can hook the Hugging Face module the edge hooks sit on.
EDGE_BACKENDS = ("nnsight",)


@dataclass
class Pass:
    """What the hooks of one forward pass read and write.

    Attributes:
        graph: the model's edges.
        deltas: zero leaves whose gradients are the receivers' gradients: ("mlp", layer)
            and ("logits", -1) -> (batch, pos, d_model) added to the MLP's and the final
            norm's input; (kind, layer) for kind "q", "k", "v" -> (batch, pos, n * d_head)
            added to that projection's output (n: query or key/value heads; see
            ``receiver_gradients``), or ("attn", layer) -> (batch, pos, n_heads + 2
            n_kv_heads, d_model) added to each q, k, v receiver's own copy of its input.
        other: (batch, pos, n_senders, d_model) sender outputs of another run; with
            ``patched``, receivers read the patched senders from it.
        patched: (n_senders, n_receivers) weight of ``other - current`` added to each
            receiver's input (1: the edge reads the other run; 0: this run).
        embed_path: replaces the embeddings (integrated gradients' interpolation).
        keep_senders: keep this pass's sender outputs in ``senders``.
        into: (batch, n_senders, pos, d_model): this pass's sender outputs are added to
            it, times ``sign`` (edge attribution's clean - corrupt differences).
        sign: the factor of ``into``.
        keep_resids: keep each block's input in ``resids`` (``receiver_gradients``).
        senders: (batch, pos, n_senders, d_model), filled with this pass's sender outputs.
        resids: layer -> (batch, pos, d_model) the residual stream entering the block.
        differences: with ``patched``, (n_senders, batch, pos, d_model) other - current.
    """

    graph: Graph
    deltas: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    other: torch.Tensor | None = None
    patched: torch.Tensor | None = None
    embed_path: Callable[[torch.Tensor], torch.Tensor] | None = None
    keep_senders: bool = True
    into: torch.Tensor | None = None
    sign: float = 1.0
    keep_resids: bool = False
    senders: torch.Tensor | None = None
    resids: dict[int, torch.Tensor] = field(default_factory=dict)
    resid: torch.Tensor | None = None
    qkv_delta: torch.Tensor | None = None
    differences: torch.Tensor | None = None
    total: torch.Tensor | None = None
    recorded: int = 0

    def start(self, embeddings: torch.Tensor) -> None:
        """Allocate the per-pass buffers for ``embeddings`` (batch, pos, d_model)."""
        rows, width, d_model = embeddings.shape
        if self.keep_senders:
            self.senders = embeddings.new_zeros((rows, width, len(self.graph.senders), d_model))
        self.recorded = 0
        if self.patched is not None:
            # (n_senders, batch, pos, d_model): other - current, sender-major so that a
            # receiver's patch is one matrix product over the senders it treats specially.
            self.differences = embeddings.new_zeros((len(self.graph.senders), rows, width, d_model))
            self.total = embeddings.new_zeros((rows, width, d_model))

    def record(self, first: int, outputs: torch.Tensor) -> None:
        """Keep senders ``first..`` of this pass: outputs (batch, pos, n, d_model)."""
        assert first == self.recorded
        outputs = outputs.detach()
        count = outputs.shape[2]
        if self.senders is not None:
            self.senders[:, :, first : first + count] = outputs
        if self.into is not None:
            self.into[:, first : first + count].add_(outputs.transpose(1, 2), alpha=self.sign)
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
    """Hooks of block ``layer``: its q/k/v receivers rebuilt from their own input (or given
    their gradient leaves), its heads' and MLP's outputs recorded as senders, its MLP
    receiver's input patched."""
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
        if state.keep_resids:
            state.resids[layer] = args[0].detach()

    def qkv_hook(module, args, output, *, kind):
        if kind == "q":
            state.qkv_delta = state.receiver_delta(("attn", layer), graph.attn_receivers(layer))
        delta = state.qkv_delta
        if delta is not None:
            assert state.resid is not None
            # ``forward``, not a call: the norm's own hook keeps the block's input.
            normed = parts["norm"].forward(state.resid[:, :, None] + delta[:, :, columns[kind]])
            output = _per_head(module, normed)
        leaf = state.deltas.get((kind, layer))
        return output if leaf is None else output + leaf

    def head_outputs(module, args):
        z = args[0]
        w_o = module.weight.view(spec.d_model, n_heads, spec.d_head)
        with torch.no_grad():  # recorded detached: no graph for it
            heads = per_head(z.view(*z.shape[:2], n_heads, spec.d_head), w_o)
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


def receiver_gradients(
    model: LensModel, state: Pass, grads: dict[tuple[str, int], torch.Tensor], layer: int
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The input gradients of block ``layer``'s q, k and v receivers, chunk by chunk.

    A receiver's input gradient is its head's output gradient taken back through the
    head's rows of its projection and through the block's norm at the block's input
    (``state.resids``, kept by a pass with ``keep_resids``), in closed form
    (``relevance.norm_input_gradient``: under relevance rules, their norm rule) per chunk of
    at most ``receiver_chunk`` receivers.

    Args:
        grads: the gradients of the pass's leaves (``Pass.deltas``) by key; those of
            ("q" | "k" | "v", ``layer``) are read.

    Returns:
        (columns, gradient) per chunk: the chunk's receivers among the layer's attention
        receivers (``Graph.attn_receivers``: q heads, then k, then v) and their input
        gradients, (n, batch, pos, d_model) in float32 (or the model's dtype if wider).
    """
    parts, spec = _parts(model, layer), model.spec
    resid = state.resids[layer]
    rows, width, d_model = resid.shape
    chunk = receiver_chunk(rows * width * d_model * 4)  # the norm works in float32
    start = 0
    for kind in ("q", "k", "v"):
        weight = cast(torch.Tensor, parts[kind].weight)  # (n * d_head, d_model)
        grad = grads[kind, layer].view(rows, width, -1, spec.d_head)  # (batch, pos, n, d_head)
        n = grad.shape[2]
        per_head = weight.view(n, spec.d_head, d_model)
        for first in range(0, n, chunk):
            heads = slice(first, min(first + chunk, n))
            outer = torch.einsum("bpnk,nkd->nbpd", grad[:, :, heads], per_head[heads])
            inner = norm_input_gradient(parts["norm"], resid, outer)
            yield slice(start + heads.start, start + heads.stop), inner
        start += n


#: Most bytes of one chunk of receiver input gradients (``receiver_gradients``): its batched
#: norm product holds a few tensors of this size at once.
CHUNK_BYTES = 64 * 2**20


def receiver_chunk(bytes_per_receiver: int) -> int:
    """How many receivers' input gradients (``bytes_per_receiver`` each) one chunk holds:
    as many as ``CHUNK_BYTES`` allows, at least 1."""
    return max(1, CHUNK_BYTES // max(bytes_per_receiver, 1))


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
