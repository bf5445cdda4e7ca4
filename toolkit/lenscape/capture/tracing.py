"""Causal tracing (ROME, Meng et al. 2022, arXiv 2202.05262): where a model recalls a fact.

The protocol of the reference code (github kmeng01/rome, ``experiments/causal_trace.py``):

1. Noise the subject: Gaussian noise of ``noise`` x the empirical standard deviation of the
   embeddings is added to the embeddings of the subject's tokens, in ``samples`` noised
   copies of each prompt.
2. Restore one cell of the clean run inside the noised run: the residual stream at one
   (layer, token) (``kind="resid"``), or the MLP (``"mlp"``) or attention (``"attn"``)
   outputs at one token over a window of ``window`` layers around a layer (layers
   ``max(0, l - window // 2) .. min(L, l + window - window // 2) - 1``).
3. Read the probability of the answer at the last position, averaged over the copies.

Indirect effect of a cell = p(restored) - p(noised); total effect = p(clean) - p(noised).

Here the residual stream at layer ``l`` is the stream *entering* block ``l`` (as
``level="resid"`` of the patching methods): layer 0 is the embeddings, so restoring layer 0
at every subject token gives the clean run back exactly. The embedding standard deviation
is measured as ROME's ``collect_embedding_std`` does on its subjects: the standard
deviation of every number of the embeddings (the residual stream entering block 0, Gemma's
scaling and learned positions included) at the subject tokens of the call's prompts.

Cells are token positions (``positions="each"``) or spans (``"spans"``: a span's tokens
restored together). Each batch's clean and noised runs are made once; a layer's cells of
every noised copy are stacked in one pass resumed from the noised run's residual stream at
the first layer it restores, as the exact patching sweeps do.
"""

from __future__ import annotations

import numpy as np
import torch
import xarray as xr

from .. import _validate, schema
from ..data import Prompts
from ..models import LensModel
from ..sweep import memory
from ..sweep.backend import Site, get_backend, site_order
from ..sweep.inputs import Batch, Inputs, batched
from ..sweep.options import UNMEASURED, Options
from ..sweep.plan import Call, Plan, Scores, once, top_is_target
from ..sweep.positions import real_positions
from ..sweep.registry import method, run
from ..sweep.result import position_coords, prompt_coords, provenance, span_order

KINDS = ("resid", "mlp", "attn")
#: Where the noise goes: the residual stream entering block 0 (the embeddings).
NOISE_SITE: Site = ("resid_pre", 0)
#: The span that is noised.
SUBJECT = "subject"
#: The most noised copies a call may ask for: each is a forward pass per cell.
MAX_SAMPLES = 1000
#: ROME's position roles (its averages over facts), then the tokens before the subject.
ROLES = (
    "first subject token",
    "middle subject tokens",
    "last subject token",
    "first subsequent token",
    "further tokens",
    "last token",
    "before the subject",
)


def position_roles(subject: list[int], length: int) -> list[str]:
    """ROME's role of each of a prompt's ``length`` positions, given its subject tokens: a
    one-token subject is its last subject token; the last position is "last token"."""
    first, last = subject[0], subject[-1]
    roles = []
    for pos in range(length):
        if pos == length - 1:
            roles.append(ROLES[5])
        elif pos < first:
            roles.append(ROLES[6])
        elif pos == last:
            roles.append(ROLES[2])
        elif pos == first:
            roles.append(ROLES[0])
        elif pos < last:
            roles.append(ROLES[1])
        else:
            roles.append(ROLES[3] if pos == last + 1 else ROLES[4])
    return roles


def by_role(trace: xr.DataArray) -> xr.DataArray:
    """(prompt, layer, role) mean of a ``positions="each"`` trace over the positions of each
    of ROME's roles (its ``role`` coord); NaN where a prompt has no position of a role."""
    if "role" not in trace.coords:
        raise ValueError(
            "by_role reads the role coord of a causal_trace(..., positions='each') result; "
            "this one has none."
        )
    parts = [trace.where(trace["role"] == role).mean("pos", keep_attrs=True) for role in ROLES]
    roles = xr.concat(parts, dim="role").assign_coords(role=list(ROLES))
    return roles.transpose("prompt", "layer", "role")


def window_layers(kind: str, layer: int, window: int, n_layers: int) -> list[int]:
    """The layers restored for cell ``layer``: ``layer`` itself for the residual stream,
    ROME's window around it for MLP and attention outputs."""
    if kind == "resid":
        return [layer]
    return list(range(max(0, layer - window // 2), min(n_layers, layer + window - window // 2)))


def _check_trace(model: LensModel, options: Options) -> None:
    """``causal_trace``'s own options, before any pass."""
    _validate.choice("kind", options.kind, KINDS)
    if options.positions not in ("each", "spans"):
        raise ValueError(
            f"causal_trace restores one cell at a time: positions must be 'each' (a layer x "
            f"token map) or 'spans', got {options.positions!r}."
        )
    _validate.number("noise", options.noise, low=0)
    _validate.integer("samples", options.samples, low=1, high=MAX_SAMPLES)
    _validate.integer("window", options.window, low=1)  # wider than the model: every layer
    _validate.seed("seed", options.seed)


def _subject_positions(inputs: Inputs) -> list[list[int]]:
    """Each prompt's subject token positions.

    Raises:
        ValueError: a prompt without a ``subject`` span.
    """
    spans = inputs.tokens.spans or [None] * len(inputs.tokens)
    missing = [i for i, held in enumerate(spans) if not held or SUBJECT not in held]
    if missing:
        raise ValueError(
            f"causal_trace noises each prompt's subject, but prompt(s) {missing[:8]} have no "
            f"'{SUBJECT}' span; give it (Prompt(..., spans={{'subject': 'the Eiffel "
            "Tower'}})) or use lsc.data.prompts('factual'), whose prompts carry one."
        )
    return [held[SUBJECT] for held in spans if held is not None]


def _embedding_std(inputs: Inputs, subjects: list[list[int]]) -> float:
    """The standard deviation of every number of the embeddings at the subject tokens."""
    backend = get_backend(inputs.model, inputs.backend)
    values = []
    for batch in inputs.batches():
        with torch.no_grad():
            embedded = backend.run(batch.clean, sites=[NOISE_SITE]).acts[NOISE_SITE]
        where = real_positions(batch.clean.attention_mask)
        for row, prompt in enumerate(batch.index.tolist()):
            at = torch.isin(where[row], torch.tensor(subjects[prompt], device=where.device))
            values.append(embedded[row, at].double().flatten().cpu())
    return float(torch.cat(values).std())


def _noise(
    batch: Batch, subjects: list[list[int]], scale: float, samples: int, seed: int, d_model: int
) -> torch.Tensor:
    """(rows * samples, seq, d_model) float64 noise for the batch's noised copies (copy
    ``s`` of row ``r`` at ``r * samples + s``), zero but at the subject tokens; drawn per
    prompt from (seed, prompt), so batching and padding never change it."""
    where = real_positions(batch.clean.attention_mask).cpu()
    out = []
    for row, prompt in enumerate(batch.index.tolist()):
        state = np.random.SeedSequence([seed, prompt]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(state))
        at = subjects[prompt]
        draw = torch.randn((samples, len(at), d_model), generator=generator, dtype=torch.float64)
        noise = torch.zeros((samples, where.shape[1], d_model), dtype=torch.float64)
        noise[:, torch.isin(where[row], torch.tensor(at))] = scale * draw
        out.append(noise)
    return torch.cat(out)


def _probability(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(rows,) p(target) from (rows, vocab) logits, in float32."""
    rows = torch.arange(len(target), device=target.device)
    return torch.softmax(logits.float(), -1)[rows, target]


class _Tracer:
    """One batch's causal trace: its clean and noised runs, then one stacked pass per
    layer and chunk of cells."""

    def __init__(self, inputs: Inputs, options: Options, subjects: list[list[int]], scale: float):
        self.inputs, self.options, self.subjects, self.scale = inputs, options, subjects, scale
        self.model = inputs.model
        self.backend = get_backend(self.model, inputs.backend)
        n_layers = self.model.spec.n_layers
        self.restored: list[Site] = (
            [("resid_pre", layer) for layer in range(n_layers)]
            if options.kind == "resid"
            else [(options.kind, layer) for layer in range(n_layers)]
        )

    def score(self, batch: Batch, step) -> Scores:
        """(rows, n_layers * n_cells + 2): indirect effects (layer-major, cells last), then
        p(clean) and p(noised) (the mean over copies)."""
        model, options, samples = self.model, self.options, int(self.options.samples)
        n_layers, n_cells = model.spec.n_layers, self.inputs.n_cells
        rows = len(batch.index)
        noise = _noise(
            batch, self.subjects, self.scale, samples, int(options.seed), model.spec.d_model
        ).to(model.device, model.dtype)
        copies = torch.arange(rows, device=batch.target.device).repeat_interleave(samples)
        noised_tokens = batch.clean.select(copies)
        target = batch.target[copies]
        with torch.no_grad():
            clean = self.backend.run(batch.clean, sites=self.restored)
            resid = [("resid_pre", layer) for layer in range(1, n_layers)]
            noised = self.backend.run(
                noised_tokens,
                sites=[NOISE_SITE, *resid],
                edit=lambda site, value: value + noise if site == NOISE_SITE else value,
            )
            p_clean = _probability(clean.logits, batch.target)
            p_noised = _probability(noised.logits, target).view(rows, samples).mean(1)
            assert batch.cells is not None  # positions "each" or "spans" (``_check_trace``)
            effects = torch.full((rows, n_layers, n_cells), float("nan"))
            held = (batch.cells.sum(1) > 0).cpu()  # (rows, n_cells)
            per_pass = max(
                1,
                memory.auto_variants_per_pass(
                    model, rows=rows * samples, width=batch.clean.input_ids.shape[1], wanted=n_cells
                ),
            )
            for layer in range(n_layers):
                layers = window_layers(options.kind, layer, int(options.window), n_layers)
                for start in range(0, n_cells, per_pass):
                    cells = list(range(start, min(start + per_pass, n_cells)))
                    restored = self._restored(
                        batch, noise, noised, clean, copies, target, layers, cells
                    )
                    effects[:, layer, cells] = (
                        (restored.view(len(cells), rows, samples).mean(2) - p_noised)
                        .T.float()
                        .cpu()
                    )
                step()
        effects = torch.where(held[:, None, :], effects, float("nan"))
        values = torch.cat(
            [effects.flatten(1), p_clean.float().cpu()[:, None], p_noised.float().cpu()[:, None]], 1
        )
        return Scores(values, top_is_target(clean.logits, batch.target).cpu())

    def _restored(self, batch, noise, noised, clean, copies, target, layers, cells):
        """(len(cells) * rows * samples,) p(target) of the noised copies with the clean
        values of ``layers``' restored site put back at each cell's tokens, one stacked
        pass resumed at the first restored layer."""
        n = len(copies)
        stacked = copies.repeat(len(cells))  # the prompt row of each stacked row
        which = torch.arange(len(cells), device=copies.device).repeat_interleave(n)
        at = batch.cells[stacked, :, torch.tensor(cells, device=copies.device)[which]].bool()
        first = layers[0]
        resume = (
            None
            if first == 0
            else (first, noised.acts[("resid_pre", first)].repeat(len(cells), 1, 1))
        )
        sites = [self.restored[layer] for layer in layers]
        stacked_noise = noise.repeat(len(cells), 1, 1)

        def edit(site: Site, value: torch.Tensor) -> torch.Tensor:
            if site == NOISE_SITE and resume is None:
                value = value + stacked_noise
            if site in sites:
                value = torch.where(at[..., None], clean.acts[site][stacked], value)
            return value

        edited = sorted({*sites, *([NOISE_SITE] if resume is None else [])}, key=site_order)
        run = self.backend.run(batch.clean.select(stacked), sites=edited, edit=edit, resume=resume)
        return _probability(run.logits, batch.target[stacked])


def _traced(
    inputs: Inputs,
    options: Options,
    subjects: list[list[int]],
    scale: float,
    std: float,
    values,
    correct,
    index,
):
    """The labelled (prompt, layer, pos | span) indirect effects of prompts ``index``, with
    p(clean), p(noised) and the total effect on ``prompt``."""
    spec = inputs.model.spec
    values = np.asarray(values, dtype=np.float32)
    coords = prompt_coords(inputs, index, correct)
    rows = coords["prompt"].tolist()
    n_cells = inputs.n_cells
    effects = values[:, :-2].reshape(len(rows), spec.n_layers, n_cells)
    p_clean, p_noised = values[:, -2], values[:, -1]
    coords |= position_coords(inputs, rows)
    if inputs.positions == "each":
        roles = np.full((len(rows), inputs.n_cells), "", dtype=object)
        for i, prompt in enumerate(rows):
            length = len(inputs.tokens.clean_ids[prompt])
            roles[i, :length] = position_roles(subjects[prompt], length)
        coords["role"] = (("prompt", "pos"), roles.astype(str))
    coords |= {
        "clean_prob": ("prompt", p_clean),
        "noised_prob": ("prompt", p_noised),
        "total_effect": ("prompt", p_clean - p_noised),
    }
    what = {"resid": "residual stream", "mlp": "MLP outputs", "attn": "attention outputs"}
    window = "" if options.kind == "resid" else f" ({options.window}-layer window)"
    attrs = {
        "long_name": f"Indirect effect of restoring the {what[options.kind]}{window} on p(answer)",
        "units": "probability",
        **provenance(inputs, "causal_trace", level=options.kind),
        "metric": "prob",
        "positions": inputs.positions,
        **span_order(inputs),
        "kind": options.kind,
        "window": int(options.window),
        "noise": float(options.noise),
        "noise_std": float(scale),
        "embedding_std": float(std),
        "samples": int(options.samples),
        "seed": int(options.seed),
        "protocol": "ROME causal tracing (Meng et al. 2022): subject embeddings noised, one "
        "cell of the clean run restored, p(answer) at the last position averaged over the "
        "noised copies; indirect effect = restored - noised",
    }
    dims = ("prompt", "layer", "pos" if inputs.positions == "each" else "span")
    return schema.make(effects, dims=dims, coords=coords, attrs=attrs, n_layers=spec.n_layers)


def plan_causal_trace(call: Call) -> Plan[xr.DataArray]:
    """``causal_trace`` as a plan: the embedding standard deviation over every prompt first
    (kept in the plan's ``prepass``), then one trace per batch."""
    model, tokens, options = call.model, call.tokens, call.options
    inputs = batched(model, tokens, options.replace(metric="logprob"), level="resid")
    subjects = _subject_positions(inputs)
    std = once(call.prepass, "embedding_std", lambda: _embedding_std(inputs, subjects))
    scale = float(options.noise) * std
    tracer = _Tracer(inputs, options, subjects, scale)
    return Plan(
        inputs,
        model.spec.n_layers * inputs.n_cells + 2,
        tracer.score,
        lambda values, correct, index: _traced(
            inputs, options, subjects, scale, std, values, correct, index
        ),
        desc=f"causal trace ({options.kind})",
        steps_per_batch=model.spec.n_layers,
        prepass=call.prepass,
    )


def causal_trace_memory(model: LensModel, options: Options, work: memory.Work) -> memory.Need:
    """Footprint of ``causal_trace``: the clean run's restored sites, the noised copies'
    residual stream entering every block, and one stacked pass of a layer's cells (as many
    as fit) over every copy."""
    samples = int(options.get("samples", 10))
    e = memory.element_bytes(model.dtype)
    tokens = work.rows * work.width
    kept = (1 + samples) * model.spec.n_layers * tokens * model.spec.d_model * e
    copies = memory.auto_variants_per_pass(
        model, rows=work.rows * samples, width=work.width, wanted=work.width
    )
    stacked = memory.forward_pass(model, copies * work.rows * samples, work.width)
    noise = 2 * samples * tokens * model.spec.d_model * 8
    return memory.Need(activations=stacked, buffers=kept + noise)


@method(
    plan_causal_trace,
    shared=(*UNMEASURED, "positions"),
    defaults={"positions": "each"},
    memory=causal_trace_memory,
    checks=_check_trace,
)
def causal_trace(
    model: LensModel,
    prompts: Prompts,
    *,
    kind: str = "resid",
    window: int = 10,
    noise: float = 3.0,
    samples: int = 10,
    seed: int = 0,
    **shared,
) -> xr.DataArray:
    """Causal tracing of factual recall (ROME): the indirect effect of restoring one clean
    cell in runs whose subject embeddings are noised (module docstring).

    Args:
        prompts: prompts with a ``subject`` span and a single-token target (e.g.
            ``lsc.data.prompts("factual")``); no corrupt text is used.
        kind: "resid" (the residual stream entering each block), "mlp" or "attn" (the
            block outputs over a ``window`` of layers around each layer).
        window: layers restored together for "mlp" and "attn" (ROME: 10).
        noise: the noise's standard deviation in units of the embeddings' (ROME: 3); 0
            noises nothing, so every effect is 0.
        samples: noised copies per prompt (ROME: 10).
        seed: seeds the noise, drawn per prompt (the same seed gives the same noise
            whatever the batching).
        positions: "each" (a layer x token map) or "spans" (a span's tokens restored
            together).

    Returns:
        DataArray (prompt, layer, pos | span) of indirect effects (probability), with
        ``clean_prob``, ``noised_prob`` and ``total_effect`` on ``prompt``, ``token`` or
        ``span_text`` on the cells (with "each" also ``role``: ROME's position role of each
        token, ``by_role`` averages over them), and the protocol in attrs (``noise_std``,
        ``seed`` ...).
    """
    return run(causal_trace, locals())
