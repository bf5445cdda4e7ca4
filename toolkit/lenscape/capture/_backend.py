"""The seam between capture methods and the hooking libraries (nnsight, TransformerLens).

Capture methods speak in *sites*: ``("resid_pre", layer)`` is the residual stream entering
block ``layer``, (batch, pos, d_model); ``("z", layer)`` is the per-head output before the
output projection, (batch, pos, n_heads, d_head); ``("attn", layer)`` and ``("mlp", layer)``
are the blocks' contributions to the residual stream, (batch, pos, d_model);
``("resid_final", -1)`` is the residual stream entering the final norm, (batch, pos, d_model);
``("pattern", layer)`` is the attention pattern, (batch, n_heads, query_pos, key_pos) over
query heads (the HF model must run with ``attn_implementation="eager"`` for nnsight).

A backend runs one forward pass over a ``TokenBatch`` and, at each requested site in
forward order, optionally replaces the activation (``edit``) and keeps it (returned in
``RunResult.acts``). With ``grad=True`` the pass builds an autograd graph from the
embeddings on (weights stay frozen), so callers take ``torch.autograd.grad`` of any
metric with respect to the kept activations. With ``resume=(layer, resid)`` the pass
starts at block ``layer`` from a residual stream kept by an earlier pass over the same
tokens: blocks ``0..layer-1`` are not run at all (exact sweeps re-run only the suffix of
the model after the component they edit). Everything else (metrics, sweeps, attribution)
lives above this seam and is backend-agnostic.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..models import LensModel

Site = tuple[str, int]
#: ``edit(site, activation) -> activation``; called once per requested site per pass.
EditFn = Callable[[Site, torch.Tensor], torch.Tensor]
#: ``(layer, resid)``: start the pass at block ``layer`` (>= 1) with ``resid`` (batch, pos,
#: d_model) as the residual stream entering it; earlier blocks are skipped.
Resume = tuple[int, torch.Tensor]

SITE_KINDS = ("resid_pre", "z", "pattern", "attn", "mlp", "resid_final")
BACKENDS = ("nnsight", "transformer_lens")


@dataclass
class TokenBatch:
    """Padded token ids for one forward pass.

    Attributes:
        input_ids, attention_mask, position_ids: (batch, pos); positions count real tokens
            only, so left and right padding give the same numbers.
        read_pos: (batch,) index of the last real token, where metrics read the logits.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    read_pos: torch.Tensor

    def repeat(self, copies: int) -> TokenBatch:
        """Stack ``copies`` copies along batch: rows ``[c * B:(c + 1) * B]`` are copy ``c``."""
        return TokenBatch(
            *(
                t.repeat(copies, *([1] * (t.dim() - 1)))
                for t in (self.input_ids, self.attention_mask, self.position_ids, self.read_pos)
            )
        )

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(
            *(
                t.to(device)
                for t in (self.input_ids, self.attention_mask, self.position_ids, self.read_pos)
            )
        )


@dataclass
class RunResult:
    """What one pass returns.

    Attributes:
        logits: (batch, vocab) logits at ``read_pos``.
        acts: site -> activation as seen by the model after any edit (canonical shape).
    """

    logits: torch.Tensor
    acts: dict[Site, torch.Tensor] = field(default_factory=dict)


def site_order(site: Site) -> tuple[int, int]:
    """Forward-order sort key for sites."""
    kind, layer = site
    return (10**9, 0) if kind == "resid_final" else (layer, SITE_KINDS.index(kind))


def _model_kwargs(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """Forward kwargs; ``logits_to_keep`` unembeds only the read positions (saves the
    (batch, pos, vocab) projection, most of the compute for big-vocabulary models)."""
    return {
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "logits_to_keep": batch.read_pos[:, None],
    }


class NNsightBackend:
    """Runs passes through ``nnsight.NNsight`` wrapping the HF module itself."""

    name = "nnsight"

    def __init__(self, model: LensModel):
        import nnsight

        self.model = model
        self.envoy = nnsight.NNsight(model.hf)

    def _envoy(self, path: str):
        envoy = self.envoy
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def _site_envoy(self, site: Site):
        kind, layer = site
        layout = self.model.spec.layout
        if kind == "resid_final":
            return self._envoy(layout.final_norm)
        if kind == "resid_pre":
            return self._envoy(f"{layout.layers}.{layer}")
        path = {
            "z": layout.o_proj,
            "attn": layout.attn_out,
            "mlp": layout.mlp_out,
            "pattern": layout.o_proj.rsplit(".", 1)[0],
        }[kind]
        return self._envoy(f"{layout.layers}.{layer}.{path}")

    def run(
        self,
        batch: TokenBatch,
        *,
        sites: Sequence[Site] = (),
        edit: EditFn | None = None,
        grad: bool = False,
        resume: Resume | None = None,
    ) -> RunResult:
        spec, layout = self.model.spec, self.model.spec.layout
        acts: dict[Site, torch.Tensor] = {}
        with (
            torch.set_grad_enabled(grad),
            self.envoy.trace(batch.input_ids, **_model_kwargs(batch)),
        ):
            if grad:
                embed = self._envoy(layout.embed)
                embed.output = embed.output.detach().requires_grad_(True)
            if resume is not None:
                # Decoder blocks return the residual stream (transformers 5), so skipping
                # blocks 0..layer-1 with output ``resid`` makes ``resid`` enter block ``layer``.
                start, resid = resume
                for layer in range(start):
                    self._envoy(f"{layout.layers}.{layer}").skip(resid)
            for site in sorted(sites, key=site_order):
                kind, _ = site
                envoy = self._site_envoy(site)
                if kind in ("resid_pre", "z", "resid_final"):
                    value = envoy.input
                    shape = value.shape
                    if kind == "z":
                        value = value.view(*shape[:2], spec.n_heads, spec.d_head)
                    if edit is not None:
                        value = edit(site, value)
                    # Feed the (viewed) tensor back so gradients w.r.t. it exist.
                    envoy.input = value.reshape(shape)
                elif kind == "attn" and layout.attn_out_tuple:
                    output = envoy.output
                    value = output[0]
                    if edit is not None:
                        value = edit(site, value)
                        envoy.output = (value, *output[1:])
                elif kind == "pattern":  # attention modules return (output, weights)
                    output = envoy.output
                    value = output[1]
                    if edit is not None:
                        value = edit(site, value)
                        envoy.output = (output[0], value, *output[2:])
                else:
                    value = envoy.output
                    if edit is not None:
                        value = edit(site, value)
                        envoy.output = value
                acts[site] = value.save()
            logits = self.envoy.output.logits[:, 0].save()
        return RunResult(logits, acts)


class TransformerLensBackend:
    """Runs passes through a TransformerLens 4 ``TransformerBridge`` with hook points.

    The bridge rewires the HF module it boots from, so it boots from a deep copy and the
    HF model used by other backends stays untouched (one extra copy of the weights).
    """

    name = "transformer_lens"

    def __init__(self, model: LensModel):
        from transformer_lens.model_bridge import TransformerBridge

        self.model = model
        self.bridge = TransformerBridge.boot_transformers(
            model.name,
            hf_model=copy.deepcopy(model.hf),
            tokenizer=model.tokenizer,
            device=str(model.device),
        )
        self.bridge.requires_grad_(False)

    @staticmethod
    def hook_name(site: Site) -> str:
        kind, layer = site
        return {
            "resid_pre": f"blocks.{layer}.hook_in",
            "z": f"blocks.{layer}.attn.hook_z",
            "attn": f"blocks.{layer}.hook_attn_out",
            "mlp": f"blocks.{layer}.hook_mlp_out",
            "pattern": f"blocks.{layer}.attn.hook_pattern",
            "resid_final": "ln_final.hook_in",
        }[kind]

    def run(
        self,
        batch: TokenBatch,
        *,
        sites: Sequence[Site] = (),
        edit: EditFn | None = None,
        grad: bool = False,
        resume: Resume | None = None,
    ) -> RunResult:
        acts: dict[Site, torch.Tensor] = {}

        def make_hook(site: Site):
            def hook(value: torch.Tensor, hook=None) -> torch.Tensor:
                if edit is not None:
                    value = edit(site, value)
                acts[site] = value
                return value

            return hook

        hooks = [(self.hook_name(site), make_hook(site)) for site in sites]
        if grad:
            hooks.insert(
                0, ("hook_embed", lambda value, hook=None: value.detach().requires_grad_(True))
            )
        with (
            torch.set_grad_enabled(grad),
            self.bridge.hooks(fwd_hooks=hooks),
            _skipping(self.bridge.blocks, resume),
        ):
            logits = self.bridge(batch.input_ids, **_model_kwargs(batch))
        return RunResult(logits[:, 0], acts)


@contextlib.contextmanager
def _skipping(blocks: Sequence[torch.nn.Module], resume: Resume | None):
    """Within the block, blocks ``0..layer-1`` return ``resid`` without running.

    TransformerLens 4.3's own ``forward(start_at_layer=)`` still runs the earlier blocks and
    discards their output, so it saves no time; shadowing ``forward`` on the instances does.
    It goes through ``__dict__`` because bridge components forward ``setattr`` to the
    wrapped HF module.
    """
    if resume is None:
        yield
        return
    start, resid = resume
    skipped = list(blocks)[:start]
    for block in skipped:
        block.__dict__["forward"] = lambda *args, **kwargs: resid
    try:
        yield
    finally:
        for block in skipped:
            del block.__dict__["forward"]


def get_backend(model: LensModel, name: str):
    """The (cached) backend ``name`` for ``model``."""
    if name not in BACKENDS:
        raise ValueError(f"Unknown backend '{name}'; choose one of {list(BACKENDS)}.")
    if name not in model.backends:
        cls = NNsightBackend if name == "nnsight" else TransformerLensBackend
        model.backends[name] = cls(model)
    return model.backends[name]
