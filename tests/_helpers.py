"""Helpers shared by several test modules (and by the fresh-process scripts some tests run).

``small_tokenizer()`` is the bundled SmolLM2 tokenizer cut down to the words of the built-in
prompt sets: the same byte-level BPE, keeping only the merges those texts use (plus the 256
byte symbols and the special tokens), renumbered from 0. Every built-in text tokenizes into
the same pieces as with the full tokenizer, so single-token targets stay single tokens and
clean/corrupt pairs keep equal lengths; any other text still tokenizes (into shorter
pieces, down to bytes). Tiny models built on it have a vocabulary of about 2,000 instead of
49,152, which makes their embeddings, logits and backward passes cheap.

Fresh-process scripts import it with ``sys.path.insert(0, TESTS)`` (``TESTS`` below);
``fresh_python`` runs such a script with the lenscape under test.

The rest are reference computations written with plain PyTorch hooks (no lenscape
internals), shared by the capture tests and the bundled-model tests.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import lenscape
from lenscape import schema


def fresh_python(code: str, *, timeout: float = 600) -> str:
    """Run ``code`` in a new Python process that imports the lenscape under test (its folder
    first on ``PYTHONPATH``), so nothing this test session imported is loaded there.

    Returns:
        The process's stdout; a failing process fails the test with its stderr.
    """
    toolkit = str(Path(lenscape.__file__).resolve().parents[1])
    path = os.pathsep.join([toolkit, *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


#: Provenance attrs of the synthetic results the view tests draw.
ATTRS = dict(
    long_name="attribution",
    units="logit diff",
    method="attribution_patching",
    metric="logit_diff",
    model="tiny",
    backend="nnsight",
    dtype="float32",
)


def make_result(values, dims, n_layers=None, **coords):
    """A synthetic result: ``values`` with ``dims`` (and ``coords``) and the ``ATTRS``."""
    return schema.make(np.asarray(values), dims=dims, coords=coords, attrs=ATTRS, n_layers=n_layers)


def signed_scores(n_layers=4, n_heads=3, seed=0):
    """Random (layer, head) scores of both signs."""
    values = np.random.default_rng(seed).normal(size=(n_layers, n_heads))
    values[0, 0], values[1, 1] = -2.0, 1.0  # both signs, |min| > max
    return make_result(values, ("layer", "head"), n_layers=n_layers)


def inline_rows(spec):
    """The inline cells of a chart's spec (Altair moves them to top-level ``datasets``)."""
    (values,) = spec["datasets"].values()
    return values


#: The tests folder, for fresh-process scripts that import this module.
TESTS = str(Path(__file__).resolve().parent)

#: Version of the cut-down recipe below; bump it when the recipe changes (the built
#: tokenizer is cached in a temp folder keyed by this and by its inputs).
RECIPE = 1


def corpus() -> list[str]:
    """Every text, target and counterfactual of the built-in prompt sets and tasks."""
    import lenscape as lsc

    # "repeated" (random words read twice, added later) is left out: the tiny test models'
    # tokenizer, and so their random weights, stay those every test was written against;
    # its texts still tokenize (a word the merges do not cover, into smaller pieces).
    sets = [lsc.data.prompts(name) for name in lsc.data.PROMPT_SETS if name != "repeated"]
    sets += [lsc.data.task(name, split="all") for name in ("math", "syntax")]
    texts = []
    for prompt_set in sets:
        for p in prompt_set:
            texts += [t for t in (p.text, p.target, p.corrupt, p.distractor) if t]
            texts.append(p.text + p.target)
            if p.corrupt and p.distractor:
                texts.append(p.corrupt + p.distractor)
    return texts


def _bpe(word: str, ranks: dict[tuple[str, str], int], used: set[tuple[str, str]]) -> None:
    """Byte-level BPE on one pre-tokenized piece; adds the merges it applies to ``used``."""
    parts = list(word)
    while len(parts) > 1:
        pairs = set(itertools.pairwise(parts))
        best = min(pairs, key=lambda pair: ranks.get(pair, len(ranks)))
        if best not in ranks:
            return
        used.add(best)
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged


@functools.cache
def small_tokenizer_json() -> str:
    """The cut-down tokenizer as ``tokenizer.json`` text (see the module docstring)."""
    import tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from lenscape import models

    full_json = (models.bundled_folder(models.DEFAULT_MODEL) / "tokenizer.json").read_text()
    full = json.loads(full_json)
    bpe = full["model"]
    ranks = {tuple(pair): rank for rank, pair in enumerate(bpe["merges"])}
    pre = tokenizers.Tokenizer.from_str(full_json).pre_tokenizer
    used: set[tuple[str, str]] = set()
    for piece in {p for text in corpus() for p, _ in pre.pre_tokenize_str(text)}:
        _bpe(piece, ranks, used)
    keep = {t["content"] for t in full["added_tokens"]} | set(ByteLevel.alphabet())
    keep |= {a + b for a, b in used}
    vocab = {
        token: new_id
        for new_id, token in enumerate(
            sorted((t for t in bpe["vocab"] if t in keep), key=bpe["vocab"].get)
        )
    }
    bpe["vocab"] = vocab
    bpe["merges"] = [list(pair) for pair in sorted(used, key=ranks.get)]
    for added in full["added_tokens"]:
        added["id"] = vocab[added["content"]]
    return json.dumps(full)


def small_tokenizer_folder() -> Path:
    """A folder holding the cut-down tokenizer (written once per content, under the system
    temp dir). Loading from a folder gives the tokenizer a ``name_or_path``, which
    TransformerLens needs: it reloads the tokenizer from there with a BOS option."""
    import tempfile

    from transformers import PreTrainedTokenizerFast

    from lenscape import models

    # Keyed by what the tokenizer is made from, so a process finding it skips the build.
    digest = hashlib.sha256(f"recipe {RECIPE}\n".encode())
    digest.update((models.bundled_folder(models.DEFAULT_MODEL) / "tokenizer.json").read_bytes())
    digest.update("\n".join(corpus()).encode())
    folder = Path(tempfile.gettempdir()) / f"lenscape-test-tokenizer-{digest.hexdigest()[:12]}"
    if not (folder / "tokenizer_config.json").exists():
        import tokenizers

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=tokenizers.Tokenizer.from_str(small_tokenizer_json()),
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
        )
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            staging = Path(tmp) / "tokenizer"
            tokenizer.save_pretrained(staging)
            try:  # atomic: a concurrent test process may have written the same folder
                staging.rename(folder)
            except OSError:
                if not (folder / "tokenizer_config.json").exists():
                    raise
    return folder


def small_tokenizer():
    """The cut-down tokenizer, loaded from ``small_tokenizer_folder()``, with the bundled
    tokenizer's special tokens (pad = eos, as there)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(small_tokenizer_folder(), local_files_only=True)


# ----------------------------------------------------------------------------- references
# Reference computations with plain PyTorch hooks. They deliberately avoid lenscape
# internals: they tokenize one prompt at a time (no padding), hook the HF modules directly
# and read the last token's logits.


def o_proj_module(model, layer):
    """The HF output projection of one block, found without lenscape's layout table."""
    return hand_block(model, layer)["o_proj"]


def block_outputs(model, layer):
    """(attention, MLP) modules whose outputs are added to the residual stream (the
    post-norms where a family has them)."""
    parts = hand_block(model, layer)
    attn = parts["attn"] if parts["post_attn"] is None else parts["post_attn"]
    return attn, parts["mlp_out"]


def logit_diff(model, text, target, distractor, hooks=()):
    """Logit difference at the last token of one unpadded prompt, with forward hooks."""
    tok = model.tokenizer
    ids = torch.tensor([tok(text)["input_ids"]])
    t = tok(target, add_special_tokens=False)["input_ids"][0]
    d = tok(distractor, add_special_tokens=False)["input_ids"][0]
    handles = [
        module.register_forward_pre_hook(fn) if pre else module.register_forward_hook(fn)
        for module, fn, pre in hooks
    ]
    try:
        with torch.no_grad():
            logits = model.hf(ids).logits[0, -1].double()
    finally:
        for h in handles:
            h.remove()
    return float(logits[t] - logits[d])


def head_replacer(model, head, value):
    """Pre-hook replacing one head's slice of the o_proj input; value(ids_shape)->tensor."""
    d_head = model.spec.d_head

    def hook(module, args):
        z = args[0].clone()
        z[..., head * d_head : (head + 1) * d_head] = value(z)
        return (z, *args[1:])

    return hook


def reference_head_effects(model, prompts, replacement, *, source="text", layers=None):
    """Per prompt, layer and head: logit difference on the prompt's ``source`` text ("text"
    or "corrupt") with that head's o_proj input replaced by ``replacement(i, layer, head)``
    (its (..., d_head) slice, or a scalar), minus the unedited logit difference.

    Returns:
        (prompt, len(layers), n_heads) array.
    """
    spec = model.spec
    layers = range(spec.n_layers) if layers is None else layers
    out = np.zeros((len(prompts), len(layers), spec.n_heads))
    for i, p in enumerate(prompts):
        text = getattr(p, source)
        base = logit_diff(model, text, p.target, p.distractor)
        for li, layer in enumerate(layers):
            for head in range(spec.n_heads):
                value = replacement(i, layer, head)
                hook = head_replacer(model, head, lambda z, value=value: value)
                edited = [(o_proj_module(model, layer), hook, True)]
                out[i, li, head] = logit_diff(model, text, p.target, p.distractor, edited) - base
    return out


def reference_zero_ablation(model, prompts, layers=None):
    return reference_head_effects(model, prompts, lambda i, layer, head: 0.0, layers=layers)


def reference_activation_patching(model, prompts):
    """Clean -> corrupt patching of each head, from the clean run's o_proj inputs."""
    spec, d_head = model.spec, model.spec.d_head
    clean_z: list[dict[int, torch.Tensor]] = []
    for p in prompts:
        saved: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in range(spec.n_layers):

            def save(module, args, layer=layer, saved=saved):
                saved[layer] = args[0].clone()

            hooks.append((o_proj_module(model, layer), save, True))
        logit_diff(model, p.text, p.target, p.distractor, hooks)
        clean_z.append(saved)
    return reference_head_effects(
        model,
        prompts,
        lambda i, layer, head: clean_z[i][layer][..., head * d_head : (head + 1) * d_head],
        source="corrupt",
    )


def hand_target_nll(model, prompts, gates=None) -> float:
    """Mean over prompts of each prompt's mean NLL on its target tokens: one unpadded forward
    per prompt, each head's output scaled by ``gates`` (layer, head) in an o_proj pre-hook
    (heads in order along the o_proj input)."""
    spec, tok = model.spec, model.tokenizer
    handles = []
    for layer in range(spec.n_layers if gates is not None else 0):
        scale = torch.as_tensor(np.asarray(gates)[layer], dtype=model.dtype)
        scale = scale.repeat_interleave(spec.d_head)  # (n_heads * d_head,)
        handles.append(
            o_proj_module(model, layer).register_forward_pre_hook(
                lambda module, args, scale=scale: (args[0] * scale, *args[1:])
            )
        )
    losses = []
    try:
        for p in prompts:
            text = tok(p.text)["input_ids"]
            target = tok(p.target, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model.hf(torch.tensor([text + target])).logits[0].double()
            rows = torch.log_softmax(logits, -1)[len(text) - 1 : len(text) - 1 + len(target)]
            losses.append(-float(rows[torch.arange(len(target)), torch.tensor(target)].mean()))
    finally:
        for handle in handles:
            handle.remove()
    return float(np.mean(losses))


def top_next_token(model, text):
    """The HF model's top next token id after ``text`` (one unpadded forward pass)."""
    ids = torch.tensor([model.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        return int(model.hf(ids).logits[0, -1].argmax())


def answered_prompts(model, prompts):
    """``prompts`` with every other target set to the model's own top next token (where
    that token is a non-empty text that tokenizes back to itself), so that even a random
    tiny model answers some prompts right and the rest wrong."""
    import dataclasses

    import lenscape as lsc

    tok, out = model.tokenizer, []
    for i, p in enumerate(prompts):
        top = top_next_token(model, p.text)
        text = tok.decode([top])
        if (
            i % 2 == 0
            and text.strip()
            and tok(text, add_special_tokens=False)["input_ids"] == [top]
        ):
            p = dataclasses.replace(p, target=text)
        out.append(p)
    return lsc.data.PromptSet(out, name="answered")


def reference_correct(model, prompts):
    """(prompt,) bool: the HF model's top next token on the clean text is the target."""
    tok = model.tokenizer
    return np.array(
        [
            top_next_token(model, p.text) == tok(p.target, add_special_tokens=False)["input_ids"][0]
            for p in prompts
        ]
    )


@contextlib.contextmanager
def torch_threads(count: int):
    """Run at ``count`` torch threads: on CPUs whose BLAS splits reductions by thread
    (measured: Intel AVX512 with MKL, 1 vs 2 threads differ by 2e-6 in attribution
    patching), results are bit-identical only at the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- per-receiver edge references
# Each family's computation written by hand from the Hugging Face source
# (transformers/models/*/modeling_*.py), without lenscape's layouts, descriptions or hooks:
# which modules hold a block's q/k/v, its norms and its outputs, and which columns of the
# q/k/v source module hold each head. A receiver's own copy of the residual stream is made
# with plain forward hooks, its q/k/v computed by the Hugging Face modules themselves.

#: Families whose attention and MLP outputs pass a norm before the residual stream, and
#: the offset of that norm's gain (Gemma: 1 + weight).
_POST_NORMED = {"gemma2": 1.0, "gemma3_text": 1.0, "olmo2": 0.0}


def hand_block(model, layer):
    """A block's modules by hand: dict with block, attn, qkv_norm (None: q/k/v read the
    stream as it is), o_proj, post_attn (None: none), mlp_in (its input is the MLP's
    residual input), mlp_out (its output is the MLP's contribution)."""
    hf, arch = model.hf, model.hf.config.model_type
    if arch == "gpt2":
        b = hf.transformer.h[layer]
        return dict(
            block=b,
            attn=b.attn,
            qkv_norm=b.ln_1,
            o_proj=b.attn.c_proj,
            post_attn=None,
            mlp_in=b.ln_2,
            mlp_out=b.mlp,
        )
    if arch == "gpt_neox":
        b = hf.gpt_neox.layers[layer]
        return dict(
            block=b,
            attn=b.attention,
            qkv_norm=b.input_layernorm,
            o_proj=b.attention.dense,
            post_attn=None,
            mlp_in=b.post_attention_layernorm,
            mlp_out=b.mlp,
        )
    b = hf.model.layers[layer]
    parts = dict(
        block=b,
        attn=b.self_attn,
        qkv_norm=getattr(b, "input_layernorm", None),
        o_proj=b.self_attn.o_proj,
        post_attn=None,
        mlp_in=b.post_attention_layernorm,
        mlp_out=b.mlp,
    )
    if arch in ("gemma2", "gemma3_text"):
        parts.update(
            post_attn=b.post_attention_layernorm,
            mlp_in=b.pre_feedforward_layernorm,
            mlp_out=b.post_feedforward_layernorm,
        )
    if arch == "olmo2":
        parts.update(
            qkv_norm=None,
            post_attn=b.post_attention_layernorm,
            mlp_in=b.mlp,
            mlp_out=b.post_feedforward_layernorm,
        )
    return parts


def hand_final_norm(model):
    hf = model.hf
    if hf.config.model_type == "gpt2":
        return hf.transformer.ln_f
    if hf.config.model_type == "gpt_neox":
        return hf.gpt_neox.final_layer_norm
    return hf.model.norm


def hand_parallel(model):
    """GPT-NeoX's MLP reads the block's input when its config says so."""
    return bool(getattr(model.hf.config, "use_parallel_residual", False))


def hand_qkv_source(model, layer, kind, head):
    """(module, compute, columns): the module whose output holds head ``head``'s ``kind``
    values (kind "q", "k" or "v"; k/v heads are key/value heads), a function computing that
    module's output from a normed input with the HF modules, and the head's columns there."""
    arch, attn = model.hf.config.model_type, hand_block(model, layer)["attn"]
    n_q, n_kv, d = model.spec.n_heads, model.spec.n_kv_heads, model.spec.d_head
    i = "qkv".index(kind)
    if arch == "gpt2":  # c_attn(x).split(embed_dim): [q | k | v]
        start = i * n_q * d + head * d
        return attn.c_attn, attn.c_attn.forward, slice(start, start + d)
    if arch == "gpt_neox":  # query_key_value(x).view(..., n, 3 d).chunk(3): per head q, k, v
        start = head * 3 * d + i * d
        return attn.query_key_value, attn.query_key_value.forward, slice(start, start + d)
    if arch == "phi3":  # qkv_proj(x)[..., :query_pos], [query_pos : +kv d], [...:]
        start = [0, n_q * d, n_q * d + n_kv * d][i] + head * d
        return attn.qkv_proj, attn.qkv_proj.forward, slice(start, start + d)
    proj = getattr(attn, f"{kind}_proj")
    if arch == "olmo2" and kind != "v":  # q_norm(q_proj(x)) over all heads at once
        norm = getattr(attn, f"{kind}_norm")
        # called: relevance rules hook the norm (the splice hook on it steps aside)
        return norm, lambda x: norm(proj.forward(x)), slice(head * d, head * d + d)
    return proj, proj.forward, slice(head * d, head * d + d)


def hand_receivers(model):
    """Receiver labels in lenscape's order, with (kind, layer, head)."""
    spec, out = model.spec, []
    for layer in range(spec.n_layers):
        out += [(f"L{layer}.H{h}.q", ("q", layer, h)) for h in range(spec.n_heads)]
        out += [(f"L{layer}.KV{h}.k", ("k", layer, h)) for h in range(spec.n_kv_heads)]
        out += [(f"L{layer}.KV{h}.v", ("v", layer, h)) for h in range(spec.n_kv_heads)]
        out.append((f"L{layer}.MLP", ("mlp", layer, -1)))
    return [*out, ("logits", ("logits", spec.n_layers, -1))]


def hand_sender(label):
    """A sender label ("embed", "L3.H2", "L3.MLP") as ``hand_edge_exists`` takes it."""
    if label == "embed":
        return "embed"
    layer = int(label[1:].split(".")[0])
    return (layer, "mlp") if label.endswith("MLP") else (layer, int(label.split(".H")[1]))


def position_agnostic(by_span, like):
    """Edge scores by span summed over spans and over each k/v receiver's query spans
    ("L1.KV0.k@END" -> "L1.KV0.k"), on ``like``'s receivers and dims."""
    import xarray as xr

    total = by_span.fillna(0).sum("span")
    base = xr.DataArray(
        [label.split("@")[0] for label in map(str, total["receiver"].values)],
        dims="receiver",
        name="base",
    )
    summed = total.groupby(base).sum().rename(base="receiver")
    return summed.sel(receiver=like["receiver"].values).transpose(*like.dims)


def hand_edge_exists(model, sender, receiver):
    """Whether ``receiver`` (kind, layer, head) reads ``sender`` ("embed" | (layer, head) |
    (layer, "mlp"))."""
    kind, r_layer, _ = receiver
    s_layer = -1 if sender == "embed" else sender[0]
    if s_layer < r_layer:
        return True
    head = sender != "embed" and sender[1] != "mlp"
    return kind == "mlp" and head and s_layer == r_layer and not hand_parallel(model)


def _hidden_of(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _replace_hidden(args, kwargs, value):
    return ((value, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": value})


def hand_senders(model, ids, embed=None):
    """One unedited pass: (sender label -> (pos, d_model) float64 output, logits at the last
    position). Heads through a post-norm are its output linearised at this run's scale:
    head output x rsqrt(mean(y^2) + eps) x gain, y the whole attention output."""
    spec, arch, d = model.spec, model.hf.config.model_type, model.spec.d_head
    out, hooks = {}, []

    def first(module, args, kwargs):
        hidden = _hidden_of(args, kwargs)
        if embed is not None:
            hidden = embed(hidden)
        out["embed"] = hidden[0].detach().double()
        return _replace_hidden(args, kwargs, hidden) if embed is not None else None

    hooks.append(hand_block(model, 0)["block"].register_forward_pre_hook(first, with_kwargs=True))
    for layer in range(spec.n_layers):
        parts = hand_block(model, layer)

        def heads(module, args, layer=layer):
            z, w = args[0][0].detach().double(), module.weight.detach().double()
            for h in range(spec.n_heads):
                w_h = w[h * d : (h + 1) * d] if arch == "gpt2" else w[:, h * d : (h + 1) * d].T
                out[f"L{layer}.H{h}"] = z[:, h * d : (h + 1) * d] @ w_h

        def post(module, args, output, layer=layer):
            y = args[0][0].detach().double()
            eps = getattr(module, "eps", None) or module.variance_epsilon
            scale = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
            gain = module.weight.detach().double() + _POST_NORMED[arch]
            for h in range(spec.n_heads):
                out[f"L{layer}.H{h}"] = out[f"L{layer}.H{h}"] * scale * gain

        def mlp(module, args, output, layer=layer):
            out[f"L{layer}.MLP"] = output[0].detach().double()

        hooks.append(parts["o_proj"].register_forward_pre_hook(heads))
        if parts["post_attn"] is not None:
            hooks.append(parts["post_attn"].register_forward_hook(post))
        hooks.append(parts["mlp_out"].register_forward_hook(mlp))
    try:
        with torch.no_grad():
            logits = model.hf(ids).logits[0, -1].double()
    finally:
        for handle in hooks:
            handle.remove()
    return out, logits


def hand_receiver_hooks(model, receiver, delta):
    """Plain hooks giving ``receiver`` (kind, layer, head) the residual stream plus ``delta``
    (1, pos, d_model) as its own input, every other reader the stream as it is."""
    kind, layer, head = receiver
    if kind == "logits":
        return [
            (
                hand_final_norm(model),
                lambda m, a, k: _replace_hidden(a, k, _hidden_of(a, k) + delta),
            )
        ]
    parts = hand_block(model, layer)
    if kind == "mlp":
        return [(parts["mlp_in"], lambda m, a, k: _replace_hidden(a, k, _hidden_of(a, k) + delta))]
    resid = {"busy": False}
    module, compute, columns = hand_qkv_source(model, layer, kind, head)

    def keep(m, a, k):
        resid["x"] = _hidden_of(a, k)

    def splice(m, a, output):
        if resid["busy"]:  # the receiver's own call of the module
            return None
        own = resid["x"] + delta
        # called, not ``forward``: relevance rules hook the norms (nothing else does here)
        resid["busy"] = True
        try:
            normed = own if parts["qkv_norm"] is None else parts["qkv_norm"](own)
            values = compute(normed)
        finally:
            resid["busy"] = False
        output = output.clone()
        output[..., columns] = values[..., columns]
        return output

    return [(parts["block"], keep), (module, splice, "forward")]


def hand_metric(model, ids, target, distractor, hooks=(), embed=None):
    """Logit difference at the last position with ``hooks`` ((module, fn) pre-hooks with
    kwargs, or (module, fn, "forward")) and the block-0 input replaced by ``embed``."""
    handles = []
    if embed is not None:
        # first, so that a receiver's copy of block 0's input is the replaced one
        hooks = [
            (
                hand_block(model, 0)["block"],
                lambda m, a, k: _replace_hidden(a, k, embed(_hidden_of(a, k))),
            ),
            *hooks,
        ]
    for hook in hooks:
        if len(hook) == 3:
            handles.append(hook[0].register_forward_hook(hook[1]))
        else:
            handles.append(hook[0].register_forward_pre_hook(hook[1], with_kwargs=True))
    try:
        logits = model.hf(ids).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return logits[target] - logits[distractor]


def _pair(model, prompt):
    tok = model.tokenizer
    clean = torch.tensor([tok(prompt.text)["input_ids"]])
    corrupt = torch.tensor([tok(prompt.corrupt)["input_ids"]])
    target, distractor = (
        tok(t, add_special_tokens=False)["input_ids"][0] for t in (prompt.target, prompt.distractor)
    )
    return clean, corrupt, target, distractor


def reference_edge_patching(model, prompt, edges):
    """Exact single-edge patching by hand: per (sender, receiver) label pair of ``edges``, the
    corrupt run's metric with only that receiver reading that sender's clean output
    (float64 of a float model's logits)."""
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    clean, _ = hand_senders(model, clean_ids)
    corrupt, _ = hand_senders(model, corrupt_ids)
    receivers = dict(hand_receivers(model))
    out = {}
    for sender, receiver in edges:
        delta = (clean[sender] - corrupt[sender])[None].to(model.dtype)
        hooks = hand_receiver_hooks(model, receivers[receiver], delta)
        with torch.no_grad():
            out[sender, receiver] = float(
                hand_metric(model, corrupt_ids, target, distractor, hooks)
            )
    return out


def reference_edge_scores(model, prompt, steps=1, receivers=None, rules=None, at="corrupt"):
    """As ``reference_edge_scores_plain``; with ``rules`` (a relevance rule set) the
    gradients are taken under ``lenscape.sweep.relevance.relevance_rules`` (the secant
    rules' reference pass is the clean prompt): RelP."""
    if rules is None:
        return reference_edge_scores_plain(model, prompt, steps, receivers, at=at)
    from lenscape.sweep.relevance import relevance_rules

    with relevance_rules(model, rules) as relevance:
        if relevance.rules.needs_reference:
            with relevance.reference(), torch.no_grad():
                model.hf(_pair(model, prompt)[0])
        return reference_edge_scores_plain(model, prompt, steps, receivers, at=at)


def reference_edge_scores_plain(model, prompt, steps=1, receivers=None, at="corrupt"):
    """EAP (steps=1) or EAP-IG by hand: per receiver, the gradient of the metric at a zero
    leaf added to its own copy of the stream, averaged over the corrupt -> clean path of
    block 0's input (k / steps, k = 0..steps-1), dotted with each sender's clean - corrupt
    output summed over positions. Returns {(sender, receiver): score} for the real edges
    into ``receivers`` (labels; None: every receiver). ``at="clean"`` (steps=1): the
    gradient at the clean run instead (the trapezoid rule's other end)."""
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    assert at in ("corrupt", "clean") and (at == "corrupt" or steps == 1)
    run_ids = corrupt_ids if at == "corrupt" else clean_ids
    clean, _ = hand_senders(model, clean_ids)
    corrupt, _ = hand_senders(model, corrupt_ids)
    clean_embed = clean["embed"][None].to(model.dtype)
    scores = {}
    for label, receiver in hand_receivers(model):
        if receivers is not None and label not in receivers:
            continue
        grad = 0.0
        for k in range(steps):
            leaf = torch.zeros((1, *clean["embed"].shape), dtype=model.dtype, requires_grad=True)

            def path(x, alpha=k / steps):
                return x + alpha * (clean_embed - x)

            metric = hand_metric(
                model,
                run_ids,
                target,
                distractor,
                hand_receiver_hooks(model, receiver, leaf),
                embed=path if k else None,
            )
            (g,) = torch.autograd.grad(metric, leaf)
            grad = grad + g[0].double() / steps
        for sender in clean:
            if hand_edge_exists(model, hand_sender(sender), receiver):
                scores[sender, label] = float(((clean[sender] - corrupt[sender]) * grad).sum())
    return scores


def span_positions_by_rule(tokenizer, prompt) -> dict[str, list[int]]:
    """Each span's token positions by the rule itself, from the tokenizer's character
    offsets (a token belongs to a span when their characters overlap), "other" last."""
    encoded = tokenizer(prompt.text, return_offsets_mapping=True)
    held = {name: [] for name in prompt.spans}
    for pos, (start, end) in enumerate(encoded["offset_mapping"]):
        for name, (a, b) in prompt.spans.items():
            if end > start and start < b and a < end:
                held[name].append(pos)
    named = {pos for positions in held.values() for pos in positions}
    held["other"] = [pos for pos in range(len(encoded["input_ids"])) if pos not in named]
    return held


def reference_edge_scores_by_span(model, prompt, steps=1, receivers=None):
    """EAP or EAP-IG by span, by hand: as ``reference_edge_scores_plain`` per receiver, a
    k or v receiver once per query span t with its block's attention output kept off the
    gradient outside t (z -> z m_t + z.detach() (1 - m_t) at the o_proj input: equal
    values, the gradient through t's queries only); each score summed over a span's
    positions alone (``span_positions_by_rule``). Returns {(span, sender, receiver): score}
    for the real edges into ``receivers`` (position-agnostic labels; None: every
    receiver), k and v receivers labelled "L1.KV0.k@END"."""
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    spans = span_positions_by_rule(model.tokenizer, prompt)
    order = list(spans)
    clean, _ = hand_senders(model, clean_ids)
    corrupt, _ = hand_senders(model, corrupt_ids)
    clean_embed = clean["embed"][None].to(model.dtype)
    width = clean_ids.shape[1]
    scores = {}
    for label, receiver in hand_receivers(model):
        if receivers is not None and label not in receivers:
            continue
        kind, layer = receiver[0], receiver[1]
        queries = order if kind in ("k", "v") else [None]
        for query in queries:
            hooks = []
            if query is not None:
                keep = torch.zeros(width, 1, dtype=model.dtype)
                keep[spans[query]] = 1

                def only_at(m, a, k, keep=keep):
                    z = a[0]
                    return (z * keep + z.detach() * (1 - keep), *a[1:]), k

                hooks.append((hand_block(model, layer)["o_proj"], only_at))
            grad = 0.0
            for step in range(steps):
                leaf = torch.zeros((1, *clean["embed"].shape), dtype=model.dtype)
                leaf.requires_grad_(True)

                def path(x, alpha=step / steps):
                    return x + alpha * (clean_embed - x)

                own = hand_receiver_hooks(model, receiver, leaf)
                metric = hand_metric(
                    model,
                    corrupt_ids,
                    target,
                    distractor,
                    [*own, *hooks],
                    embed=path if step else None,
                )
                (g,) = torch.autograd.grad(metric, leaf)
                grad = grad + g[0].double() / steps
            name = label if query is None else f"{label}@{query}"
            for sender in clean:
                if not hand_edge_exists(model, hand_sender(sender), receiver):
                    continue
                product = ((clean[sender] - corrupt[sender]) * grad).sum(-1)
                for span, at in spans.items():
                    if at:
                        scores[span, sender, name] = float(product[at].sum())
    return scores


def reference_edge_patching_by_span(model, prompt, edges):
    """Exact single-edge patching by span, by hand: per (span, sender, receiver) of
    ``edges``, the corrupt run's metric with that receiver reading the sender's clean output
    at the span's positions only; a k or v receiver "L1.KV0.k@END" only for the queries at
    END: a first run with the receiver patched gives its block's attention output (o_proj
    input), and a second, unpatched run takes that output at END's positions (the blocks
    before are the same in both, so this is exact)."""
    clean_ids, corrupt_ids, target, distractor = _pair(model, prompt)
    spans = span_positions_by_rule(model.tokenizer, prompt)
    clean, _ = hand_senders(model, clean_ids)
    corrupt, _ = hand_senders(model, corrupt_ids)
    receivers = dict(hand_receivers(model))
    width = clean_ids.shape[1]
    out = {}
    for span, sender, label in edges:
        name, _, query = label.partition("@")
        receiver = receivers[name]
        at = torch.zeros(width, 1, dtype=torch.float64)
        at[spans[span]] = 1
        delta = ((clean[sender] - corrupt[sender]) * at)[None].to(model.dtype)
        hooks = hand_receiver_hooks(model, receiver, delta)
        with torch.no_grad():
            if not query:
                value = hand_metric(model, corrupt_ids, target, distractor, hooks)
            else:
                o_proj, kept = hand_block(model, receiver[1])["o_proj"], {}

                def keep(m, a, k, kept=kept):
                    kept["z"] = a[0].clone()

                hand_metric(model, corrupt_ids, target, distractor, [*hooks, (o_proj, keep)])
                mask = torch.zeros(width, 1, dtype=model.dtype)
                mask[spans[query]] = 1

                def take(m, a, k, mask=mask, kept=kept):
                    return (a[0] * (1 - mask) + kept["z"] * mask, *a[1:]), k

                value = hand_metric(model, corrupt_ids, target, distractor, [(o_proj, take)])
        out[span, sender, label] = float(value)
    return out


def span_edge_kinds(graph, spans: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The edges of ``graph`` (a ``SpanGraph``) at ``spans``, by kind: "within" (q, MLP
    and logits receivers), "own span" (k and v read by queries at their own span) and
    "crossing" (k and v read by queries at another span); each a bool mask of its shape."""
    valid = graph.valid & np.isin(graph.spans, spans)[:, None, None]
    query = np.asarray([q for *_, q in graph.receivers])[None, None, :]
    span = np.asarray(graph.spans)[:, None, None]
    return {
        "within": valid & (query == ""),
        "own span": valid & (query == span),
        "crossing": valid & (query != "") & (query != span),
    }


def sampled_span_edges(graph, count: int, spans: tuple[str, ...], seed: int = 0) -> list[int]:
    """Flat indices of ``count`` random edges of ``graph`` (a ``SpanGraph``) at ``spans``,
    a third of each kind of ``span_edge_kinds``."""
    rng = np.random.default_rng(seed)
    chosen = []
    for mask in span_edge_kinds(graph, spans).values():
        flat = np.flatnonzero(mask)
        chosen += rng.choice(flat, size=min(count // 3, len(flat)), replace=False).tolist()
    return chosen


def span_edge_labels(graph, flat: int) -> tuple[str, str, str]:
    """The (span, sender, receiver) labels of flat edge index ``flat`` of ``graph``."""
    span, sender, receiver = np.unravel_index(flat, graph.shape)
    return graph.spans[span], graph.sender_labels[sender], graph.receiver_labels[receiver]


def mixed_length_prompts(model, prompts, count: int = 2) -> list:
    """The first ``count`` of ``prompts`` of different token lengths."""
    chosen, lengths = [], set()
    for prompt in prompts:
        n = len(model.tokenizer(prompt.text)["input_ids"])
        if n not in lengths:
            chosen.append(prompt)
            lengths.add(n)
        if len(chosen) == count:
            return chosen
    raise AssertionError(f"the prompts hold fewer than {count} token lengths")


def patched_every_and_none_by_span(model, prompts):
    """Exact edge patching by span of every edge and of none, in one left-padded batch:
    (every, none, other run, base run) metrics, each (prompt,)."""
    from lenscape.capture.edges import patching

    result = patching._edge_variants(
        model,
        prompts,
        variants=(("outside", ()), ("only", ())),
        positions="spans",
        padding_side="left",
        progress=False,
    )
    every, none = result["patched"].isel(variant=0), result["patched"].isel(variant=1)
    return every.values, none.values, result["other"].values, result["base"].values


def span_score_errors(model, prompts, estimator: str = "eap", steps: int = 1) -> list[dict]:
    """EAP (or EAP-IG) by span of ``prompts`` in one left-padded batch against
    ``reference_edge_scores_by_span``, per prompt: "error" (the largest difference on the
    graph's edges relative to the reference's largest score), "scale" (that score),
    "compared" and "edges" (edges compared and edges the graph has: equal when every edge is
    compared) and "absent" (the reference's largest |score| where the graph has no edge,
    relative to the scale)."""
    from lenscape.capture import edges

    scores = edges.edge_attribution(
        model,
        prompts,
        estimator=estimator,
        steps=steps if steps > 1 else None,
        positions="spans",
        per_prompt=True,
        padding_side="left",
        progress=False,
    )
    out = []
    for row, prompt in enumerate(prompts):
        reference = reference_edge_scores_by_span(model, prompt, steps=steps)
        ours = scores.isel(prompt=row)
        got = np.array([float(ours.sel(span=c, sender=s, receiver=r)) for c, s, r in reference])
        expected = np.array(list(reference.values()))
        scale = float(np.abs(expected).max())
        defined = ~np.isnan(got)
        out.append(
            {
                "error": float(np.abs(got[defined] - expected[defined]).max()) / scale,
                "scale": scale,
                "compared": int(defined.sum()),
                "edges": int(ours.notnull().sum()),
                "absent": float(np.abs(expected[~defined]).max(initial=0)) / scale,
            }
        )
    return out
