"""Edges: which component reads what from which, through its query, key or value input.

The residual stream is a sum of *senders*' outputs: the embeddings, every attention head's
output (its slice of the ``o_proj`` input times its columns of W_O) and every MLP's.
*Receivers* read it: each query head's q projection, each key/value head's k and v
projections (under grouped-query attention the key/value head itself, shared by its query
group, so nothing is counted once per query head), each MLP and the logits. An edge
``s -> r`` is sender ``s`` as read by receiver ``r``; ``r`` reads every sender upstream of it
(an earlier layer, or the same layer's heads for an MLP).

Each receiver gets its own copy of the residual stream: module hooks on the Hugging Face
model recompute q, k and v head by head from ``norm(resid + delta_r)`` and add ``delta_r``
to the input of the MLP's norm and of the final norm (only the receiver sees it; the
residual stream itself flows on unchanged). With ``delta_r`` a zero leaf tensor,
d(metric)/d(delta_r) is the gradient at ``r``'s input, through ``r``'s own norm. With
``delta_r = -sum over patched senders s of (current_s - other_s)``, ``r`` reads those
senders' values from another run and every other sender as it is in this one: exact edge
patching of any set of edges in one forward pass.

Scores (denoising sign, as ``lsc.attribution_patching`` and TransformerLens 4.3's
``attribution_patch``): EAP (Syed et al. 2023)
``score(s -> r) = sum_pos (clean_s - corrupt_s) . d metric / d(input of r)`` at the corrupt
run; positive: the edge carries the clean answer. EAP-IG (Hanna et al. 2024, arXiv
2403.17806) averages the gradient over ``steps`` points ``a_k = k / steps`` of the straight
path from the corrupt to the clean embeddings (left Riemann sum); ``steps=1`` is EAP.

Circuits keep the top edges by |score| on a path from the embeddings to the logits; a
circuit is judged by exact edge patching: the clean run with every edge outside it reading
its sender from the corrupt run, faithfulness f(C) = (m(C) - m(empty)) / (m(full) -
m(empty)) over edge budgets, with its area (CPR, higher is better) and the area between it
and 1 (CMD, lower is better), as in the MIB circuit track.

Supported: sequential pre-norm blocks with separate q, k and v projections (Llama,
Mistral, Qwen 2 and 3 families), on the nnsight backend, whose passes run the Hugging
Face module these hooks sit on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xarray as xr
from tqdm.auto import tqdm

from .. import _validate, schema
from ..data import Prompts
from ..models import LensModel
from ..schema import RECEIVER_KINDS
from ..sweep import metrics
from ..sweep.backend import BACKENDS, TokenBatch, get_backend
from ..sweep.inputs import Batch, Inputs, prepare
from ..sweep.metrics import LONG_NAMES, UNITS
from ..sweep.options import DEFAULTS, check_options
from .faithfulness import agreement

ESTIMATORS = ("eap", "eap-ig")
#: Integration points of ``estimator="eap-ig"`` when ``steps`` is not given.
DEFAULT_IG_STEPS = 5
SENDER_KINDS = ("embed", "head", "mlp")
#: Edge budgets (fractions of all edges) of a faithfulness curve.
DEFAULT_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: Runs that can hook the Hugging Face module the edge hooks sit on.
EDGE_BACKENDS = ("nnsight",)


# ------------------------------------------------------------------------------ the graph


@dataclass(frozen=True)
class Graph:
    """Senders, receivers and which edges exist, for one model's sizes.

    Senders in order: ``embed``, then per layer its heads and its MLP. Receivers: per layer
    its q heads, k heads (key/value heads), v heads and MLP, then ``logits``.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int

    @classmethod
    def of(cls, model: LensModel) -> Graph:
        spec = model.spec
        return cls(spec.n_layers, spec.n_heads, spec.n_kv_heads)

    @property
    def per_layer(self) -> int:
        """Receivers per layer: q, k, v heads and the MLP."""
        return self.n_heads + 2 * self.n_kv_heads + 1

    def head_sender(self, layer: int) -> int:
        """Index of layer ``layer``'s head 0 among the senders (its MLP follows its heads)."""
        return 1 + layer * (self.n_heads + 1)

    def attn_receivers(self, layer: int) -> slice:
        """Layer ``layer``'s q, k and v receivers (q heads, then k, then v)."""
        start = layer * self.per_layer
        return slice(start, start + self.per_layer - 1)

    def mlp_receiver(self, layer: int) -> int:
        return (layer + 1) * self.per_layer - 1

    @functools.cached_property
    def senders(self) -> list[tuple[str, int, int]]:
        """(kind, layer, head); -1 where a sender has no layer (embed) or head."""
        out = [("embed", -1, -1)]
        for layer in range(self.n_layers):
            out += [("head", layer, head) for head in range(self.n_heads)]
            out.append(("mlp", layer, -1))
        return out

    @functools.cached_property
    def receivers(self) -> list[tuple[str, int, int]]:
        """(kind, layer, head); k and v heads count key/value heads; -1: no head."""
        out = []
        for layer in range(self.n_layers):
            out += [("q", layer, head) for head in range(self.n_heads)]
            out += [("k", layer, head) for head in range(self.n_kv_heads)]
            out += [("v", layer, head) for head in range(self.n_kv_heads)]
            out.append(("mlp", layer, -1))
        out.append(("logits", self.n_layers, -1))
        return out

    @functools.cached_property
    def upstream(self) -> np.ndarray:
        """(n_receivers,) how many senders (a prefix of ``senders``) each receiver reads."""
        counts = []
        for kind, layer, _ in self.receivers:
            if kind == "logits":
                counts.append(len(self.senders))
            elif kind == "mlp":
                counts.append(self.head_sender(layer) + self.n_heads)
            else:
                counts.append(self.head_sender(layer))
        return np.asarray(counts)

    @functools.cached_property
    def valid(self) -> np.ndarray:
        """(n_senders, n_receivers) bool: the edge exists (sender upstream of receiver)."""
        return np.arange(len(self.senders))[:, None] < self.upstream[None, :]

    @functools.cached_property
    def feeds(self) -> np.ndarray:
        """(n_receivers, n_senders + 1) bool: receiver -> the component(s) it is an input
        of (a sender, or the logits, last). A key/value head feeds its whole query group."""
        out = np.zeros((len(self.receivers), len(self.senders) + 1), dtype=bool)
        group = self.n_heads // self.n_kv_heads
        for r, (kind, layer, head) in enumerate(self.receivers):
            if kind == "logits":
                out[r, -1] = True
            elif kind == "mlp":
                out[r, self.head_sender(layer) + self.n_heads] = True
            elif kind == "q":
                out[r, self.head_sender(layer) + head] = True
            else:
                start = self.head_sender(layer) + head * group
                out[r, start : start + group] = True
        return out

    def sender_labels(self) -> list[str]:
        return [
            "embed"
            if kind == "embed"
            else f"L{layer}.H{head}"
            if kind == "head"
            else f"L{layer}.MLP"
            for kind, layer, head in self.senders
        ]

    def receiver_labels(self) -> list[str]:
        labels = []
        for kind, layer, head in self.receivers:
            if kind == "logits":
                labels.append("logits")
            elif kind == "mlp":
                labels.append(f"L{layer}.MLP")
            elif kind == "q":
                labels.append(f"L{layer}.H{head}.q")
            else:
                labels.append(f"L{layer}.KV{head}.{kind}")
        return labels

    def coords(self) -> dict[str, Any]:
        """Dim and label coords of a (sender, receiver) result."""
        senders, receivers = np.asarray(self.senders, dtype=object), self.receivers
        return {
            "sender": self.sender_labels(),
            "receiver": self.receiver_labels(),
            "sender_kind": ("sender", [kind for kind, _, _ in self.senders]),
            "sender_layer": ("sender", senders[:, 1].astype(np.int64)),
            "sender_head": ("sender", senders[:, 2].astype(np.int64)),
            "receiver_kind": ("receiver", [kind for kind, _, _ in receivers]),
            "receiver_layer": ("receiver", np.asarray([r[1] for r in receivers], np.int64)),
            "receiver_head": ("receiver", np.asarray([r[2] for r in receivers], np.int64)),
        }


# ------------------------------------------------------------------------------ the hooks


@dataclass
class _Pass:
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


@contextlib.contextmanager
def _hooks(model: LensModel, state: _Pass) -> Iterator[None]:
    """Install the edge hooks on ``model.hf`` for the passes run inside the block."""
    graph, spec = state.graph, model.spec
    n_heads, n_kv = spec.n_heads, spec.n_kv_heads
    handles = []

    def embed_hook(module, args, output):
        if state.embed_path is not None:
            output = state.embed_path(output)
        state.start(output)
        state.record(0, output[:, :, None])
        return output

    handles.append(model.module(spec.layout.embed).register_forward_hook(embed_hook))
    for layer in range(spec.n_layers):
        parts = _parts(model, layer)
        first = graph.head_sender(layer)

        def keep_resid(module, args):
            state.resid = args[0]
            state.qkv_delta = None

        def qkv_hook(module, args, output, *, kind, layer=layer, norm=parts["norm"]):
            if kind == "q":
                state.qkv_delta = state.receiver_delta(("attn", layer), graph.attn_receivers(layer))
            delta = state.qkv_delta
            if delta is None:
                return output
            columns = {
                "q": slice(0, n_heads),
                "k": slice(n_heads, n_heads + n_kv),
                "v": slice(n_heads + n_kv, n_heads + 2 * n_kv),
            }[kind]
            assert state.resid is not None
            # ``forward``, not a call: the norm's own hook keeps the block's input.
            return _per_head(module, norm.forward(state.resid[:, :, None] + delta[:, :, columns]))

        def head_outputs(module, args, *, first=first):
            z = args[0]
            w_o = module.weight.view(spec.d_model, n_heads, spec.d_head)
            heads = torch.einsum("bphk,dhk->bphd", z.view(*z.shape[:2], n_heads, spec.d_head), w_o)
            state.record(first, heads)

        def mlp_input(module, args, *, layer=layer):
            receiver = graph.mlp_receiver(layer)
            delta = state.receiver_delta(("mlp", layer), slice(receiver, receiver + 1))
            return None if delta is None else (args[0] + delta, *args[1:])

        def mlp_output(module, args, output, *, index=first + n_heads):
            state.record(index, output[:, :, None])

        handles += [
            parts["norm"].register_forward_pre_hook(keep_resid),
            *(
                parts[kind].register_forward_hook(functools.partial(qkv_hook, kind=kind))
                for kind in ("q", "k", "v")
            ),
            parts["o"].register_forward_pre_hook(head_outputs),
            parts["mlp_norm"].register_forward_pre_hook(mlp_input),
            parts["mlp"].register_forward_hook(mlp_output),
        ]

    def logits_input(module, args):
        last = len(graph.receivers) - 1
        delta = state.receiver_delta(("logits", -1), slice(last, last + 1))
        return None if delta is None else (args[0] + delta, *args[1:])

    handles.append(model.module(spec.layout.final_norm).register_forward_pre_hook(logits_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _run(
    model: LensModel, backend: str, tokens: TokenBatch, state: _Pass, *, grad: bool
) -> torch.Tensor:
    """One pass with the edge hooks: logits at the read positions, (batch, vocab)."""
    with _hooks(model, state):
        return get_backend(model, backend).run(tokens, grad=grad).logits


def _check_backend(backend: str) -> str:
    _validate.choice("backend", backend, BACKENDS)
    if backend not in EDGE_BACKENDS:
        raise ValueError(
            f"backend={backend!r} cannot express edges: each receiver reads its own copy of "
            "the residual stream through module hooks on the Hugging Face model, which the "
            "TransformerLens bridge does not run (it runs its own copy), and TransformerLens "
            "4.3's split q/k/v inputs are per query head, which double-counts key/value heads "
            "shared under grouped-query attention. Use backend='nnsight'."
        )
    return backend


def _prepare(
    model: LensModel,
    prompts: Prompts,
    *,
    metric: str,
    backend: str,
    batch_size: int | None,
    padding_side: str,
) -> Inputs:
    check_options(
        dict(metric=metric, padding_side=padding_side, backend=backend, batch_size=batch_size)
    )
    _check_backend(backend)
    _parts(model, 0)
    return prepare(
        model,
        prompts,
        metric=metric,
        level="head",
        backend=backend,
        batch_size=batch_size,
        padding_side=padding_side,
        needs_corrupt=True,
        grad=True,
    )


def _metric(inputs: Inputs, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    value = metrics.compute(inputs.metric, logits, batch.target, batch.distractor)
    return metrics.check_finite(value, batch.index, inputs.metric)


def _senders(inputs: Inputs, tokens: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """An unedited pass: (sender outputs (batch, pos, n_senders, d_model), logits)."""
    state = _Pass(Graph.of(inputs.model))
    with torch.no_grad():
        logits = _run(inputs.model, inputs.backend, tokens, state, grad=False)
    assert state.senders is not None
    return state.senders, logits


# ------------------------------------------------------------------------- edge scores


def _zero_leaves(graph: Graph, shape: tuple[int, int, int], like: torch.Tensor) -> dict:
    rows, width, d_model = shape
    leaves: dict[tuple[str, int], torch.Tensor] = {}
    for layer in range(graph.n_layers):
        leaves[("attn", layer)] = like.new_zeros((rows, width, graph.per_layer - 1, d_model))
        leaves[("mlp", layer)] = like.new_zeros((rows, width, d_model))
    leaves[("logits", -1)] = like.new_zeros((rows, width, d_model))
    return {key: leaf.requires_grad_(True) for key, leaf in leaves.items()}


def _batch_scores(inputs: Inputs, batch: Batch, steps: int) -> torch.Tensor:
    """Edge scores of one batch: (batch, n_senders, n_receivers) float32, 0 off the graph."""
    assert batch.corrupt is not None
    model, graph = inputs.model, Graph.of(inputs.model)
    clean, _ = _senders(inputs, batch.clean)
    clean_embed = clean[:, :, 0]
    gradient: torch.Tensor | None = None
    corrupt: torch.Tensor | None = None
    for k in range(steps):

        def interpolate(out: torch.Tensor, alpha: float = k / steps) -> torch.Tensor:
            return out + alpha * (clean_embed - out)

        rows, width, d_model = clean_embed.shape
        state = _Pass(
            graph,
            deltas=_zero_leaves(graph, (rows, width, d_model), clean_embed),
            embed_path=None if k == 0 else interpolate,
        )
        logits = _run(model, inputs.backend, batch.corrupt, state, grad=True)
        leaves = list(state.deltas.values())
        grads = torch.autograd.grad(_metric(inputs, logits, batch).sum(), leaves)
        stacked = torch.cat(
            [g.float() if g.dim() == 4 else g.float()[:, :, None] for g in grads], dim=2
        )
        gradient = stacked if gradient is None else gradient + stacked
        if k == 0:
            corrupt = state.senders
    assert gradient is not None and corrupt is not None
    mask = batch.corrupt.attention_mask.float()[:, :, None, None]
    diff = (clean.float() - corrupt.float()) * mask
    scores = torch.einsum("bpsd,bprd->bsr", diff, gradient / steps)
    return scores * torch.from_numpy(graph.valid).to(scores.device)


def _check_steps(estimator: str, steps: int | None) -> int:
    _validate.choice("estimator", estimator, ESTIMATORS)
    if steps is None:
        return 1 if estimator == "eap" else DEFAULT_IG_STEPS
    steps = _validate.positive_int("steps", steps)
    if estimator == "eap" and steps != 1:
        raise ValueError(
            f"estimator='eap' takes the gradient at the corrupt run alone; steps={steps} "
            "needs estimator='eap-ig' (or leave steps=None)."
        )
    return steps


def _attrs(model: LensModel, inputs: Inputs, method: str, **params: Any) -> dict[str, Any]:
    return model.provenance(
        method,
        backend=inputs.backend,
        metric=inputs.metric,
        device=str(model.device),
        prompt_set=inputs.prompts.name,
        n_prompts=len(inputs.prompts),
        prompts_sha256=inputs.fingerprint,
        batch_size=inputs.batch_size,
        padding_side=inputs.padding_side,
        **params,
    )


def edge_attribution(
    model: LensModel,
    prompts: Prompts,
    *,
    estimator: str = "eap",
    steps: int | None = None,
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    padding_side: str = DEFAULTS.padding_side,
    per_prompt: bool = False,
    progress: bool = DEFAULTS.progress,
) -> xr.DataArray:
    """Score every edge sender -> receiver with EAP or EAP-IG (see the module docstring).

    Args:
        model: a ``LensModel`` (Llama, Mistral or Qwen family; grouped-query attention is
            exact: k and v receivers are key/value heads).
        prompts: prompts with a ``corrupt`` text of the same token length and single-token
            targets (and distractors for ``metric="logit_diff"``).
        estimator: "eap" (gradient at the corrupt run) or "eap-ig" (integrated gradients
            along the corrupt -> clean embedding path).
        steps: integration points of "eap-ig" (default 5); "eap" takes 1.
        metric: "logit_diff", "logprob", "loss" or "logit".
        batch_size: prompts per pass; None picks one from free memory.
        backend: "nnsight" (TransformerLens cannot express per-receiver inputs: an error
            says so).
        padding_side: "right" or "left"; scores do not depend on it.
        per_prompt: keep the ``prompt`` dim instead of averaging over prompts.
        progress: show a progress bar.

    Returns:
        DataArray (sender, receiver), or (prompt, sender, receiver) with ``per_prompt``;
        coords ``sender_kind`` (embed, head, mlp), ``sender_layer``, ``sender_head`` and
        ``receiver_kind`` (q, k, v, mlp, logits), ``receiver_layer``, ``receiver_head``
        (-1 where there is none; the logits' layer is ``n_layers``). NaN where no edge
        exists (the receiver is upstream of the sender).

    Raises:
        ValueError: unknown estimator, steps < 1 (or > 1 with "eap"), a corrupt prompt of
            another token length, an unsupported architecture, backend="transformer_lens".
    """
    points = _check_steps(estimator, steps)
    per_prompt = _validate.flag("per_prompt", per_prompt)
    progress = _validate.flag("progress", progress)
    inputs = _prepare(
        model,
        prompts,
        metric=metric,
        backend=backend,
        batch_size=batch_size,
        padding_side=padding_side,
    )
    graph = Graph.of(model)
    rows = []
    for batch in tqdm(
        inputs.batches(),
        total=inputs.n_batches(),
        disable=not progress,
        desc="edge attribution" if estimator == "eap" else f"EAP-IG ({points} steps)",
    ):
        rows.append(_batch_scores(inputs, batch, points).cpu())
    values = torch.cat(rows).double().numpy()
    values[:, ~graph.valid] = np.nan
    effect = "EAP" if estimator == "eap" else f"EAP-IG ({points} steps)"
    attrs = {
        "long_name": f"{effect} edge score (clean -> corrupt) of {LONG_NAMES[inputs.metric]}",
        "units": UNITS[inputs.metric],
        **_attrs(model, inputs, "edge_attribution", estimator=estimator, steps=points),
    }
    coords = graph.coords()
    if per_prompt:
        prompt_rows = range(len(inputs.prompts))
        coords |= {
            "prompt": np.arange(len(inputs.prompts)),
            "text": [inputs.prompts[i].text for i in prompt_rows],
            "category": [inputs.prompts[i].category for i in prompt_rows],
        }
        return schema.make(
            values, dims=("prompt", "sender", "receiver"), coords=coords, attrs=attrs
        )
    return schema.make(values.mean(0), dims=("sender", "receiver"), coords=coords, attrs=attrs)


# ------------------------------------------------------------------------------ circuits


def _edge_values(name: str, result: Any, *, made_by: str) -> np.ndarray:
    """(n_senders, n_receivers) values of the (sender, receiver) result passed as ``name``.

    Raises:
        TypeError: not a DataArray. ValueError: dims other than (sender, receiver).
    """
    _validate.result(name, result, kind=xr.DataArray, made_by=made_by, dims=("sender", "receiver"))
    if set(result.dims) != {"sender", "receiver"}:
        raise ValueError(
            f"{name} must be a (sender, receiver) DataArray from {made_by}, got dims "
            f"{result.dims}; average per-prompt scores first: scores.mean('prompt')."
        )
    return result.transpose("sender", "receiver").values


def _graph_of(result: xr.DataArray) -> Graph:
    """The graph a (sender, receiver) result was measured on, from its coords."""
    kinds = result["sender_kind"].values
    n_layers = int((kinds == "mlp").sum())
    receiver_kinds = result["receiver_kind"].values
    return Graph(
        n_layers,
        int((kinds == "head").sum()) // max(n_layers, 1),
        int((receiver_kinds == "k").sum()) // max(n_layers, 1),
    )


def _on_paths(graph: Graph, kept: np.ndarray) -> np.ndarray:
    """``kept`` (n_senders, n_receivers) bool pruned to edges on a path from the
    embeddings to the logits: the sender is reached from the embeddings and the receiver
    feeds a component that reaches the logits, through kept edges."""
    n_senders = len(graph.senders)
    feeds = graph.feeds
    reached = np.zeros(n_senders + 1, dtype=bool)
    reached[0] = True
    for component in range(1, n_senders + 1):  # senders in forward order, then the logits
        into = feeds[:, component]
        reached[component] = bool((kept[:, into] & reached[:n_senders, None]).any())
    live: np.ndarray = np.zeros(n_senders + 1, dtype=bool)
    live[-1] = True
    receiver_live = (feeds & live).any(1)
    for component in range(n_senders - 1, -1, -1):  # downstream receivers are settled
        live[component] = bool((kept[component] & receiver_live).any())
        receiver_live = (feeds & live).any(1)
    return kept & reached[:n_senders, None] & receiver_live[None, :]


def _budget(n_edges: int, edges: int | None, fraction: float | None) -> int:
    if (edges is None) == (fraction is None):
        raise ValueError(
            "Give exactly one edge budget: edges=N (a count) or fraction=f (a share of all "
            f"{n_edges} edges), e.g. circuit(scores, fraction=0.05)."
        )
    if edges is not None:
        return _validate.integer("edges", edges, low=1, high=n_edges)
    share = _validate.number("fraction", fraction, low=0.0, high=1.0)
    if share == 0:
        raise ValueError(f"fraction=0 keeps no edge; give a share in (0, 1] of {n_edges} edges.")
    return max(1, round(share * n_edges))


def circuit(
    scores: xr.DataArray, *, edges: int | None = None, fraction: float | None = None
) -> xr.DataArray:
    """The edges with the largest |score|, pruned to those on a path embeddings -> logits.

    Args:
        scores: (sender, receiver) scores from ``edge_attribution``.
        edges: how many top edges to take (1 .. the number of edges), or
        fraction: that as a share of all edges, in (0, 1].

    Returns:
        Boolean DataArray on the coords of ``scores`` (True: in the circuit); attrs add
        ``n_edges`` (kept after pruning), ``budget`` (taken before) and ``total_edges``.

    Raises:
        TypeError: scores that are not a DataArray.
        ValueError: no budget or both, a budget of 0 or above the edge count, scores with
            a ``prompt`` dim or not from ``edge_attribution``.
    """
    values = _edge_values("scores", scores, made_by="lsc.edge_attribution")
    graph = _graph_of(scores)
    valid = graph.valid & np.isfinite(values)
    budget = _budget(int(valid.sum()), edges, fraction)
    magnitude = np.where(valid, np.abs(values), -np.inf).ravel()
    top = np.argsort(-magnitude, kind="stable")[:budget]
    kept = np.zeros(values.size, dtype=bool)
    kept[top] = True
    kept = _on_paths(graph, kept.reshape(values.shape))
    attrs = {
        **scores.attrs,
        "long_name": "edge in the circuit",
        "units": "",
        "method": "circuit",
        "scored_by": str(scores.attrs.get("method", "")),
        "budget": budget,
        "n_edges": int(kept.sum()),
        "total_edges": int(valid.sum()),
    }
    return xr.DataArray(
        kept, dims=("sender", "receiver"), coords=scores.transpose("sender", "receiver").coords
    ).assign_attrs(attrs)


# ------------------------------------------------------------------ exact edge patching


def _check_circuit(model: LensModel, circuit: xr.DataArray) -> np.ndarray:
    """(n_senders, n_receivers) bool of a circuit that belongs to ``model``."""
    graph = Graph.of(model)
    values = _edge_values("circuit", circuit, made_by="lsc.circuit")
    if values.dtype != bool:
        raise ValueError(
            f"circuit must be boolean (from lsc.circuit), got dtype {values.dtype}; "
            "build one with lsc.circuit(scores, fraction=0.05)."
        )
    fingerprint = circuit.attrs.get("layout_fingerprint")
    if values.shape != graph.valid.shape or (
        fingerprint is not None and fingerprint != model.spec.fingerprint
    ):
        raise ValueError(
            f"The circuit was found on model {circuit.attrs.get('model')!r} "
            f"({values.shape[0]} senders x {values.shape[1]} receivers), not on "
            f"{model.name!r} ({graph.valid.shape[0]} x {graph.valid.shape[1]}); score and "
            "pick the circuit on this model."
        )
    return values & graph.valid


def _patched_metrics(
    inputs: Inputs, batch: Batch, patched: Sequence[np.ndarray], *, base: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Metric of ``base`` with each ``patched`` edge set reading the other run.

    Args:
        patched: (n_senders, n_receivers) float or bool weights, one per variant.
        base: "clean" or "corrupt": the run edited (the other one lends its senders).

    Returns:
        (variants, batch) patched metrics, (batch,) base metric, (batch,) other metric.
    """
    assert batch.corrupt is not None
    base_tokens, other_tokens = (
        (batch.clean, batch.corrupt) if base == "clean" else (batch.corrupt, batch.clean)
    )
    graph = Graph.of(inputs.model)
    other, other_logits = _senders(inputs, other_tokens)
    _, base_logits = _senders(inputs, base_tokens)
    values = []
    with torch.no_grad():
        for weights in patched:
            state = _Pass(
                graph,
                other=other,
                patched=torch.as_tensor(np.asarray(weights, dtype=np.float64), device=other.device),
            )
            logits = _run(inputs.model, inputs.backend, base_tokens, state, grad=False)
            values.append(_metric(inputs, logits, batch))
    return (
        torch.stack(values).cpu() if values else torch.zeros(0, len(batch.index)),
        _metric(inputs, base_logits, batch).cpu(),
        _metric(inputs, other_logits, batch).cpu(),
    )


def edge_patching(
    model: LensModel,
    prompts: Prompts,
    circuit: xr.DataArray,
    *,
    base: str = "clean",
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    padding_side: str = DEFAULTS.padding_side,
    progress: bool = DEFAULTS.progress,
) -> xr.DataArray:
    """Exact edge patching: the metric with every edge outside ``circuit`` patched.

    ``base="clean"``: the clean run, each edge outside the circuit reading its sender from
    the corrupt run (the circuit alone carries the clean answer). ``base="corrupt"``: the
    reverse. One forward pass per batch (after one unedited pass of each input): every
    receiver's input is rebuilt from the residual stream minus the patched senders'
    differences (module docstring).

    Args:
        circuit: boolean (sender, receiver) from ``lsc.circuit`` on this model.
        base: "clean" or "corrupt".
        Others as in ``edge_attribution``.

    Returns:
        DataArray (prompt,) of the patched metric; attrs ``n_edges`` and ``base``.

    Raises:
        TypeError: a circuit that is not a DataArray.
        ValueError: a circuit from another model or not boolean, an unknown ``base``.
    """
    _validate.choice("base", base, ("clean", "corrupt"))
    progress = _validate.flag("progress", progress)
    kept = _check_circuit(model, circuit)
    inputs = _prepare(
        model,
        prompts,
        metric=metric,
        backend=backend,
        batch_size=batch_size,
        padding_side=padding_side,
    )
    outside = Graph.of(model).valid & ~kept
    rows = [
        _patched_metrics(inputs, batch, [outside], base=base)[0][0]
        for batch in tqdm(
            inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="edge patching"
        )
    ]
    attrs = {
        "long_name": f"{LONG_NAMES[inputs.metric]} with the edges outside the circuit patched",
        "units": UNITS[inputs.metric],
        **_attrs(model, inputs, "edge_patching", base=base, n_edges=int(kept.sum())),
    }
    return schema.make(torch.cat(rows).double().numpy(), dims=("prompt",), attrs=attrs)


def _area(fractions: np.ndarray, curve: np.ndarray) -> float:
    """Trapezoid area under ``curve`` over ``fractions``, divided by their span."""
    span = fractions[-1] - fractions[0]
    if span == 0:
        return float(curve[0])
    widths = np.diff(fractions)
    return float((widths * (curve[1:] + curve[:-1]) / 2).sum() / span)


def _check_fractions(fractions: Any) -> list[float]:
    """Edge budgets as a list of increasing shares in (0, 1].

    Raises:
        TypeError: not a list (or array) of numbers. ValueError: out of (0, 1], repeated or
            not increasing, or none.
    """
    fix = f"e.g. {list(DEFAULT_FRACTIONS)}"
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, (Sequence, np.ndarray)):
        raise TypeError(
            f"fractions must be a list of shares in (0, 1], got {fractions!r} "
            f"({type(fractions).__name__}); {fix}."
        )
    shares = [
        _validate.number(f"fractions[{i}]", f, low=0.0, high=1.0) for i, f in enumerate(fractions)
    ]
    if not shares or min(shares) <= 0 or shares != sorted(set(shares)):
        raise ValueError(f"fractions must be increasing shares in (0, 1], got {shares}; {fix}.")
    return shares


def circuit_faithfulness(
    model: LensModel,
    prompts: Prompts,
    scores: xr.DataArray,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    n_random: int = 3,
    seed: int = 0,
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    padding_side: str = DEFAULTS.padding_side,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """Faithfulness of the circuits of ``scores`` over edge budgets, beside random ones.

    For each budget, ``circuit(scores, fraction=f)`` is run by exact edge patching (the
    clean run, edges outside the circuit reading the corrupt run) and so are ``n_random``
    random sets of valid edges of the same size (after pruning). Faithfulness
    f(C) = (m(C) - m(empty)) / (m(full) - m(empty)) with m the prompt-mean metric, m(full)
    the clean run and m(empty) the corrupt run (every edge patched).

    Args:
        scores: (sender, receiver) from ``edge_attribution``.
        fractions: edge budgets as shares of all edges, increasing, in (0, 1].
        n_random: random circuits per budget.
        seed: seeds the random circuits.
        Others as in ``edge_attribution``.

    Returns:
        Dataset over ``budget`` (the fractions; coords ``n_edges``, kept after pruning):
        ``faithfulness`` (budget), ``random_faithfulness`` (seed, budget), and scalars
        ``cpr`` / ``random_cpr`` (area under the curve over the budget span, divided by
        the span: higher is better) and ``cmd`` / ``random_cmd`` (area of |1 - f|, the same
        way: lower is better), ``m_full`` and ``m_empty``.

    Raises:
        TypeError: fractions that are not a list of numbers, scores that are not a
            DataArray, a seed that is not an integer.
        ValueError: budgets not increasing in (0, 1], scores from another model, a
            negative seed or ``n_random``.
    """
    fractions = _check_fractions(fractions)
    n_random = _validate.integer("n_random", n_random, low=0)
    seed = _validate.integer("seed", seed, low=0)
    progress = _validate.flag("progress", progress)
    graph = Graph.of(model)
    if _edge_values("scores", scores, made_by="lsc.edge_attribution").shape != graph.valid.shape:
        raise ValueError(
            f"scores were measured on {scores.attrs.get('model')!r}, not on {model.name!r}; "
            "score this model with lsc.edge_attribution first."
        )
    circuits = [circuit(scores, fraction=f) for f in fractions]
    sizes = [int(c.attrs["n_edges"]) for c in circuits]
    variants = [graph.valid & ~c.values for c in circuits]
    variants += _outside_random_circuits(graph, sizes, n_random, seed)
    inputs = _prepare(
        model,
        prompts,
        metric=metric,
        backend=backend,
        batch_size=batch_size,
        padding_side=padding_side,
    )
    m_patched, m_full, m_empty = _prompt_means(inputs, variants, progress=progress)
    curves = ((m_patched - m_empty) / (m_full - m_empty)).numpy()
    curve = curves[: len(fractions)]
    random = curves[len(fractions) :].reshape(n_random, len(fractions))
    x = np.asarray(fractions)
    random_cpr = [_area(x, row) for row in random]
    random_cmd = [_area(x, np.abs(1 - row)) for row in random]
    attrs = {
        "long_name": "circuit faithfulness (m(C) - m(empty)) / (m(full) - m(empty))",
        "units": "",
        **_attrs(
            model,
            inputs,
            "circuit_faithfulness",
            scored_by=str(scores.attrs.get("estimator", "")),
            n_random=n_random,
            seed=seed,
        ),
    }
    return xr.Dataset(
        {
            "faithfulness": (("budget",), curve),
            "random_faithfulness": (("seed", "budget"), random),
            "cpr": _area(x, curve),
            "cmd": _area(x, np.abs(1 - curve)),
            "random_cpr": float(np.mean(random_cpr)) if n_random else float("nan"),
            "random_cmd": float(np.mean(random_cmd)) if n_random else float("nan"),
            "m_full": m_full,
            "m_empty": m_empty,
        },
        coords={"budget": x, "n_edges": ("budget", np.asarray(sizes)), "seed": np.arange(n_random)},
        attrs=attrs,
    )


def _outside_random_circuits(
    graph: Graph, sizes: list[int], n_random: int, seed: int
) -> list[np.ndarray]:
    """The edges outside ``n_random`` random circuits of each size in ``sizes`` (valid edges
    drawn from ``seed``, draw by draw), each (n_senders, n_receivers) bool."""
    rng = np.random.default_rng(seed)
    valid_edges = np.flatnonzero(graph.valid)
    outside = []
    for _ in range(n_random):
        for size in sizes:
            kept = np.zeros(graph.valid.size, dtype=bool)
            kept[rng.choice(valid_edges, size=size, replace=False)] = True
            outside.append(graph.valid & ~kept.reshape(graph.valid.shape))
    return outside


def _prompt_means(
    inputs: Inputs, variants: list[np.ndarray], *, progress: bool
) -> tuple[torch.Tensor, float, float]:
    """Prompt-mean metrics: (variants,) of the clean run with each variant's edges reading
    the corrupt run, then of the clean run alone (m(full)) and the corrupt run (m(empty))."""
    patched_sum = torch.zeros(len(variants), dtype=torch.float64)
    full_sum = empty_sum = 0.0
    for batch in tqdm(
        inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="faithfulness"
    ):
        patched, full, empty = _patched_metrics(inputs, batch, variants, base="clean")
        patched_sum += patched.double().sum(1)
        full_sum += float(full.double().sum())
        empty_sum += float(empty.double().sum())
    n = len(inputs.prompts)
    return patched_sum / n, full_sum / n, empty_sum / n


# -------------------------------------------------------------------------------- trust


def edge_agreement(
    model: LensModel,
    prompts: Prompts,
    *,
    estimators: Sequence[str] = ESTIMATORS,
    steps: int = DEFAULT_IG_STEPS,
    n_top: int = 20,
    n_random: int = 20,
    top_k: int = 5,
    seed: int = 0,
    metric: str = DEFAULTS.metric,
    batch_size: int | None = DEFAULTS.batch_size,
    backend: str = DEFAULTS.backend,
    padding_side: str = DEFAULTS.padding_side,
    progress: bool = DEFAULTS.progress,
) -> xr.Dataset:
    """How far to trust edge scores: each estimator vs exact single-edge patching.

    The sample: each estimator's ``n_top`` edges by |prompt-mean score| and ``n_random``
    valid edges drawn at random. Each is patched alone, exactly (the corrupt run with that
    one receiver reading its sender from the clean run; effect = m(patched) - m(corrupt),
    the quantity EAP estimates), and compared per receiver kind with the statistics of
    ``lsc.faithfulness`` (``capture.faithfulness.agreement``).

    Args:
        estimators: "eap" and/or "eap-ig" (with ``steps`` points).
        n_top, n_random: edges sampled from the top of each estimator and at random.
        top_k: size of the top sets compared per receiver kind (NaN where a kind has
            ``top_k`` sampled edges or fewer).
        seed: seeds the random sample.
        Others as in ``edge_attribution``.

    Returns:
        Dataset with (estimator, receiver_kind) ``pearson_cells``, ``spearman_cells``,
        ``pearson_means``, ``spearman_means``, ``top_overlap``, ``sign_agreement``;
        (receiver_kind,) ``n_edges`` sampled; and the maps compared: ``exact``
        (prompt, edge) and ``estimate`` (estimator, prompt, edge), with ``sender`` and
        ``receiver`` coords on ``edge``.

    Raises:
        TypeError: estimators that are not a list of strings, counts or a seed that are
            not integers.
        ValueError: an unknown or repeated estimator, ``steps`` or ``top_k`` below 1, a
            negative count or seed, ``n_top=0`` with ``n_random=0`` (no edge sampled).
    """
    estimators = _validate.strings("estimators", estimators, example="('eap', 'eap-ig')")
    for name in estimators:
        _validate.choice("estimators", name, ESTIMATORS)
    if len(set(estimators)) < len(estimators):
        raise ValueError(f"estimators names one twice: {estimators}; name each once.")
    steps = _validate.positive_int("steps", steps)
    n_top = _validate.integer("n_top", n_top, low=0)
    n_random = _validate.integer("n_random", n_random, low=0)
    if n_top == 0 and n_random == 0:
        raise ValueError("n_top=0 and n_random=0 sample no edge; sample at least one.")
    top_k = _validate.positive_int("top_k", top_k)
    seed = _validate.integer("seed", seed, low=0)
    options: dict[str, Any] = dict(
        metric=metric,
        batch_size=batch_size,
        backend=backend,
        padding_side=padding_side,
        progress=progress,
    )
    scores = {
        name: edge_attribution(
            model,
            prompts,
            estimator=name,
            steps=steps if name == "eap-ig" else 1,
            per_prompt=True,
            **options,
        )
        for name in estimators
    }
    graph = Graph.of(model)
    senders, receivers = _sample_edges(graph, list(scores.values()), n_top, n_random, seed)
    inputs = _prepare(
        model,
        prompts,
        metric=metric,
        backend=backend,
        batch_size=batch_size,
        padding_side=padding_side,
    )
    effects = _single_edge_effects(inputs, graph, senders, receivers, progress=progress)
    exact, estimate = _compared_maps(graph, senders, receivers, effects, scores)
    kinds = [kind for kind in RECEIVER_KINDS if (exact["receiver_kind"] == kind).any()]
    return xr.Dataset(
        {
            **_agreement_by_kind(exact, estimate, kinds, top_k=top_k),
            "n_edges": (
                ("receiver_kind",),
                [int((exact["receiver_kind"] == kind).sum()) for kind in kinds],
            ),
            "exact": exact,
            "estimate": estimate,
        },
        coords={"estimator": list(estimators), "receiver_kind": kinds},
        attrs=_attrs(model, inputs, "edge_agreement", steps=steps, top_k=top_k, seed=seed),
    )


def _sample_edges(
    graph: Graph, scores: list[xr.DataArray], n_top: int, n_random: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The edges ``edge_agreement`` patches: the ``n_top`` of each of ``scores`` (prompt,
    sender, receiver) by |prompt-mean score| and ``n_random`` valid edges drawn from
    ``seed``, each once, in the graph's order.

    Returns:
        (edges,) sender indices and (edges,) receiver indices.
    """
    valid = np.flatnonzero(graph.valid)
    chosen: set[int] = set()
    for result in scores:
        magnitude = np.abs(np.nan_to_num(result.mean("prompt").values)).ravel()
        chosen |= set(np.argsort(-magnitude[valid], kind="stable")[:n_top].tolist())
    rng = np.random.default_rng(seed)
    chosen |= set(rng.choice(len(valid), size=min(n_random, len(valid)), replace=False).tolist())
    senders, receivers = np.unravel_index(valid[sorted(chosen)], graph.valid.shape)
    return senders, receivers


def _single_edge_effects(
    inputs: Inputs,
    graph: Graph,
    senders: np.ndarray,
    receivers: np.ndarray,
    *,
    progress: bool,
) -> np.ndarray:
    """(prompt, edge) effect of patching each edge alone, exactly: the corrupt run with that
    receiver reading its sender from the clean run, m(patched) - m(corrupt)."""
    one_hot = []
    for s, r in zip(senders, receivers, strict=True):
        weights = np.zeros(graph.valid.shape)
        weights[s, r] = 1.0
        one_hot.append(weights)
    effects = []
    for batch in tqdm(
        inputs.batches(), total=inputs.n_batches(), disable=not progress, desc="edge patching"
    ):
        patched, corrupt, _ = _patched_metrics(inputs, batch, one_hot, base="corrupt")
        effects.append((patched - corrupt).T)
    return torch.cat(effects).double().numpy()


def _compared_maps(
    graph: Graph,
    senders: np.ndarray,
    receivers: np.ndarray,
    effects: np.ndarray,
    scores: dict[str, xr.DataArray],
) -> tuple[xr.DataArray, xr.DataArray]:
    """The sampled edges' exact ``effects`` (prompt, edge) and each estimator's ``scores``
    of them (estimator, prompt, edge), with ``sender``, ``receiver`` and ``receiver_kind``
    coords on ``edge``."""
    edge_coords = {
        "sender": ("edge", np.asarray(graph.sender_labels())[senders]),
        "receiver": ("edge", np.asarray(graph.receiver_labels())[receivers]),
        "receiver_kind": ("edge", np.asarray([graph.receivers[r][0] for r in receivers])),
    }
    exact = xr.DataArray(effects, dims=("prompt", "edge"), coords=edge_coords)
    estimate = xr.concat(
        [
            xr.DataArray(result.values[:, senders, receivers], dims=("prompt", "edge"))
            for result in scores.values()
        ],
        dim="estimator",
    ).assign_coords({**edge_coords, "estimator": list(scores)})
    return exact, estimate


def _agreement_by_kind(
    exact: xr.DataArray, estimate: xr.DataArray, kinds: list[str], *, top_k: int
) -> dict[str, tuple[tuple[str, str], np.ndarray]]:
    """``agreement`` of each estimator with the exact effects, per receiver kind.

    Args:
        exact: (prompt, edge); estimate: (estimator, prompt, edge); both with a
            ``receiver_kind`` coord on ``edge``.

    Returns:
        Per statistic, an (estimator, receiver_kind) variable.
    """
    stats: dict[str, list[list[float]]] = {}
    for name in estimate["estimator"].values:
        rows: dict[str, list[float]] = {}
        for kind in kinds:
            where = exact["receiver_kind"] == kind
            pair = agreement(
                exact.where(where, drop=True),
                estimate.sel(estimator=name, drop=True).where(where, drop=True),
                top_k=top_k,
            )
            for stat, value in pair.items():
                rows.setdefault(stat, []).append(value)
        for stat, values in rows.items():
            stats.setdefault(stat, []).append(values)
    return {
        stat: (("estimator", "receiver_kind"), np.asarray(values)) for stat, values in stats.items()
    }
