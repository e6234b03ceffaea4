"""The models users bring beyond SmolLM2's plain Llama: Llama 3.x RoPE scaling (rope_type llama3, and linear) and
Qwen3 (per-head q/k RMSNorm, head_dim apart from hidden / heads), as tiny seeded random transformers models
(tests/helpers/tiny_models.py ARCHITECTURE_SPECS) compiled for the host and compared with transformers over a
prompt long enough for the scaling to matter (90 tokens, where llama3_rope's scaled wavelengths of 94 tokens and
more have turned) and 32 greedy tokens; negative controls: the same checkpoint compiled with plain RoPE, Qwen3's
q/k norm weights swapped. Float16 and int8 KV caches, and a quantized scheme, against their own references."""

import json
import shutil

import numpy as np
import pytest
import torch
import tvm

from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.kernels.cpu_attention import DECODE_SYMBOL, PAGED_PREFILL_SYMBOL, RAGGED_SYMBOL
from compiler.model_import.importer import import_model, open_model
from compiler.passes.replace_cpu_attention import ReplaceCPUAttention
from compiler.quantization.schemes import SCHEMES
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from tests.helpers.reference import fake_quantized, kv_fake_quantized, reference_greedy
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint

# the tests that compile (a compile per model and cache: 8, ~1 minute each on 2 cores)
slow = pytest.mark.slow

PROMPT_LEN, GREEDY = 90, 32
CONTEXT = 128  # prompt + greedy tokens


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _prompt(model) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, PROMPT_LEN)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its HF directory), each written once."""
    made = {}

    def get(name: str):
        if name not in made:
            model = build_model(name)
            made[name] = model, save_compilable_checkpoint(model, tmp_path_factory.mktemp(name) / "hf")
        return made[name]

    return get


def _compile(hf, out, quant: str = "q0f32", kv: str = "f32") -> Session:
    compile_model(CompileOptions(str(hf), "host", quant, str(out), context_window=CONTEXT, progress=False,
                                 kv_dtype=kv))
    return Session(load_artifact(out))


def _greedy(session: Session, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Our own greedy continuation: its tokens, and the logits of the prompt, then after each decoded token."""
    session.reset()
    logits = [session.prefill_all_logits(prompt)]
    tokens = [int(logits[0][-1].argmax())]
    for _ in range(GREEDY - 1):
        logits.append(session.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def _along_reference(session: Session, prompt: list[int], ref_tokens: list[int]) -> list[np.ndarray]:
    """The logits of the prompt, then after each of the reference's tokens (a difference cannot cascade)."""
    session.reset()
    return [session.prefill_all_logits(prompt)] + [session.decode(t) for t in ref_tokens[:-1]]


def _assert_matches_transformers(session: Session, model, tol: float = 1e-4) -> list[np.ndarray]:
    """The same 32 greedy tokens as transformers, every logit within `tol` of its largest; returns our logits."""
    prompt = _prompt(model)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, prompt, GREEDY)
    tokens, logits = _greedy(session, prompt)
    assert tokens == ref_tokens
    errors = [_rel_err(got, want) for got, want in zip(logits, [ref_prefill, *ref_decode])]
    assert max(errors) < tol, errors
    return logits


def _plain_rope_twin(model):
    """The same weights with plain RoPE (transformers' default rope_type)."""
    config = model.config.to_dict()
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    twin = type(model)(type(model.config).from_dict(config)).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def _plain_rope_checkpoint(hf, out):
    """A copy of the HF directory `hf` whose config asks for plain RoPE."""
    shutil.copytree(hf, out)
    config = json.loads((out / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


# ---------------------------------------------------------------- Llama 3.x RoPE scaling


# TVM's kernels that apply RoPE, by the global symbol the KV cache adds them with (a suffix: _cpu, _sliding_window)
ROPE_KERNELS = ("fused_rope", "batch_decode_paged_kv", "batch_prefill_paged_kv", "batch_prefill_ragged_kv",
                "batch_tree_attn", "tree_attn_paged_kv")


@pytest.mark.parametrize("target", ["host", "android-adreno"])
def test_every_kernel_applying_rope_gets_the_llama3_scaling(checkpoints, tmp_path, target):
    """The exported module of a Llama 3.x model for a CPU and a GPU target: exactly the kernels that apply RoPE
    (the split kernel of RopeMode.NORMAL, and TVM's inline-RoPE paths of decode, prefill and tree attention) differ
    from the plain-RoPE build's, each holding Llama 3's 1 / factor. On the CPU target, after ReplaceCPUAttention,
    our decode and prefill kernels have no RoPE (they read K stored after it): the same in both builds."""
    _, hf = checkpoints("llama3_rope")
    mods = {}
    for name, path in (("llama3", hf), ("plain", _plain_rope_checkpoint(hf, tmp_path / "plain"))):
        with open_model(str(path)) as ckpt:
            mods[name] = import_model(ckpt, resolve_plan(target, "q0f32"), 64).mod
    lanes = resolve_plan(target).attention_lanes
    ours = {DECODE_SYMBOL, PAGED_PREFILL_SYMBOL, RAGGED_SYMBOL} if lanes is not None else set()
    if lanes is not None:
        mods = {name: ReplaceCPUAttention(lanes)(mod) for name, mod in mods.items()}
    changed = set()
    for gv, func in mods["llama3"].functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            try:
                tvm.ir.assert_structural_equal(func, mods["plain"][gv.name_hint])
            except ValueError:
                changed.add(str(func.attrs["global_symbol"]))
                assert "T.float32(0.125)" in func.script(), gv.name_hint  # 1 / factor
    assert {s for s in changed if not s.startswith(ROPE_KERNELS)} == set(), changed
    assert not changed & ours, changed
    for kernel in ROPE_KERNELS:  # on CPU TVM's sliding-window variants stay (the model has no sliding layers)
        assert kernel in ours or any(s.startswith(kernel) for s in changed), (kernel, changed)




@pytest.fixture(scope="module")
def llama3(checkpoints, tmp_path_factory):
    model, hf = checkpoints("llama3_rope")
    return model, hf, _compile(hf, tmp_path_factory.mktemp("llama3") / "q0f32")


@slow
def test_llama3_rope_matches_transformers(llama3):
    model, _, session = llama3
    logits = _assert_matches_transformers(session, model)
    config = json.loads((session.artifact.path / CONFIG_FILE).read_text())["model"]["config"]
    assert config["rope_scaling"]["rope_type"] == "llama3"
    # the scaling matters on this prompt: transformers' own plain-RoPE twin is far from it
    with torch.inference_mode():
        plain = _plain_rope_twin(model)(torch.tensor([_prompt(model)])).logits[0].numpy()
    assert _rel_err(plain, logits[0]) > 1e-2
    # a chunked prefill (ragged + paged prefill kernels, RoPE at page offsets) gives the same logits
    session.reset()
    session.prefill_chunk = 16
    try:
        chunked = session.prefill_all_logits(_prompt(model))
    finally:
        session.prefill_chunk = int(session.artifact.config["prefill_chunk"])
    assert _rel_err(chunked, logits[0]) < 1e-5


@slow
def test_negative_control_llama3_checkpoint_built_with_plain_rope_diverges(llama3, tmp_path):
    """The same checkpoint with rope_scaling taken out of its config: the build differs from transformers' Llama 3
    model and equals transformers' plain-RoPE twin, so the test above sees the scaling and nothing else."""
    model, hf, _ = llama3
    session = _compile(_plain_rope_checkpoint(hf, tmp_path / "plain"), tmp_path / "out")
    prompt = _prompt(model)
    _, ref_prefill, _ = reference_greedy(model, prompt, 1)
    session.reset()
    prefill = session.prefill_all_logits(prompt)
    assert _rel_err(prefill, ref_prefill) > 1e-2
    _, twin_prefill, _ = reference_greedy(_plain_rope_twin(model), prompt, 1)
    assert _rel_err(prefill, twin_prefill) < 1e-4


@slow
def test_llama3_rope_quantized_matches_its_numpy_twin(llama3, tmp_path):
    """q4f16_g32 weights (float32 KV cache) against transformers running numpy's quantize-dequantize of the same
    weights: the prefill within 1e-4 (tests/quantization/test_quantized_models.py's tolerance), 8 decode steps
    within 5e-4 (decode's GEMVs take int16-quantized activations on integer-dot CPUs, --decode-activations: here
    up to 2e-4)."""
    model, hf, _ = llama3
    session = _compile(hf, tmp_path / "q4", "q4f16_g32")
    twin = fake_quantized(model, SCHEMES["q4f16_g32"].layout)
    prompt = _prompt(model)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(twin, prompt, 9)
    logits = _along_reference(session, prompt, ref_tokens)
    errors = [_rel_err(got, want) for got, want in zip(logits, [ref_prefill, *ref_decode])]
    assert errors[0] < 1e-4 and max(errors) < 5e-4, errors


@slow
@pytest.mark.extended  # in part: the int8 cache with plain RoPE: test_kv_cache_dtype
def test_llama3_rope_int8_cache_matches_its_quantized_twin(llama3, tmp_path):
    """An int8 KV cache: our split kernel applies Llama 3's scaled RoPE before quantizing K. Within 1e-4 of
    transformers with K (after RoPE) and V quantized the same way (float32 RoPE computed in another order moves
    a K value across a rounding boundary now and then over 90 tokens: 3e-5 here; plain RoPE would be 1e-1 off),
    within 6e-2 of the float model (test_kv_cache_dtype.py's bound for this random model's int8 error)."""
    model, hf, _ = llama3
    session = _compile(hf, tmp_path / "int8", kv="int8")
    prompt = _prompt(model)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, prompt, 9)
    _, quant_prefill, quant_decode = reference_greedy(kv_fake_quantized(model, "int8"), prompt, 9)
    logits = _along_reference(session, prompt, ref_tokens)
    to_quantized = [_rel_err(got, want) for got, want in zip(logits, [quant_prefill, *quant_decode])]
    assert max(to_quantized) < 1e-4, to_quantized
    to_float = [_rel_err(got, want) for got, want in zip(logits, [ref_prefill, *ref_decode])]
    assert 1e-4 < max(to_float) < 6e-2, to_float


@slow
def test_linear_rope_matches_transformers(checkpoints, tmp_path):
    """Linear RoPE scaling (positions / factor: TVM's rope_scale)."""
    model, hf = checkpoints("llama_linear_rope")
    logits = _assert_matches_transformers(_compile(hf, tmp_path / "q0f32"), model)
    with torch.inference_mode():
        plain = _plain_rope_twin(model)(torch.tensor([_prompt(model)])).logits[0].numpy()
    assert _rel_err(plain, logits[0]) > 1e-2


# ---------------------------------------------------------------- Qwen3


@pytest.fixture(scope="module")
def qwen3(checkpoints, tmp_path_factory):
    model, hf = checkpoints("qwen3")
    return model, hf, _compile(hf, tmp_path_factory.mktemp("qwen3") / "q0f32")


@slow
def test_qwen3_matches_transformers(qwen3):
    model, _, session = qwen3
    _assert_matches_transformers(session, model)
    config = json.loads((session.artifact.path / CONFIG_FILE).read_text())
    assert config["model"]["family"] == "qwen3" and config["model"]["config"]["qk_norm"]
    names = {t["name"] for t in session.artifact.index["tensors"]}
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= names
    assert not any(name.startswith("lm_head") for name in names)  # tied


@slow
def test_negative_control_qwen3_norm_weights_are_used(qwen3):
    """q_norm's and k_norm's weights exchanged in the loaded parameters (the same shape): the logits move."""
    model, _, session = qwen3
    prompt = _prompt(model)
    _, ref_prefill, _ = reference_greedy(model, prompt, 1)
    names = [t["name"] for t in session.artifact.index["tensors"]]
    q, k = (session.params[names.index(f"model.layers.0.self_attn.{x}_norm.weight")] for x in "qk")
    q_values, k_values = q.numpy(), k.numpy()
    try:
        q.copyfrom(k_values)
        k.copyfrom(q_values)
        session.reset()
        assert _rel_err(session.prefill_all_logits(prompt), ref_prefill) > 1e-2
    finally:
        q.copyfrom(q_values)
        k.copyfrom(k_values)
    session.reset()
    assert _rel_err(session.prefill_all_logits(prompt), ref_prefill) < 1e-4


@slow
@pytest.mark.extended  # in part: the float16 cache: test_kv_cache_dtype; qwen3: test_qwen3_matches_transformers
def test_qwen3_float16_cache(qwen3, tmp_path):
    """--kv-dtype f16 (q/k/v cast after the norms): within 5e-3 of transformers (test_kv_cache_dtype.py's bound),
    and greedy-equal on at least 30 of 32 steps."""
    model, hf, _ = qwen3
    session = _compile(hf, tmp_path / "f16", kv="f16")
    prompt = _prompt(model)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, prompt, GREEDY)
    logits = _along_reference(session, prompt, ref_tokens)
    errors = [_rel_err(got, want) for got, want in zip(logits, [ref_prefill, *ref_decode])]
    assert 1e-6 < max(errors) < 5e-3, errors  # (and not exact: the float16 cache is used)
    ours = [int(logits[0][-1].argmax())] + [int(step.argmax()) for step in logits[1:]]
    assert sum(a == b for a, b in zip(ours, ref_tokens)) >= 30, (ours, ref_tokens)


@slow
@pytest.mark.extended  # in part: the int8 cache: test_kv_cache_dtype; qwen3: test_qwen3_matches_transformers
def test_qwen3_int8_cache(qwen3, tmp_path):
    """--kv-dtype int8: K quantized after q_norm/k_norm and RoPE, within 1e-4 of transformers quantizing K and V
    the same way, within 6e-2 of the float model."""
    model, hf, _ = qwen3
    session = _compile(hf, tmp_path / "int8", kv="int8")
    prompt = _prompt(model)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, prompt, 9)
    _, quant_prefill, quant_decode = reference_greedy(kv_fake_quantized(model, "int8"), prompt, 9)
    logits = _along_reference(session, prompt, ref_tokens)
    to_quantized = [_rel_err(got, want) for got, want in zip(logits, [quant_prefill, *quant_decode])]
    assert max(to_quantized) < 1e-4, to_quantized
    to_float = [_rel_err(got, want) for got, want in zip(logits, [ref_prefill, *ref_decode])]
    assert 1e-4 < max(to_float) < 6e-2, to_float
