"""A tiny random Llama stored as GGUF K-quants, the way a Q4_K_M / Q5_K_M file mixes them (Q4_K embedding, Q6_K
output, q/k Q4_K joined with a Q6_K v, Q5_K layers), compiled with `--quant gguf`: the loader's weights equal
gguf's dequantization, and the compiled model computes what transformers computes from the same GGUF (transformers
dequantizes K-quants with gguf): logits to float32 tolerance, 32 greedy tokens equal. Where llama-cpp-python is
installed (not in CI: that test skips), llama.cpp's reading of the same file is compared too, at the tolerance its
8-bit activations allow."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from transformers import LlamaConfig, LlamaForCausalLM

from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.loaders import open_checkpoint
from compiler.runtime.bench import prompt_ids
from compiler.runtime.session import Session
from tests.helpers import k_quants
from tests.helpers.reference import llama_cpp_logits, reference_greedy
from tests.helpers.tiny_models import write_gguf
from tests.targets.test_smollm2_on_emulated_arm import _bench_on_device

pytestmark = pytest.mark.slow  # writes and compiles a GGUF: ~1 minute

Q = GGMLQuantizationType
# K-quant rows are whole 256-value super-blocks: hidden and intermediate sizes are multiples of 256
CONFIG = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-5,
              rope_theta=50000.0)
TYPES = {
    "token_embd.weight": Q.Q4_K,  # an embedding lookup of a K-quant table
    "output.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,  # joined, mixed
    "blk.0.attn_output.weight": Q.Q4_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q5_K, "blk.1.attn_k.weight": Q.Q5_K, "blk.1.attn_v.weight": Q.Q5_K,
    "blk.1.attn_output.weight": Q.Q5_K, "blk.1.ffn_gate.weight": Q.Q4_K, "blk.1.ffn_up.weight": Q.Q4_K,
    "blk.1.ffn_down.weight": Q.Q4_K,
}  # fmt: skip
PROMPT = [5, 17, 3, 29, 40, 11, 8, 200]


def write_k_quant_llama(path, std: float = 0.5):
    """The tiny Llama of CONFIG, weights std * N(0, 1) (seed 0), written to `path` as a GGUF of TYPES' K-quants."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * std)

    def quantize(name: str, data: np.ndarray):
        qtype = TYPES.get(name)
        return None if qtype is None else (qtype, k_quants.quantize(data, qtype))

    return write_gguf(model, path, tokenizer=True, quantize=quantize)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_k_quant_llama(tmp_path_factory.mktemp("k_quant_llama") / "model.gguf")


@pytest.fixture(scope="module")
def reference(path):
    return LlamaForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def artifact(path, tmp_path_factory):
    out = tmp_path_factory.mktemp("k_quant_artifact") / "gguf"
    compile_model(CompileOptions(str(path), "host", "gguf", str(out), context_window=64, progress=False,
                                 kv_dtype="f32"))
    return load_artifact(out)


def test_file_holds_the_planned_k_quants(path):
    stored = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert {name: stored[name] for name in TYPES} == TYPES
    assert {t for name, t in stored.items() if name not in TYPES} == {Q.F32}  # the norms


def test_loader_and_transformers_read_gguf_values(path, reference):
    """The loader's float path (any scheme) and transformers both give gguf's dequantized K-quant values."""
    reader = {t.name: t for t in GGUFReader(path).tensors}
    state = reference.state_dict()
    with open_checkpoint(path) as ckpt:
        embed = reader["token_embd.weight"]
        want = dequantize(np.asarray(embed.data), embed.tensor_type).reshape(CONFIG["vocab_size"], -1)
        np.testing.assert_array_equal(ckpt.get("model.embed_tokens.weight"), want)
        assert ckpt.get_gguf_blocks("model.layers.0.self_attn.v_proj.weight")[0] == "Q6_K"
        for name in ckpt.tensor_names():
            np.testing.assert_array_equal(state[name].numpy(), ckpt.get(name), err_msg=name)


def test_compiled_k_quants_match_transformers_for_32_greedy_tokens(artifact, reference):
    ref_tokens, ref_prefill, ref_decode = reference_greedy(reference, PROMPT, 32)
    session = Session(artifact)
    session.reset()
    scale = np.abs(ref_prefill).max()
    assert np.abs(session.prefill_all_logits(PROMPT) - ref_prefill).max() < 1e-4 * scale
    session.reset()
    tokens = [int(np.argmax(session.prefill(PROMPT)))]
    for step in range(31):
        logits = session.decode(tokens[-1])
        # decode GEMVs quantize activations to int16 per 32 values (~2e-5 each, integer_dot_gemv); chained through
        # this model's 0.5-std random weights they reach ~2e-4 of the logits' scale (prefill, float: 1e-4)
        assert np.abs(logits - ref_decode[step]).max() < 1e-3 * scale, f"decode step {step}"
        tokens.append(int(np.argmax(logits)))
    assert tokens == ref_tokens
    assert len(set(tokens)) > 3  # not a degenerate repetition that any model would produce
    # negative control: the prompt reversed gives clearly different logits
    session.reset()
    assert np.abs(session.prefill(PROMPT[::-1]) - ref_prefill[-1]).max() > 1e-2 * scale


def test_k_quant_layers_keep_their_layouts_and_decode_on_integer_dot_gemvs(artifact):
    """Float32 scales per sub-block (Q4_K int4 g32 and Q5_K int8 g32 with mins, Q6_K int8 g16 about code 32, the
    mixed q/k/v int8 g16 with mins); their decode GEMVs are the integer-dot kernels on a CPU that has them."""
    shapes = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in artifact.index["tensors"]}
    hidden = CONFIG["hidden_size"]
    assert shapes["model.layers.0.mlp.gate_up_proj.q_scale"] == ((2 * CONFIG["intermediate_size"], hidden // 32),
                                                                   "float32")
    assert shapes["model.layers.0.self_attn.qkv_proj.q_weight"][0][1] == hidden  # widened to 8-bit codes
    assert shapes["model.layers.0.self_attn.qkv_proj.q_min"][0][1] == hidden // 16
    assert shapes["model.layers.1.self_attn.qkv_proj.q_scale"][0][1] == hidden // 32
    assert shapes["lm_head.q_scale"][0] == (CONFIG["vocab_size"], hidden // 16) and "lm_head.q_min" not in shapes
    if artifact.config["decode_activations"] is not None:  # this CPU has an integer-dot family
        symbols = artifact.library.read_bytes()
        assert b"integer_dot_gemv_int4_g32_asym_float32_" in symbols
        assert b"integer_dot_gemv_int8_g32_asym_float32_" in symbols
        assert b"integer_dot_gemv_int8_g16_sym_float32_" in symbols  # Q6_K
        assert b"integer_dot_gemv_int8_g16_asym_float32_" in symbols  # Q4_K q/k joined with a Q6_K v


def test_linux_arm64_build_decodes_k_quants_with_sdot_on_the_emulated_device(path, reference, emulated_arm_device,
                                                                              tmp_path):
    """linux-arm64 (dotprod): every K-quant layer decodes on the aarch64 integer GEMVs (Q5_K's 8-bit asymmetric
    codes centred for `sdot`, the 128 joining each step's mins; Q6_K's 16-value groups a block per step), benched
    through the tracker on the emulated arm64 device: its greedy tokens are transformers' from the same file. int16
    activations (the target's default is int8, llama.cpp's rounding, which moves this random model's flat logits)."""
    arm = tmp_path / "arm64"
    compile_model(CompileOptions(str(path), "linux-arm64", "gguf", str(arm), context_window=64, progress=False,
                                 kv_dtype="f32", decode_activations="int16"))
    symbols = load_artifact(arm).library.read_bytes()
    assert b"integer_dot_gemv_int8_g32_asym_float32_a16_dotprod_" in symbols  # Q5_K
    assert b"integer_dot_gemv_int4_g32_asym_float32_a16_dotprod_" in symbols  # Q4_K
    assert b"integer_dot_gemv_int8_g16_sym_float32_a16_dotprod_" in symbols  # Q6_K: a block per step
    assert b"integer_dot_gemv_int8_g16_asym_float32_a16_dotprod_" in symbols  # Q4_K q/k joined with a Q6_K v
    result = _bench_on_device(arm, emulated_arm_device, 16, session_timeout=600)
    prompt = prompt_ids(CONFIG["vocab_size"], result["prompt_len"], result["prompt_seed"])
    ref_tokens = reference_greedy(reference, [int(t) for t in prompt], 16)[0]
    assert result["tokens"] == ref_tokens and len(set(ref_tokens)) > 3


# llama.cpp's K-quant dot products round the activations to 8 bits (Q8_K): on this model (weights 0.5 N(0, 1), large
# activations) its prompt logits are 4-11% of the largest logit off transformers' reading of the same file (the same
# model stored as F32: 0.04-0.2%, llama.cpp's float16 KV cache), enough to change greedy tokens after the first
LLAMA_CPP_TOLERANCE = 0.2


def test_llama_cpp_reads_the_same_model(path, reference):
    """llama.cpp's own reader and kernels on the file we wrote: every prompt position's logits within
    LLAMA_CPP_TOLERANCE of transformers' (relative to the largest), the first greedy token the same; a block
    layout misread would be off by the whole logit range, as the negative control (positions shifted by one) is."""
    got = llama_cpp_logits(path, PROMPT)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0].numpy()
    errors = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert errors.max() < LLAMA_CPP_TOLERANCE, errors
    assert got[-1].argmax() == want[-1].argmax()
    shifted = np.abs(got[1:] - want[:-1]).max(axis=1) / np.abs(want[:-1]).max(axis=1)
    assert shifted.min() > 2 * LLAMA_CPP_TOLERANCE, shifted
