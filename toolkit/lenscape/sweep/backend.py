"""The seam between capture methods and the hooking libraries (nnsight, TransformerLens).

Capture methods speak in *sites*: ``("resid_pre", layer)`` is the residual stream entering
block ``layer``, (batch, pos, d_model); ``("z", layer)`` is the per-head output before the
output projection, (batch, pos, n_heads, d_head); ``("attn", layer)`` and ``("mlp", layer)``
are the blocks' contributions to the residual stream, (batch, pos, d_model);
``("resid_final", -1)`` is the residual stream entering the final norm, (batch, pos, d_model);
``("q", layer)``, ``("k", layer)`` and ``("v", layer)`` are the query, key and value
projections' outputs per head, (batch, pos, heads, d_head), keys and values per key/value
head (families with separate projections only);
``("pattern", layer)`` is the attention pattern, (batch, n_heads, query_pos, key_pos) over
query heads (the HF model must run with ``attn_implementation="eager"`` for nnsight).

A backend runs one forward pass over a ``TokenBatch`` and, at each requested site in
forward order, optionally replaces the activation (``edit``) and keeps it (returned in
``RunResult.acts``). With ``grad=True`` the pass builds an autograd graph from the
embeddings on (weights stay frozen), so callers take ``torch.autograd.grad`` of any
metric with respect to the kept activations. With ``resume=(layer, resid)`` the pass
starts at block ``layer`` from a residual stream kept by an earlier pass over the same
tokens: blocks ``0..layer-1`` are not run at all (exact sweeps re-run only the suffix of
the model after the component they edit). A backend with ``runs_suffix`` also takes
``past=(cut, cache)``: the pass runs only the tokens from column ``cut`` on, reading the
earlier columns' keys and values from ``cache`` (``prefix_cache``, from a pass over the same
tokens kept with ``keep_cache=True``); an edit that changes no column before ``cut`` gives
the same logits (exact sweeps by position skip the unchanged prefix). Everything else
(metrics, sweeps, attribution) lives above this seam and is backend-agnostic.

The seam owns three things: the ``Backend`` protocol (what a backend must do), the table
``BACKEND_CLASSES`` (name -> class) with ``get_backend``'s per-model cache, and *standing
edits* (``standing_edit``): an edit that every forward pass of a model applies while it is
active -- direct ``model.hf(...)`` calls and generation, nnsight passes (module hooks on
``model.hf``, the module nnsight traces) and TransformerLens passes (hook points on the
bridge, which runs its own copy of the weights). Block masks and head gates are standing
edits, so a capture inside ``lsc.apply_mask`` sees the masked model on either backend.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..models import LensModel, ModelSpec
from ..models.layouts import ArchLayout

Site = tuple[str, int]
#: ``edit(site, activation) -> activation``; called once per requested site per pass.
EditFn = Callable[[Site, torch.Tensor], torch.Tensor]
#: ``before(input_ids, attention_mask)``: called with a pass's tokens (batch, pos) first.
BeforeFn = Callable[[torch.Tensor, torch.Tensor | None], None]
#: ``(layer, resid)``: start the pass at block ``layer`` (>= 1) with ``resid`` (batch, pos,
#: d_model) as the residual stream entering it; earlier blocks are skipped.
Resume = tuple[int, torch.Tensor]
#: ``(cut, cache)``: run only columns ``cut..`` of the batch; ``cache`` (a transformers
#: ``Cache``) holds every layer's keys and values of columns ``0..cut-1``.
Past = tuple[int, Any]

SITE_KINDS = ("resid_pre", "q", "k", "v", "z", "pattern", "attn", "mlp", "resid_final")
#: Sites held per head, (batch, pos, heads, d_head): the query, key and value projections'
#: outputs (keys and values per key/value head) and the per-head outputs.
HEAD_SITES = ("q", "k", "v", "z")


def heads_of(spec: ModelSpec, kind: str) -> int:
    """How many heads a per-head site holds: key/value heads for "k" and "v"."""
    return spec.n_kv_heads if kind in ("k", "v") else spec.n_heads


def head_view(spec: ModelSpec, site: Site, value: torch.Tensor) -> torch.Tensor:
    """A per-head site's flat (batch, pos, heads * d_head) value as (batch, pos, heads,
    d_head); any other site's as it is."""
    if site[0] not in HEAD_SITES:
        return value
    return value.view(*value.shape[:2], heads_of(spec, site[0]), spec.d_head)


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

    def select(self, rows: torch.Tensor) -> TokenBatch:
        """The rows ``rows`` (a 1-D index tensor, repeats allowed), in that order."""
        return TokenBatch(
            *(
                t[rows]
                for t in (self.input_ids, self.attention_mask, self.position_ids, self.read_pos)
            )
        )

    def stacked(self, other: TokenBatch) -> TokenBatch:
        """These rows, then ``other``'s (of the same width)."""
        return TokenBatch(
            *(
                torch.cat([mine, theirs])
                for mine, theirs in zip(
                    (self.input_ids, self.attention_mask, self.position_ids, self.read_pos),
                    (other.input_ids, other.attention_mask, other.position_ids, other.read_pos),
                    strict=True,
                )
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
        logits: (batch, vocab) logits at ``read_pos`` ((batch, k) with ``vocab=``).
        acts: site -> activation as seen by the model after any edit (canonical shape).
        cache: the pass's keys and values of every layer (a transformers ``Cache``), with
            ``keep_cache=True``; else None.
    """

    logits: torch.Tensor
    acts: dict[Site, torch.Tensor] = field(default_factory=dict)
    cache: Any = None


def site_order(site: Site) -> tuple[int, int]:
    """Forward-order sort key for sites."""
    kind, layer = site
    return (10**9, 0) if kind == "resid_final" else (layer, SITE_KINDS.index(kind))


@dataclass(frozen=True)
class SiteModule:
    """Where a site lives in the HF module tree: the ``input`` (first argument) or the
    ``output`` of the module at ``path``, item ``item`` of it when that is a tuple."""

    path: str
    port: Literal["input", "output"]
    item: int | None = None


def site_module(layout: ArchLayout, site: Site) -> SiteModule:
    """The module (relative to the HF model) whose input or output is ``site``."""
    kind, layer = site
    block = f"{layout.layers}.{layer}"
    if kind == "resid_final":
        return SiteModule(layout.final_norm, "input")
    if kind == "resid_pre":
        return SiteModule(block, "input")
    if kind == "z":
        return SiteModule(f"{block}.{layout.o_proj}", "input")
    if kind in ("q", "k", "v"):
        if len(layout.qkv) != 3:
            raise ValueError(
                f"This family fuses its query, key and value projections ({layout.qkv[0]}): "
                f"it has no separate {kind!r} output to read or patch; use part='out'."
            )
        return SiteModule(f"{block}.{layout.qkv['qkv'.index(kind)]}", "output")
    if kind == "attn":
        return SiteModule(
            f"{block}.{layout.attn_out}", "output", 0 if layout.attn_out_tuple else None
        )
    if kind == "mlp":
        return SiteModule(f"{block}.{layout.mlp_out}", "output")
    if kind == "pattern":  # attention modules return (output, weights)
        return SiteModule(f"{block}.{layout.o_proj.rsplit('.', 1)[0]}", "output", 1)
    raise ValueError(f"Unknown site kind {kind!r}; sites are {list(SITE_KINDS)}.")


class Backend(Protocol):
    """What a backend does: one forward pass over a ``TokenBatch``, editing and keeping the
    activations at ``sites`` (in forward order), with standing edits applied first."""

    name: ClassVar[str]
    #: Whether ``run`` takes ``keep_cache`` and ``past`` (a suffix of the columns).
    runs_suffix: ClassVar[bool]

    def run(
        self,
        batch: TokenBatch,
        *,
        sites: Sequence[Site] = (),
        edit: EditFn | None = None,
        grad: bool = False,
        resume: Resume | None = None,
        vocab: torch.Tensor | None = None,
        keep_cache: bool = False,
        past: Past | None = None,
    ) -> RunResult:
        """Returns the logits at ``batch.read_pos`` and the kept activations.

        Args:
            sites: where to edit and keep activations.
            edit: ``edit(site, activation) -> activation``, once per site.
            grad: build an autograd graph from the embeddings on (weights stay frozen).
            resume: ``(layer, resid)``: start at block ``layer`` from ``resid``.
            vocab: (batch, k) token ids: the logits of these only, (batch, k); the
                unembedding's full (d_model, vocab) product is skipped, most of a short
                pass's cost for a big vocabulary (Gemma's 262k tokens).
            keep_cache: return the pass's keys and values (``RunResult.cache``).
            past: ``(cut, cache)``: run columns ``cut..`` only (``batch`` and ``resume``
                are full width; edits see ``cut..`` only).
        """
        ...


def _model_kwargs(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """Forward kwargs; ``logits_to_keep`` unembeds only the read positions (saves the
    (batch, pos, vocab) projection, most of the compute for big-vocabulary models)."""
    return {
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "logits_to_keep": batch.read_pos[:, None],
    }


def _suffix_kwargs(batch: TokenBatch, past: Past) -> dict[str, Any]:
    """Forward kwargs of a pass over columns ``cut..`` of ``batch`` after ``cache``: the
    attention mask stays full width (it covers the cached columns too)."""
    cut, cache = past
    return {
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids[:, cut:],
        "logits_to_keep": batch.read_pos[:, None] - cut,
        "past_key_values": cache,
        "use_cache": True,
    }


def prefix_cache(config: Any, cache: Any, rows: torch.Tensor, cut: int, width: int) -> Any | None:
    """A new ``DynamicCache`` holding the keys and values of columns ``0..cut-1`` of the
    batch rows ``rows`` of ``cache`` (a pass's ``RunResult.cache`` over ``width`` columns),
    for ``past=``; None when a layer of ``cache`` does not hold every column (a sliding
    window shorter than the batch), where a suffix pass would not see what the full pass
    saw."""
    from transformers import DynamicCache

    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        return None
    if any(layer.keys.shape[-2] != width for layer in layers):
        return None
    prefix = DynamicCache(config=config)
    for index, layer in enumerate(layers):
        prefix.update(layer.keys[rows, :, :cut], layer.values[rows, :, :cut], index)
    return prefix


class NNsightBackend:
    """Runs passes through ``nnsight.NNsight`` wrapping the HF module itself (standing
    edits are module hooks on that module, so they apply inside the trace)."""

    name: ClassVar[str] = "nnsight"
    runs_suffix: ClassVar[bool] = True

    def __init__(self, model: LensModel, standing: list[_Standing]):
        import nnsight  # imported on first use: importing it takes seconds

        self.spec = model.spec
        self.envoy = nnsight.NNsight(model.hf)
        unembed = model.hf.get_submodule(model.spec.layout.unembed)
        self.unembed = unembed if isinstance(unembed, torch.nn.Linear) else None

    def _envoy(self, path: str):
        envoy = self.envoy
        for part in path.split("."):
            envoy = envoy[int(part)] if part.isdigit() else getattr(envoy, part)
        return envoy

    def run(
        self,
        batch: TokenBatch,
        *,
        sites: Sequence[Site] = (),
        edit: EditFn | None = None,
        grad: bool = False,
        resume: Resume | None = None,
        vocab: torch.Tensor | None = None,
        keep_cache: bool = False,
        past: Past | None = None,
    ) -> RunResult:
        layout = self.spec.layout
        acts: dict[Site, torch.Tensor] = {}
        cut = 0 if past is None else past[0]
        kwargs: dict[str, Any] = (
            _model_kwargs(batch) if past is None else _suffix_kwargs(batch, past)
        )
        if keep_cache:
            kwargs["use_cache"] = True
        cache = None  # a trace passes back only what it saves
        with (
            torch.set_grad_enabled(grad),
            self.envoy.trace(batch.input_ids[:, cut:], **kwargs),
        ):
            if grad:
                embed = self._envoy(layout.embed)
                embed.output = embed.output.detach().requires_grad_(True)
            if resume is not None:
                # Decoder blocks return the residual stream (transformers 5), so skipping
                # blocks 0..layer-1 with output ``resid`` makes ``resid`` enter block ``layer``.
                start, resid = resume
                for layer in range(start):
                    self._envoy(f"{layout.layers}.{layer}").skip(resid[:, cut:])
            for site in sorted(sites, key=site_order):
                acts[site] = self._edited(site, edit).save()  # type: ignore[attr-defined]
            if vocab is not None and self.unembed is not None:
                self._unembed_only(vocab)
            logits = self.envoy.output.logits[:, 0].save()
            if keep_cache:
                cache = self.envoy.output.past_key_values.save()
        if vocab is not None and self.unembed is None:
            logits = logits.gather(1, vocab)
        return RunResult(logits, acts, cache)

    def _edited(self, site: Site, edit: EditFn | None) -> torch.Tensor:
        """Inside a trace: ``site``'s value (canonical shape), replaced by ``edit``'s."""
        spec = self.spec
        where = site_module(spec.layout, site)
        envoy = self._envoy(where.path)
        if where.item is not None:
            output = envoy.output
            value = output[where.item]
            if edit is not None:
                value = edit(site, value)
                envoy.output = (*output[: where.item], value, *output[where.item + 1 :])
        elif where.port == "input" or site[0] in HEAD_SITES:
            # A module's input, or a projection's output viewed per head: fed back (viewed
            # and reshaped) even unedited, so gradients w.r.t. the view exist.
            value = getattr(envoy, where.port)
            shape = value.shape
            value = head_view(spec, site, value)
            if edit is not None:
                value = edit(site, value)
            setattr(envoy, where.port, value.reshape(shape))
        else:
            value = envoy.output
            if edit is not None:
                value = edit(site, value)
                envoy.output = value
        return value

    def _unembed_only(self, vocab: torch.Tensor) -> None:
        """Inside a trace: the unembedding returns the logits of ``vocab`` (batch, k) only,
        (batch, 1, k); what the model does after it (Gemma 2's soft-capping) is elementwise."""
        assert self.unembed is not None
        envoy = self._envoy(self.spec.layout.unembed)
        hidden = envoy.input  # (batch, 1, d_model): logits_to_keep kept the read positions
        logits = torch.einsum("bpd,bkd->bpk", hidden, self.unembed.weight[vocab])
        if self.unembed.bias is not None:
            logits = logits + self.unembed.bias[vocab][:, None]
        envoy.skip(logits)


class TransformerLensBackend:
    """Runs passes through a TransformerLens 4 ``TransformerBridge`` with hook points.

    The bridge rewires the HF module it boots from, so it boots from a deep copy (made
    without the standing edits' module hooks) and the HF model used by other backends stays
    untouched (one extra copy of the weights). Standing edits run as hook points here.
    """

    name: ClassVar[str] = "transformer_lens"
    runs_suffix: ClassVar[bool] = False

    def __init__(self, model: LensModel, standing: list[_Standing]):
        from transformer_lens.model_bridge import TransformerBridge  # slow import, on use

        self.standing = standing
        with _detached(standing):
            hf_copy = copy.deepcopy(model.hf)
        self.bridge = TransformerBridge.boot_transformers(
            model.name, hf_model=hf_copy, tokenizer=model.tokenizer, device=str(model.device)
        )
        self.bridge.requires_grad_(False)

    @staticmethod
    def hook_name(site: Site) -> str:
        kind, layer = site
        return {
            "resid_pre": f"blocks.{layer}.hook_in",
            "q": f"blocks.{layer}.attn.hook_q",
            "k": f"blocks.{layer}.attn.hook_k",
            "v": f"blocks.{layer}.attn.hook_v",
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
        vocab: torch.Tensor | None = None,
        keep_cache: bool = False,
        past: Past | None = None,
    ) -> RunResult:
        if keep_cache or past is not None:
            raise ValueError("The TransformerLens backend runs whole passes only (no past=).")
        acts: dict[Site, torch.Tensor] = {}
        kept = set(sites)
        edited = kept | {site for entry in self.standing for site in entry.sites}

        def make_hook(site: Site):
            def hook(value: torch.Tensor, hook=None) -> torch.Tensor:
                for entry in self.standing:
                    if site in entry.sites:
                        value = entry.edit(site, value)
                if site in kept:
                    if edit is not None:
                        value = edit(site, value)
                    acts[site] = value
                return value

            return hook

        hooks = [(self.hook_name(site), make_hook(site)) for site in sorted(edited, key=site_order)]
        if grad:
            hooks.insert(
                0, ("hook_embed", lambda value, hook=None: value.detach().requires_grad_(True))
            )
        for entry in self.standing:
            if entry.before is not None:
                entry.before(batch.input_ids, batch.attention_mask)
        with (
            torch.set_grad_enabled(grad),
            self.bridge.hooks(fwd_hooks=hooks),
            _skipping(self.bridge.blocks, resume),
        ):
            logits = self.bridge(batch.input_ids, **_model_kwargs(batch))[:, 0]
        return RunResult(logits if vocab is None else logits.gather(1, vocab), acts)


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


#: Backend name -> class; a class is built as ``cls(model, standing)``.
BACKEND_CLASSES: dict[str, Callable[[LensModel, list[_Standing]], Backend]] = {
    NNsightBackend.name: NNsightBackend,
    TransformerLensBackend.name: TransformerLensBackend,
}
BACKENDS = tuple(BACKEND_CLASSES)


@dataclass
class _ModelState:
    """What the seam keeps per model: its booted backends and its active standing edits.
    Neither refers back to the model, so the model can be garbage-collected."""

    backends: dict[str, Backend] = field(default_factory=dict)
    standing: list[_Standing] = field(default_factory=list)


_STATES: weakref.WeakKeyDictionary[LensModel, _ModelState] = weakref.WeakKeyDictionary()


def _state(model: LensModel) -> _ModelState:
    if model not in _STATES:
        _STATES[model] = _ModelState()
    return _STATES[model]


def has_standing_edits(model: LensModel) -> bool:
    """Whether a standing edit (``standing_edit``) is active on ``model``."""
    return bool(_state(model).standing)


def get_backend(model: LensModel, name: str) -> Backend:
    """The backend ``name`` for ``model``, booted on first use and cached with the model.

    Raises:
        ValueError: an unknown backend name.
    """
    if name not in BACKEND_CLASSES:
        raise ValueError(f"Unknown backend '{name}'; choose one of {list(BACKENDS)}.")
    state = _state(model)
    if name not in state.backends:
        state.backends[name] = BACKEND_CLASSES[name](model, state.standing)
    return state.backends[name]


@dataclass
class _Standing:
    """One active standing edit: its sites, its function, and the module hooks that apply
    it to ``model.hf`` (``hf``: that module; ``spec``: its sizes and layout)."""

    sites: frozenset[Site]
    edit: EditFn
    before: BeforeFn | None
    hf: torch.nn.Module
    spec: ModelSpec
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        if self.before is not None:
            self.handles.append(
                self.hf.register_forward_pre_hook(self._before_hook, with_kwargs=True)
            )
        for site in sorted(self.sites, key=site_order):
            where = site_module(self.spec.layout, site)
            module = self.hf.get_submodule(where.path)
            if where.port == "input":
                self.handles.append(
                    module.register_forward_pre_hook(self._input_hook(site), with_kwargs=True)
                )
            else:
                self.handles.append(module.register_forward_hook(self._output_hook(site, where)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before_hook(self, module, args, kwargs) -> None:
        assert self.before is not None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None:
            self.before(input_ids, kwargs.get("attention_mask"))

    def _input_hook(self, site: Site):
        spec = self.spec

        def hook(module, args, kwargs):
            value = args[0] if args else kwargs["hidden_states"]
            shape = value.shape
            value = self.edit(site, head_view(spec, site, value)).reshape(shape)
            if args:
                return (value, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": value}

        return hook

    def _output_hook(self, site: Site, where: SiteModule):
        def hook(module, args, output):
            if where.item is None:
                return self.edit(site, head_view(self.spec, site, output)).reshape(output.shape)
            value = self.edit(site, output[where.item])
            return (*output[: where.item], value, *output[where.item + 1 :])

        return hook


@contextlib.contextmanager
def standing_edit(
    model: LensModel, sites: Sequence[Site], edit: EditFn, *, before: BeforeFn | None = None
) -> Iterator[None]:
    """While active, every forward pass of ``model`` applies ``edit`` at ``sites``.

    That is direct ``model.hf(...)`` calls and ``generate``, and every backend's ``run``
    (before the run's own edit, so the run keeps and edits the standing-edited
    activation). ``edit(site, activation) -> activation`` sees canonical shapes (``z``:
    (batch, pos, n_heads, d_head)). Standing edits nest; inner ones apply after outer ones.
    ``before(input_ids, attention_mask)``, when given, is called at the start of every pass
    with its tokens (batch, pos) (attention_mask may be None), e.g. to route each row.

    Raises:
        ValueError: a ``pattern`` site (attention weights are read, not edited, here).
    """
    if any(kind == "pattern" for kind, _ in sites):
        raise ValueError("A standing edit cannot edit attention patterns; edit 'z' instead.")
    state = _state(model)
    entry = _Standing(frozenset(sites), edit, before, model.hf, model.spec)
    entry.install()
    state.standing.append(entry)
    try:
        yield
    finally:
        state.standing.remove(entry)
        entry.remove()


@contextlib.contextmanager
def _detached(standing: list[_Standing]) -> Iterator[None]:
    """Within the block the standing edits' module hooks are off (for copying ``model.hf``
    without them); they are reinstalled, in order, after it."""
    for entry in standing:
        entry.remove()
    try:
        yield
    finally:
        for entry in standing:
            entry.install()
