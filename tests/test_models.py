"""Model loading, specs and the clear errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

import lenscape as lsc
from lenscape import models
from lenscape.models import bundled


@pytest.mark.parametrize(
    "arch, heads, kv",
    [("llama", 4, 2), ("qwen3", 4, 2), ("mistral", 4, 2), ("qwen2", 4, 2), ("gpt2", 4, 4)],
)
def test_tiny_specs(tokenizer, arch, heads, kv):
    model = models.tiny(arch, n_layers=2, tokenizer=tokenizer)
    spec = model.spec
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads) == (2, heads, kv)
    assert (
        spec.n_heads * spec.d_head
        == model.module(spec.layout.o_proj, 0).weight.shape[0 if arch == "gpt2" else 1]
    )
    for component, path in spec.layout.weights.items():
        assert component in lsc.schema.COMPONENTS
        model.hf.get_parameter(f"{spec.layout.layers}.0.{path}")


def test_tiny_is_seeded(tokenizer):
    a = models.tiny("llama", seed=3, tokenizer=tokenizer).hf.lm_head.weight
    b = models.tiny("llama", seed=3, tokenizer=tokenizer).hf.lm_head.weight
    c = models.tiny("llama", seed=4, tokenizer=tokenizer).hf.lm_head.weight
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_load_local_folder(tmp_path, tokenizer, factual):
    model = models.tiny("qwen3", tokenizer=tokenizer)
    model.hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again = lsc.load(str(tmp_path), device="cpu")
    assert again.spec == model.spec
    np.testing.assert_allclose(
        lsc.ablation(again, factual[:2], progress=False).values,
        lsc.ablation(model, factual[:2], progress=False).values,
        atol=1e-6,
    )


def test_loads_are_quiet(tmp_path, tokenizer, capfd):
    """No progress bar per load (in a notebook, a widget and a line of text each time); the
    bars' own setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    models.tiny("llama", tokenizer=tokenizer).hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    capfd.readouterr()
    lsc.load(str(tmp_path), device="cpu")
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err
    assert hf_logging.is_progress_bar_enabled()
    with models.bundled.quiet_loading():
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()


def test_unknown_bundled_name_is_a_lookup_error():
    with pytest.raises(LookupError, match="Bundled models"):
        models.bundled_folder("gpt-17")


def test_a_gguf_file_is_read_once_while_converting(tmp_path, monkeypatch):
    # transformers opens a GGUF file for the tokenizer, the config and the weights; while
    # converting, one reader per file serves them all, metadata reads are parsed once (each
    # caller gets its own copy) and gguf's name table is built once. All restored afterwards.
    import gguf
    from transformers import modeling_gguf_pytorch_utils as from_gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parses = []

    def parse(p, return_tensors=False, **kwargs):
        parses.append(return_tensors)
        return {"config": {"a": [1]}}

    monkeypatch.setattr(from_gguf, "load_gguf_checkpoint", parse)
    opened_by, loaded_by = gguf.GGUFReader, from_gguf.load_gguf_checkpoint
    named_by = gguf.get_tensor_name_map
    with bundled._gguf_read_once():
        first, second = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert first is second and first.get_field("llama.block_count").parts[-1][0] == 1
        # its bytes a plain view of the mapped file, read the same as a fresh reader reads them
        assert type(first.data) is np.ndarray
        np.testing.assert_array_equal(first.tensors[0].data, opened_by(path).tensors[0].data)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
        assert names is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
        assert names.get_name("blk.0.attn_q") == named_by(gguf.MODEL_ARCH.LLAMA, 1).get_name(
            "blk.0.attn_q"
        )
        one = from_gguf.load_gguf_checkpoint(path, return_tensors=False)
        one["config"]["a"].append(2)  # a caller changing its copy changes no other's
        assert from_gguf.load_gguf_checkpoint(str(path)) == {"config": {"a": [1]}}
        from_gguf.load_gguf_checkpoint(path, return_tensors=True)  # the weights: read anew
    assert parses == [False, True]
    assert gguf.GGUFReader is opened_by and from_gguf.load_gguf_checkpoint is loaded_by
    assert gguf.get_tensor_name_map is named_by


def test_missing_hf_id_offline():
    with pytest.raises(LookupError, match="never downloads weights"):
        lsc.load("no-such-org/no-such-model", device="cpu")


def test_missing_local_folder():
    with pytest.raises(LookupError, match="No model folder"):
        lsc.load("./does/not/exist", device="cpu")


def test_unsupported_architecture(tokenizer):
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    hf = transformers.BertForMaskedLM(config)
    with pytest.raises(ValueError, match=r"Unsupported architecture 'bert'.*gpt2.*llama.*layout="):
        models.from_hf(hf, tokenizer)


def test_encoder_name_is_refused_as_causal_lm():
    with pytest.raises(ValueError, match="sentence encoder"):
        lsc.load("minilm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu(tiny_llama):
    with pytest.raises(ValueError, match="no CUDA GPU"):
        models.resolve_device("cuda")


def test_bad_dtype():
    with pytest.raises(ValueError, match="Unknown dtype"):
        models.loader._resolve_dtype("float17")


@pytest.mark.slow
def test_bundled_model_spec_and_answer(smol):
    spec = smol.spec
    assert (
        spec.architecture,
        spec.n_layers,
        spec.n_heads,
        spec.n_kv_heads,
        spec.d_head,
        spec.d_model,
    ) == ("llama", 30, 9, 3, 64, 576)
    assert spec.tied_embeddings
    ids = smol.tokenizer("The capital of France is the city of", return_tensors="pt")
    with torch.no_grad():
        top = smol.hf(**ids).logits[0, -1].argmax()
    assert smol.tokenizer.decode(top).strip() == "Paris"


# ----------------------------------------------------------------------------- layouts


def test_layout_argument_for_an_unknown_family(tokenizer):
    hf = models.tiny("llama", tokenizer=tokenizer).hf
    hf.config.model_type = "my_llama"
    with pytest.raises(ValueError, match=r"Unsupported architecture 'my_llama'.*layout="):
        models.from_hf(hf, tokenizer)
    assert models.from_hf(hf, tokenizer, layout="llama").spec.architecture == "my_llama"
    custom = lsc.ArchLayout(
        layers="model.layers",
        o_proj="self_attn.o_proj",
        attn_out="self_attn",
        mlp_out="mlp",
        final_norm="model.norm",
        embed="model.embed_tokens",
        unembed="lm_head",
    )
    assert models.from_hf(hf, tokenizer, layout=custom).spec.layout == custom
    with pytest.raises(ValueError, match="layout='llama2' is not a known family"):
        models.from_hf(hf, tokenizer, layout="llama2")
    with pytest.raises(TypeError, match="layout must be"):
        models.from_hf(hf, tokenizer, layout={"layers": "model.layers"})


def test_load_checks_the_layout_and_check_false_skips(tmp_path, tokenizer):
    saved = models.tiny("llama", tokenizer=tokenizer)
    saved.hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    wrong = dataclasses.replace(saved.spec.layout, o_proj="self_attn.v_proj")
    with pytest.raises(lsc.LayoutCheckError, match="'heads'"):
        lsc.load(str(tmp_path), device="cpu", layout=wrong)
    assert lsc.load(str(tmp_path), device="cpu", layout=wrong, check=False).spec.layout == wrong


# ----------------------------------------------------------------------------- loading inputs


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    models.tiny("llama", tokenizer=tokenizer).hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def copy_folder(source, target, skip=()):
    target.mkdir()
    for path in source.iterdir():
        if path.name not in skip:
            shutil.copy(path, target / path.name)
    return target


CUSTOM_MODULE = """
from transformers import LlamaForCausalLM


class CustomLlama(LlamaForCausalLM):
    pass
"""


def with_custom_code(source, target):
    folder = copy_folder(source, target)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlama"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_custom.py").write_text(CUSTOM_MODULE)
    return folder


def test_custom_code_is_refused_with_how_to_allow_it(saved_llama, tmp_path):
    folder = with_custom_code(saved_llama, tmp_path / "custom")
    # transformers alone would load this as a stock LlamaForCausalLM without a word.
    with pytest.raises(
        ValueError,
        match=r"auto_map: AutoModelForCausalLM -> "
        r"modeling_custom\.CustomLlama.*trust_remote_code=True",
    ):
        lsc.load(str(folder), device="cpu")


def test_custom_code_runs_with_trust_remote_code(saved_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    folder = with_custom_code(saved_llama, tmp_path / "custom")
    model = lsc.load(str(folder), device="cpu", trust_remote_code=True)
    assert type(model.hf).__name__ == "CustomLlama"


@pytest.mark.parametrize("argument", ["trust_remote_code", "check"])
def test_flags_must_be_bool(saved_llama, argument):
    with pytest.raises(TypeError, match=f"{argument} must be True or False, got 'yes'"):
        lsc.load(str(saved_llama), device="cpu", **{argument: "yes"})


def test_missing_tokenizer_names_the_files(saved_llama, tmp_path):
    weights_only = copy_folder(
        saved_llama, tmp_path / "weights", skip=("tokenizer.json", "tokenizer_config.json")
    )
    with pytest.raises(
        LookupError,
        match=r"no tokenizer: none of tokenizer\.json, tokenizer\.model, "
        r"vocab\.json \+ merges\.txt",
    ) as err:
        lsc.load(str(weights_only), device="cpu")
    assert "install" not in str(err.value) and "lsc.from_hf" in str(err.value)


# ----------------------------------------------------------- weights that do not cover the config


def with_config(source, target, **changes):
    folder = copy_folder(source, target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_a_config_with_more_layers_than_the_weights_is_refused(saved_llama, tmp_path):
    """transformers would add a randomly initialised third layer, which passes the self-check."""
    folder = with_config(saved_llama, tmp_path / "deeper", num_hidden_layers=3)
    with pytest.raises(
        ValueError, match=r"do not match its config\.json: \d+ missing from the weights.*layers\.2"
    ):
        lsc.load(str(folder), device="cpu")


def test_weights_the_config_does_not_name_are_refused(saved_llama, tmp_path):
    folder = with_config(saved_llama, tmp_path / "shallower", num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"in the weights but not in the config.*layers\.1"):
        lsc.load(str(folder), device="cpu")


def test_a_matching_checkpoint_loads_with_the_same_weights(saved_llama):
    model = lsc.load(str(saved_llama), device="cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved_llama)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.hf.state_dict()[name], tensor, rtol=0, atol=0)


def test_a_truncated_config_is_called_malformed_not_missing(saved_llama, tmp_path):
    folder = copy_folder(saved_llama, tmp_path / "truncated")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"config\.json\) is malformed, not missing") as err:
        lsc.load(str(folder), device="cpu")
    assert "hf download" not in str(err.value)


# ------------------------------------------------------------------- layout provenance


def test_results_record_whether_the_layout_was_checked(saved_llama, factual):
    checked = lsc.load(str(saved_llama), device="cpu")
    unchecked = lsc.load(str(saved_llama), device="cpu", check=False)
    assert checked.layout_checked and not unchecked.layout_checked
    for model in (checked, unchecked):
        scores = lsc.direct_logit_attribution(model, factual[:2], progress=False)
        assert scores.attrs["layout_checked"] is model.layout_checked
        vocab = len(model.tokenizer)  # the small test tokenizer's
        assert scores.attrs["layout_fingerprint"] == f"llama/L2/H4/KV2/D16/d64/V{vocab}"


def test_fingerprints_tell_layouts_apart(tokenizer):
    prints = {
        models.tiny(arch, n_layers=n, tokenizer=tokenizer, check=False).spec.fingerprint
        for arch, n in [("llama", 2), ("llama", 3), ("qwen3", 2), ("gpt2", 2)]
    }
    assert len(prints) == 4


def test_weights_fingerprint_is_the_same_for_the_same_weights_reloaded(saved_llama, factual):
    """Same weights (built again from the seed, loaded from disk): same fingerprint, which
    every result carries; other weights of the same name and layout: another."""
    loaded = lsc.load(str(saved_llama), device="cpu")
    built = models.tiny("llama", tokenizer=loaded.tokenizer)
    other = models.tiny("llama", seed=1, tokenizer=loaded.tokenizer)
    assert loaded.weights_fingerprint == built.weights_fingerprint
    assert len(loaded.weights_fingerprint) == 64
    assert other.spec == built.spec and other.weights_fingerprint != built.weights_fingerprint
    scores = lsc.direct_logit_attribution(loaded, factual[:2], progress=False)
    assert scores.attrs["weights_fingerprint"] == loaded.weights_fingerprint


def test_weights_fingerprint_follows_a_changed_weight(tokenizer):
    """Perturbing one tensor (in place, as an optimizer step does), changing one value, or
    replacing a parameter's tensor changes the fingerprint; undoing it restores it."""
    model = models.tiny("llama", tokenizer=tokenizer)
    before = model.weights_fingerprint
    weight = model.hf.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(1e-3 * torch.randn_like(weight))
    assert model.weights_fingerprint != before
    original = models.tiny("llama", tokenizer=tokenizer).hf.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.copy_(original)
    assert model.weights_fingerprint == before
    assert weight.numel() >= 2 * models.lens_model.FINGERPRINT_SAMPLE
    with torch.no_grad():
        weight.view(-1)[1] += 1e-4  # one value, between the sampled ones
    assert model.weights_fingerprint != before
    with torch.no_grad():
        weight.copy_(original)
    model.hf.model.norm.weight = torch.nn.Parameter(model.hf.model.norm.weight * 2)
    assert model.weights_fingerprint != before


def test_weights_fingerprint_sees_writes_through_data_and_is_hashed_once_per_call(
    tokenizer, factual, monkeypatch
):
    """A write through ``param.data`` moves no version counter: outside a call the
    fingerprint is taken anew on every read, so it is seen; a public call hashes the
    weights once however often its parts read the fingerprint, and records that hash."""
    model = models.tiny("llama", tokenizer=tokenizer)
    before = model.weights_fingerprint
    weight = model.hf.model.layers[0].self_attn.q_proj.weight
    version = weight._version
    weight.data[0] += 1
    assert weight._version == version  # the write is invisible to the version counter
    edited = model.weights_fingerprint
    assert edited != before
    hashes = []
    real_hash = models.lens_model.weights_fingerprint
    monkeypatch.setattr(
        models.lens_model, "weights_fingerprint", lambda m: hashes.append(1) or real_hash(m)
    )
    scores = lsc.direct_logit_attribution(model, factual[:2], progress=False)
    assert len(hashes) == 1
    assert scores.attrs["weights_fingerprint"] == edited
    with model.one_call():
        first = model.weights_fingerprint
        assert model.weights_fingerprint == first and len(hashes) == 2
        with torch.no_grad():
            weight.add_(1.0)  # a tracked write inside a call: hashed again
        assert model.weights_fingerprint != first and len(hashes) == 3


def test_dtype_and_device_are_read_from_the_parameters(tokenizer, factual):
    """A model cast behind the ``LensModel`` is seen: its dtype, what results record and
    what the memory plan counts follow the parameters, not the loading arguments."""
    model = models.tiny("llama", tokenizer=tokenizer)
    plan32 = lsc.estimate(model, "ablation", factual[:2], batch_size=2)
    assert (model.dtype, model.device) == (torch.float32, torch.device("cpu"))
    model.hf.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.provenance("x")["dtype"] == "bfloat16"
    plan16 = lsc.estimate(model, "ablation", factual[:2], batch_size=2)
    assert plan16.weights * 2 == plan32.weights
    scores = lsc.direct_logit_attribution(model, factual[:2], progress=False)
    assert scores.attrs["dtype"] == "bfloat16"


def test_dtype_is_read_once_per_call_and_anew_between_calls(tokenizer, factual, monkeypatch):
    """Inside a call the parameters are walked for the dtype once (a pass reads it hundreds
    of times: issue 42's EAP-IG timing found 627 walks per call); the next call reads it
    anew, so a cast between calls is seen."""
    model = models.tiny("llama", tokenizer=tokenizer)
    walks, walk = [], model.hf.parameters

    def counted(*args, **kwargs):
        walks.append(1)
        return walk(*args, **kwargs)

    monkeypatch.setattr(model.hf, "parameters", counted)
    with model.one_call():
        assert [model.dtype for _ in range(50)] == [torch.float32] * 50
        with model.one_call():  # a part of a report: the same call
            assert model.dtype == torch.float32
    assert len(walks) == 1
    model.hf.to(torch.bfloat16)
    with model.one_call():
        assert model.dtype == torch.bfloat16
    scores = lsc.direct_logit_attribution(model, factual[:2], progress=False)
    assert scores.attrs["dtype"] == "bfloat16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_fingerprint_sums_the_float32_bit_patterns_in_any_dtype(dtype):
    """The bit sum is that of the values read as float32 (bfloat16's is taken on its own
    16-bit patterns, float16's on a float32 copy), wrapping modulo 2**32."""
    values = (torch.randn(70_001, generator=torch.Generator().manual_seed(0)) * 1e4).to(dtype)
    patterns = values.float().view(torch.int32).numpy().astype(np.int64)
    expected = (int(patterns.sum()) + 2**31) % 2**32 - 2**31
    assert models.lens_model._bit_sum(values) == expected
    assert abs(int(patterns.sum())) > 2**31  # the sum wraps: the modulo is exercised


def test_weights_fingerprint_of_weights_made_under_inference_mode(tokenizer):
    """Inference tensors keep no version counter: the fingerprint is taken anew each time."""
    with torch.inference_mode():
        model = models.tiny("llama", tokenizer=tokenizer, check=False)
        before = model.weights_fingerprint
        model.hf.model.norm.weight.mul_(2)
    assert before == models.tiny("llama", tokenizer=tokenizer).weights_fingerprint
    assert model.weights_fingerprint != before


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"device": "gpu0"}, ValueError, r"device='gpu0' is not a device; use 'auto', 'cpu'"),
        ({"device": 0.5}, TypeError, r"device must be a string such as 'cpu'"),
        ({"dtype": "int8"}, ValueError, r"Unknown dtype 'int8'.*floating-point"),
        ({"dtype": 1.5}, ValueError, r"Unknown dtype 1\.5"),
    ],
)
def test_devices_and_dtypes_that_do_not_exist_are_named(tiny_llama, kwargs, error, message):
    """torch would raise a RuntimeError (a traceback in the CLI) or move weights to int8."""
    with pytest.raises(error, match=message):
        lsc.from_hf(tiny_llama.hf, tiny_llama.tokenizer, **kwargs)
