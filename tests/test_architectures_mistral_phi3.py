"""Mistral and Phi-3: tiny seeded random transformers models compiled (q0f32) against transformers (eager attention,
so its sliding window applies), windows shorter than the context included, negative controls that would catch the
feature ignored, and the config refusals."""

import copy

import numpy as np
import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import SLIDING_WINDOW_ATTR
from compiler.models.registry import family_for
from compiler.runtime.session import Session
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import reference_greedy
from tests.helpers.tiny_models import random_model, save_compilable_checkpoint, write_gguf

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10]
GREEDY = 32  # tokens after the prompt: 43 positions in all
TOLERANCE = 1e-4  # relative to the largest logit
DIFFERS = 1e-2  # a negative control must be at least this far off

_SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.5, 4.0, 6.0],
             "long_factor": [3.0, 5.0, 8.0, 12.0, 20.0, 30.0], "original_max_position_embeddings": 64}

# name -> (transformers class, config, --context-window)
MODELS = {
    "mistral_no_window": (MistralForCausalLM, lambda: MistralConfig(**_SHAPE, sliding_window=None,
                                                                    rope_theta=50000.0), 64),
    # Phi-4-mini's shape: RoPE on 3/4 of each head, LongRoPE, tied embeddings, a window no sequence outgrows
    "phi3_partial_longrope": (Phi3ForCausalLM, lambda: Phi3Config(
        **_SHAPE, partial_rotary_factor=0.75, rope_scaling=dict(_LONGROPE), original_max_position_embeddings=64,
        tie_word_embeddings=True, sliding_window=64), 64),
    # Phi-3-mini-4k's: whole-head RoPE, no scaling, untied, a sliding window of the context window
    "phi3_window_48": (Phi3ForCausalLM, lambda: Phi3Config(**_SHAPE, tie_word_embeddings=False, sliding_window=48),
                       48),
    # windows shorter than the context (Mistral 7B v0.1's 4096, Phi-3-mini's 2047), applied by the CPU kernels: the
    # prompt outgrows the window, a chunked prefill's cached keys cross it and decode moves it page by page
    "mistral_window_8": (MistralForCausalLM, lambda: MistralConfig(**_SHAPE, sliding_window=8, rope_theta=50000.0),
                         64),
    "phi3_window_12": (Phi3ForCausalLM, lambda: Phi3Config(**_SHAPE, tie_word_embeddings=False, sliding_window=12),
                       64),
}
LONG_PROMPT = [(7 * i + 3) % 150 + 3 for i in range(40)]  # past the negative control's window of 4


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _model(name: str, seed: int = 0, **changes):
    model_cls, config, _ = MODELS[name]
    cfg = config()
    for key, value in changes.items():
        setattr(cfg, key, value)
    return random_model(model_cls, cfg, seed)


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request, tmp_path_factory):
    name = request.param
    model = _model(name)
    root = tmp_path_factory.mktemp(name)
    save_compilable_checkpoint(model, root / "hf")
    compile_model(CompileOptions(str(root / "hf"), "host", "q0f32", str(root / "artifact"),
                                 context_window=MODELS[name][2], progress=False))
    return name, model, Session(load_artifact(root / "artifact"))


def _prefill(session, prompt=PROMPT) -> np.ndarray:
    session.reset()
    return session.prefill_all_logits(prompt)


@pytest.mark.slow
def test_logits_and_32_greedy_tokens_match_transformers(compiled):
    _, model, session = compiled
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, GREEDY)
    prefill = _prefill(session)
    assert _rel_err(prefill, ref_prefill) < TOLERANCE
    tokens = [int(prefill[-1].argmax())]
    for step in range(GREEDY - 1):
        assert tokens[-1] == ref_tokens[step], f"greedy token {step}: {tokens} vs {ref_tokens}"
        logits = session.decode(tokens[-1])
        assert _rel_err(logits, ref_decode[step]) < TOLERANCE, f"decode step {step}"
        tokens.append(int(logits.argmax()))
    assert tokens == ref_tokens


@pytest.mark.slow
def test_chunked_prefill_matches_transformers(compiled):
    """A prompt fed in chunks of 8: each chunk attends to the cached pages (the paged prefill kernel) too."""
    _, model, session = compiled
    _, ref_prefill, _ = reference_greedy(model, LONG_PROMPT, 1)
    session.reset()
    session.prefill_chunk = 8
    try:
        logits = session.prefill_all_logits(LONG_PROMPT)
    finally:
        session.prefill_chunk = int(session.artifact.config["prefill_chunk"])
    assert _rel_err(logits, ref_prefill) < TOLERANCE


@pytest.mark.slow
@NEEDS_OPENCL
@pytest.mark.parametrize("name", ["mistral_window_8", "phi3_window_12"])
def test_windows_on_a_gpu_target_match_transformers(tmp_path, name):
    """android-adreno on PoCL (float32): mobilec's GPU attention kernels apply the window; the prompt outgrows it,
    decode moves it, and a prefill in chunks of 8 (the paged kernel and the merge of states) matches too."""
    model = _model(name)
    save_compilable_checkpoint(model, tmp_path / "hf")
    compile_model(CompileOptions(str(tmp_path / "hf"), "android-adreno", "q0f32", str(tmp_path / "gpu"),
                                 context_window=64, progress=False, kv_dtype="f32", **ON_POCL))
    session = Session(load_artifact(tmp_path / "gpu"))
    assert str(session.device.dev).startswith("opencl")
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, GREEDY)
    assert _rel_err(_prefill(session), ref_prefill) < TOLERANCE
    for step, token in enumerate(ref_tokens[:-1]):
        assert _rel_err(session.decode(token), ref_decode[step]) < TOLERANCE, f"decode step {step}"
    _, ref_long, _ = reference_greedy(model, LONG_PROMPT, 1)
    session.reset()
    session.prefill_chunk = 8
    chunked = session.prefill_all_logits(LONG_PROMPT)
    assert _rel_err(chunked, ref_long) < TOLERANCE
    _, unwindowed, _ = reference_greedy(_model(name, sliding_window=None), LONG_PROMPT, 1)
    assert _rel_err(chunked, unwindowed) > DIFFERS  # negative control: the window ignored


def _swapped_halves(model, param: str, split: int):
    """A copy of `model` whose fused `param` rows [:split] and [split:] trade places in every layer."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for layer in other.model.layers:
            w = layer.get_submodule(param).weight
            w.copy_(torch.cat([w[split:], w[:split]]))
    return other


def _controls(name: str, model) -> dict:
    """The feature ignored or mapped wrongly, as transformers computes it: each must differ from the compiled model."""
    if name == "mistral_no_window":
        return {"a window of 4 tokens": _model(name, sliding_window=4)}
    if name in ("mistral_window_8", "phi3_window_12"):
        return {"the window ignored": _model(name, sliding_window=None),
                "a window one longer": _model(name, sliding_window=model.config.sliding_window + 1)}
    if name == "phi3_window_48":  # and the fused checkpoint rows in another order
        return {"gate and up swapped": _swapped_halves(model, "mlp.gate_up_proj", model.config.intermediate_size),
                "q after k and v": _swapped_halves(model, "self_attn.qkv_proj", 64)}
    rope = model.config.rope_parameters
    return {
        "RoPE over the whole head": _model(name, rope_parameters={  # a factor for each of the 8 pairs
            **rope, "partial_rotary_factor": 1.0, "short_factor": rope["short_factor"] + [1.0, 1.0],
            "long_factor": rope["long_factor"] + [1.0, 1.0]}),
        "LongRoPE's long factors": _model(name, rope_parameters={**rope, "short_factor": rope["long_factor"]}),
        "no attention factor": _model(name, rope_parameters={**rope, "attention_factor": 1.0}),
        "plain RoPE": _model(name, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"],
                                                    "partial_rotary_factor": 0.75})}


@pytest.mark.slow
def test_negative_controls_differ(compiled):
    name, model, session = compiled
    prefill = _prefill(session, LONG_PROMPT)
    for what, other in _controls(name, model).items():
        _, ref_prefill, _ = reference_greedy(other, LONG_PROMPT, 1)
        assert _rel_err(prefill, ref_prefill) > DIFFERS, what


# ---- config refusals (no compile) ----

def _hf(name: str, **changes) -> dict:
    return {**_model(name).config.to_dict(), **changes}


def _refused(hf: dict, context_window: int | None, *words: str) -> None:
    with pytest.raises(MobilecError) as err:
        family_for(hf).config_class.from_hf(hf, context_window)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def _config(name: str, context_window: int | None, **changes):
    hf = _hf(name, **changes)
    return family_for(hf).config_class.from_hf(hf, context_window)


def test_binding_sliding_window_goes_to_the_cpu_kernels():
    """A window shorter than the context window is recorded for the CPU attention kernels (SLIDING_WINDOW_ATTR; the
    layers stay full attention: every layer TVM's "mha_sliding" fails in TVM 0.27's runtime); one of at least the
    context window is full attention, and no attr."""
    for name in ("mistral_no_window", "phi3_window_48"):
        cfg = _config(name, 64, sliding_window=8)
        assert cfg.sliding_window == 8 and cfg.context_window_size == 64
        assert family_for(_hf(name)).model_class(cfg).attention_attrs() == {SLIDING_WINDOW_ATTR: 8}
        cfg = _config(name, 8, sliding_window=8)
        assert cfg.sliding_window == 0 and family_for(_hf(name)).model_class(cfg).attention_attrs() == {}
    assert _config("mistral_no_window", None, sliding_window=256).sliding_window == 0


def test_binding_sliding_window_compiles_for_the_npu_with_our_kernels(tmp_path):
    """The NPU target's KV cache and attention run on its ARM host, with mobilec's windowed NEON kernels (their
    numerics at 4 lanes: tests/kernels/test_cpu_attention.py); the NPU kernels build."""
    save_compilable_checkpoint(_model("mistral_window_8"), tmp_path / "hf")
    compile_model(CompileOptions(str(tmp_path / "hf"), "hexagon-npu", "q4f16_g32", str(tmp_path / "out"),
                                 context_window=64, progress=False))
    assert (tmp_path / "out" / "lib" / "hexagon" / "kernels.o").is_file()


def test_phi3_rope_fields_are_read():
    cfg = _config("phi3_partial_longrope", 64)
    assert cfg.rotary_dim == 12 and cfg.longrope.factor == 4.0 and cfg.tie_word_embeddings
    assert cfg.longrope.short_factor == tuple(_LONGROPE["short_factor"])
    assert _config("phi3_window_48", 48).rotary_dim == 16
    # transformers 4's spelling: rope_scaling {"type": "su"} and a top-level partial_rotary_factor
    hf4 = {**_hf("phi3_partial_longrope"), "rope_parameters": None, "partial_rotary_factor": 0.75, "rope_theta": 1e4,
           "rope_scaling": {"type": "su", "short_factor": _LONGROPE["short_factor"],
                            "long_factor": _LONGROPE["long_factor"]}}
    cfg4 = family_for(hf4).config_class.from_hf(hf4, 64)
    assert (cfg4.rotary_dim, cfg4.longrope, cfg4.rope_theta) == (cfg.rotary_dim, cfg.longrope, 1e4)


def test_phi3_rotary_frequencies_and_scale_are_transformers_own():
    for name in ("phi3_partial_longrope", "phi3_window_48"):
        rotary, reference = _config(name, 48).rotary_in_model(), _model(name).model.rotary_emb
        np.testing.assert_allclose(rotary.inv_freq, reference.inv_freq.numpy(), rtol=1e-6)
        assert rotary.scale == pytest.approx(reference.attention_scaling, rel=1e-6)
    assert _config("phi3_partial_longrope", 48).rotary_in_model().scale > 1.1  # sqrt(1 + ln 4 / ln 64)


def test_phi3_refusals_name_the_field():
    name = "phi3_partial_longrope"
    rope = _hf(name)["rope_parameters"]
    _refused(_hf(name, rope_parameters={**rope, "attention_factor": 1.2}), 64, "attention_factor")
    _refused(_hf(name, rope_parameters={**rope, "short_factor": [1.0] * 5}), 64, "short_factor", "6 positive")
    _refused(_hf(name, rope_parameters={**rope, "rope_type": "dynamic"}), 64, "'dynamic'")
    _refused(_hf(name, rope_parameters={**rope, "partial_rotary_factor": 0.7}), 64, "partial_rotary_factor 0.7")
    _refused(_hf(name, rope_parameters={**rope, "partial_rotary_factor": 1.5}), 64, "partial_rotary_factor")


def test_llama_still_refuses_partial_rotary():
    hf = {**_hf("mistral_no_window"), "model_type": "llama", "partial_rotary_factor": 0.5}
    _refused(hf, 64, "partial_rotary_factor")


def test_phi3_checkpoint_fused_tensors_are_read_as_they_are():
    cfg = _config("phi3_window_48", 48)
    sources = cfg.param_sources()
    assert sources["model.layers.1.self_attn.qkv_proj.weight"] == ["model.layers.1.self_attn.qkv_proj.weight"]
    assert sources["model.layers.0.mlp.gate_up_proj.weight"] == ["model.layers.0.mlp.gate_up_proj.weight"]
    names = set(_model("phi3_window_48").state_dict())
    assert {n for ns in sources.values() for n in ns} == names
    assert set(cfg.source_shapes()) == names


# name -> config changes. llama.cpp pads its context to 256 tokens and takes LongRoPE's long factors for the whole
# sequence past the original context, so the LongRoPE model gets one of 256 (of 1024) to stay on the short factors
PHI3_GGUF = {
    "phi3_window_48": {},
    "phi3_partial_longrope": dict(rope_parameters={**_LONGROPE, "original_max_position_embeddings": 256,
                                                   "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                                  max_position_embeddings=1024, original_max_position_embeddings=256),
    "phi3_window_12": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PHI3_GGUF))
def test_phi3_gguf_is_read_as_llama_cpp_writes_it(tmp_path, name):
    """A random Phi-3 written as llama.cpp's converter writes it (fused attn_qkv; gate and up in ffn_up; the rotated
    dims, the window and the original context as metadata; LongRoPE's factors as two tensors): the config read from
    it is the one its HF checkpoint gives, and compiled with `--quant gguf` its logits equal transformers' to 1e-4 over
    the prompt and 32 greedy tokens (phi3_window_12's window binds). llama.cpp, where installed, computes the same
    from the file where a window does not bind (it ignores Phi windows). Negative control: one position off."""
    from compiler.loaders import open_checkpoint

    model = _model(name, **PHI3_GGUF[name])
    context = MODELS[name][2]
    path = write_gguf(model, tmp_path / "phi3.gguf", tokenizer=True)
    with open_checkpoint(path) as ckpt:
        from_gguf = family_for(ckpt.hf_config).config_class.from_hf(ckpt.hf_config, context)
    hf = model.config.to_dict()
    from_hf = family_for(hf).config_class.from_hf(hf, context)
    assert from_gguf.longrope is not None or name != "phi3_partial_longrope"
    for field in ("rotary_dim", "longrope", "sliding_window", "head_dim", "num_key_value_heads", "rope_theta",
                  "rms_norm_eps", "tie_word_embeddings", "context_window_size", "intermediate_size"):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    compile_model(CompileOptions(str(path), "host", "gguf", str(tmp_path / "artifact"), context_window=context,
                                 progress=False, kv_dtype="f32"))
    session = Session(load_artifact(tmp_path / "artifact"))
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, GREEDY)
    prefill = _prefill(session)
    assert _rel_err(prefill, ref_prefill) < TOLERANCE
    assert _rel_err(prefill[1:], ref_prefill[:-1]) > DIFFERS
    for step, token in enumerate(ref_tokens[:-1]):
        assert _rel_err(session.decode(token), ref_decode[step]) < TOLERANCE, f"decode step {step}"
    if name != "phi3_window_12":
        from tests.helpers.reference import llama_cpp_logits

        assert _rel_err(llama_cpp_logits(path, PROMPT), ref_prefill) < 1e-2  # F32 weights; its float16 KV cache


@pytest.mark.slow
def test_longrope_past_the_original_context_takes_the_long_factors(tmp_path):
    """--context-window 128 > original_max_position_embeddings 64: every position gets the long factors, as in
    llama.cpp (its context, padded to 256, is past 64). A prompt of 80 tokens, which transformers too computes with the
    long factors, matches it to 1e-4 with 8 decode steps; a prompt of 11, which transformers computes with the short
    ones, does not (negative control), and llama.cpp from the same weights as a GGUF gives our logits there."""
    from tests.helpers.reference import llama_cpp_logits

    model = _model("phi3_partial_longrope", sliding_window=None)
    save_compilable_checkpoint(model, tmp_path / "hf")
    compile_model(CompileOptions(str(tmp_path / "hf"), "host", "q0f32", str(tmp_path / "artifact"),
                                 context_window=128, progress=False))
    session = Session(load_artifact(tmp_path / "artifact"))
    long_prompt = [(5 * i + 2) % 150 + 3 for i in range(80)]
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, long_prompt, 9)
    assert _rel_err(_prefill(session, long_prompt), ref_prefill) < TOLERANCE
    for step, token in enumerate(ref_tokens[:-1]):
        assert _rel_err(session.decode(token), ref_decode[step]) < TOLERANCE, f"decode step {step}"
    short = _prefill(session)
    _, short_factors, _ = reference_greedy(model, PROMPT, 1)
    assert _rel_err(short, short_factors) > DIFFERS
    path = write_gguf(model, tmp_path / "phi3.gguf", tokenizer=True)
    assert _rel_err(llama_cpp_logits(path, PROMPT), short) < 1e-2  # F32 weights; its float16 KV cache


def test_phi3_gguf_longrope_attention_factor_other_than_derived_is_refused(tmp_path, monkeypatch):
    import gguf

    from compiler.loaders import open_checkpoint

    write = gguf.GGUFWriter.add_rope_scaling_attn_factors
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_attn_factors", lambda w, value: write(w, value * 1.1))
    path = write_gguf(_model("phi3_partial_longrope"), tmp_path / "phi3.gguf", tokenizer=True)
    with pytest.raises(MobilecError, match="LongRoPE attention factor .* mobilec derives it"):
        open_checkpoint(path)
