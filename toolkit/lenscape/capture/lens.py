"""Logit lens: what the model would predict if it stopped after each block.

``logit_lens(model, "The Eiffel Tower is in the city of", target=" Paris")`` runs one
forward pass, keeps the residual stream after every block (the input of the next block,
and after the last block the input of the final norm) at every position, and reads each
one through the model's own final norm and unembedding (and Gemma's final logit
soft-capping). The last layer is therefore the model's own output; earlier layers show
where, and how early, the answer forms. The result is the target token's probability as
a DataArray (layer, pos) with the rank of the target and the top tokens as coords, ready
for ``lsc.heatmap(lens, x="pos", y="layer")``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xarray as xr

from .. import _validate, schema
from ..data import Prompt, from_records
from ..models import LensModel
from ..sweep.backend import BACKENDS, Site, get_backend
from ..sweep.inputs import _single_token, pad
from ..sweep.options import DEFAULTS
from .attention import token_labels

#: Top tokens listed per cell in the ``top_tokens`` coord.
TOP_K = 5


def _prompt(prompt: Any) -> Prompt | str:
    """A Prompt or a plain text from what the user passed (a record dict becomes a Prompt)."""
    if isinstance(prompt, dict):
        return from_records([prompt])[0]
    if isinstance(prompt, (Prompt, str)):
        return prompt
    raise TypeError(
        f"prompt must be a string, an lsc.data.Prompt or a record dict with 'text' and "
        f"'target', got {type(prompt).__name__} ({prompt!r}); pass one prompt, e.g. "
        "'The Eiffel Tower is in the city of'."
    )


def lens_sites(n_layers: int) -> list[Site]:
    """The residual stream after each block ``0..n_layers-1``: the input of block
    ``layer + 1``, and after the last block the input of the final norm."""
    return [("resid_pre", layer + 1) for layer in range(n_layers - 1)] + [("resid_final", -1)]


def read_out(model: LensModel, resid: torch.Tensor) -> torch.Tensor:
    """Residual streams (..., d_model) through the final norm and unembedding (and the
    final logit soft-capping where the config has one) -> logits (..., vocab), float32."""
    hf, layout = model.hf, model.spec.layout
    final_norm = hf.get_submodule(layout.final_norm)
    unembed = hf.get_submodule(layout.unembed)
    # ``forward`` directly: module hooks (standing edits on the final norm's input) have
    # already acted on the residual stream the backend kept.
    logits = unembed.forward(final_norm.forward(resid)).float()
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def logit_lens(
    model: LensModel,
    prompt: str | Prompt | dict[str, Any],
    *,
    target: str | None = None,
    backend: str = DEFAULTS.backend,
) -> xr.DataArray:
    """The target's probability when each layer's residual stream is read as the output.

    Args:
        model: a loaded model (``lsc.load``).
        prompt: the text, an ``lsc.data.Prompt`` or a record dict (its ``text`` is run).
        target: the token to follow, with its leading space (e.g. " Paris"); default: the
            prompt's target, or for a plain text the model's own top prediction at the
            last position (attrs ``target_source`` says which).
        backend: "nnsight" or "transformer_lens"; both give the same numbers.

    Returns:
        DataArray ``target_prob`` (layer, pos): p(target) from the residual stream after
        block ``layer`` at position ``pos``; the last layer is the model's own softmax.
        Coords: ``layer``, ``depth`` (layer), ``pos``, ``token`` (pos, the input token's
        text), ``target_rank`` (layer, pos; int, 0 = the top token), ``top_token``
        (layer, pos; str) and ``top_tokens`` (layer, pos; str, the top 5 with their
        probabilities, "' Paris' 0.41 | ' London' 0.12 | ..."). Attrs: provenance,
        ``text``, ``target``, ``target_source``.

    Raises:
        TypeError: a prompt or target of the wrong type.
        ValueError: an empty text, a text longer than the model's context, a target that
            is not one token, or an unknown backend.
    """
    _validate.choice("backend", backend, BACKENDS)
    given = _prompt(prompt)
    text = given.text if isinstance(given, Prompt) else given
    if not text.strip():
        raise ValueError(
            f"prompt {text!r} is empty; pass a text to read, e.g. "
            "'The Eiffel Tower is in the city of'."
        )
    if target is None and isinstance(given, Prompt):
        target = given.target
    if target is not None and not isinstance(target, str):
        raise TypeError(
            f"target must be a string (one token, e.g. ' Paris') or None, got "
            f"{type(target).__name__} ({target!r})."
        )
    tokenizer = model.tokenizer
    target_id = None if target is None else _single_token(tokenizer, target, "target", 0)
    ids = tokenizer(text)["input_ids"]
    model.check_context([len(ids)], what="text")

    n_layers = model.spec.n_layers
    sites = lens_sites(n_layers)
    tokens = pad([ids], tokenizer.pad_token_id, "right").to(model.device)
    source = "given" if target is not None else "model's top prediction"
    with torch.no_grad():
        acts = get_backend(model, backend).run(tokens, sites=sites).acts
        if target_id is None:
            final = read_out(model, acts[sites[-1]][0, -1])  # (vocab,) the model's own output
            target_id = int(final.argmax())
            target = tokenizer.decode([target_id])
        # One layer at a time: (pos, vocab) probabilities, never (layer, pos, vocab).
        target_probs, ranks, top_values, top_indices = [], [], [], []
        for site in sites:
            probs = torch.softmax(read_out(model, acts[site][0]), dim=-1)
            target_probs.append(probs[:, target_id])
            ranks.append((probs > probs[:, target_id, None]).sum(-1))
            top = probs.topk(TOP_K, dim=-1)
            top_values.append(top.values)
            top_indices.append(top.indices)
    target_prob, rank = torch.stack(target_probs), torch.stack(ranks)  # (layer, pos)
    top_ids = torch.stack(top_indices).cpu().numpy()  # (layer, pos, TOP_K)
    shown, where = np.unique(top_ids, return_inverse=True)  # decode each token once
    top_labels = np.asarray(token_labels(tokenizer, shown.tolist()))[where.reshape(top_ids.shape)]
    top_probs = torch.stack(top_values).cpu().numpy()
    top_tokens = [
        [
            " | ".join(f"{str(t)!r} {p:.2f}" for t, p in zip(cell_t, cell_p, strict=True))
            for cell_t, cell_p in zip(row_t, row_p, strict=True)
        ]
        for row_t, row_p in zip(top_labels, top_probs, strict=True)
    ]
    da = schema.make(
        target_prob.cpu().numpy(),
        dims=("layer", "pos"),
        coords={
            "layer": np.arange(n_layers),
            "pos": np.arange(len(ids)),
            "token": ("pos", token_labels(tokenizer, ids)),
            "target_rank": (("layer", "pos"), rank.cpu().numpy().astype(np.int64)),
            "top_token": (("layer", "pos"), top_labels[..., 0].astype(str)),
            "top_tokens": (("layer", "pos"), np.asarray(top_tokens, dtype=str)),
        },
        attrs={
            "long_name": f"p({target!r}) read through the final norm and unembedding",
            "units": "probability",
            "metric": "none",
            **model.provenance(
                "logit_lens",
                backend=backend,
                text=text,
                target=target,
                target_source=source,
            ),
        },
        n_layers=n_layers,
    )
    return da.rename("target_prob")
