"""Gemma 3 (gemma3_text) and Gemma 2: tiny seeded random Gemma3ForCausalLM / Gemma2ForCausalLM (sliding window 8,
shorter than the sequences; Gemma 2 with capped attention scores and logits) compiled at q0f32 against transformers'
own models (eager attention), on the host and on a GPU target (PoCL), negative controls for what is Gemma's own,
and the config refusals."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers
import tvm
from click.testing import CliRunner
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode

from compiler.artifacts.artifact import load_artifact
from compiler.codegen import pipeline
from compiler.commands.cli import main
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.errors import MobilecError
from compiler.kernels.cpu_attention import SLIDING_WINDOW_ATTR
from compiler.loaders import open_checkpoint
from compiler.loaders.tokenizer import load_tokenizer
from compiler.model_import.importer import import_model
from compiler.models.gemma import Gemma2Config, Gemma3TextConfig, GemmaForCausalLM
from compiler.models.registry import family_for
from compiler.passes.replace_cpu_attention import global_symbol
from compiler.runtime.session import Session
from compiler.target.build_plan import resolve_plan
from tests.helpers.pocl_device import NEEDS_OPENCL, ON_POCL
from tests.helpers.reference import llama_cpp_logits, reference_greedy
from tests.helpers.tiny_models import build_model, random_model, save_compilable_checkpoint, write_gguf

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10, 12, 40, 41, 7, 3, 99, 100, 5, 6]


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _hf_config(name: str = "gemma3", **changes) -> dict:
    return {**build_model(name).config.to_dict(), **changes}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(name, target) -> (transformers' model, a Session of its q0f32 build), each compiled once. The GPU target runs
    on PoCL (float32: --host-target host --compute-dtype float32, a float32 cache)."""
    built = {}

    def get(name: str, target: str = "host"):
        if (name, target) not in built:
            model = build_model(name)
            root = tmp_path_factory.mktemp(name)
            save_compilable_checkpoint(model, root / "hf")
            gpu = dict(ON_POCL, kv_dtype="f32") if target != "host" else {}
            compile_model(CompileOptions(str(root / "hf"), target, "q0f32", str(root / "artifact"),
                                         context_window=64, progress=False, **gpu))
            built[name, target] = model, Session(load_artifact(root / "artifact"))
        return built[name, target]

    return get


GPU = pytest.param("android-adreno", marks=NEEDS_OPENCL)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["host", GPU])
@pytest.mark.parametrize("name", ["gemma3", "gemma2"])
def test_logits_and_32_greedy_tokens_match_transformers(compiled, name, target):
    """On the GPU: mobilec's GPU attention kernels (the window by position, the cap) and merge of states."""
    model, session = compiled(name, target)
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, 32)
    session.reset()
    assert _rel_err(session.prefill_all_logits(PROMPT), ref_prefill) < 1e-4
    for step, token in enumerate(ref_tokens[:-1]):  # the reference's tokens: a mismatch can't cascade
        assert _rel_err(session.decode(token), ref_decode[step]) < 1e-4, f"decode step {step}"
    session.reset()
    tokens = [int(np.argmax(session.prefill(PROMPT)))]
    while len(tokens) < 32:
        tokens.append(int(np.argmax(session.decode(tokens[-1]))))
    assert tokens == ref_tokens
    assert int(session.artifact.config["prefill_chunk"]) == 8  # the 20-token prompt went in 3 chunks


@pytest.mark.slow
@pytest.mark.parametrize("name, layers, config_class", [("gemma3", 2, Gemma3TextConfig), ("gemma2", 1, Gemma2Config)])
def test_every_layer_sliding_generates_as_transformers(tmp_path, name, layers, config_class):
    """Fewer layers than the sliding pattern (Gemma 3's 6, Gemma 2's 2, with its capped scores): every layer slides
    (transformers derives the layer_types). Gemma 3's compiled, then `mobilec generate` died in TVM's runtime
    (Tensor::CreateView: a cache of "mha_sliding" layers only); the window is now the attention kernels'
    (models/sliding_layers.py). Logits and 16 greedy tokens of `mobilec generate --json` against transformers; the
    negative control without the window is far off."""
    model = build_model(name, num_hidden_layers=layers, layer_types=None)
    assert model.config.layer_types == ["sliding_attention"] * layers
    gemma = GemmaForCausalLM(config_class.from_hf(model.config.to_dict(), context_window=64))
    assert gemma.kv_cache_attention() == {"attn_kind": "mha", "rope_mode": RopeMode.NONE}
    assert gemma.attention_attrs().get(SLIDING_WINDOW_ATTR) == 8
    save_compilable_checkpoint(model, tmp_path / "hf")
    compile_model(CompileOptions(str(tmp_path / "hf"), "host", "q0f32", str(tmp_path / "artifact"),
                                 context_window=64, progress=False))
    session = Session(load_artifact(tmp_path / "artifact"))
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, 16)
    assert _rel_err(session.prefill_all_logits(PROMPT), ref_prefill) < 1e-4
    for step, token in enumerate(ref_tokens[:-1]):
        assert _rel_err(session.decode(token), ref_decode[step]) < 1e-4, f"decode step {step}"
    unwindowed = build_model(name, num_hidden_layers=layers, layer_types=None, sliding_window=64)
    session.reset()
    assert _rel_err(session.prefill_all_logits(PROMPT), reference_greedy(unwindowed, PROMPT, 1)[1]) > 1e-2

    prompt = "the cat sat on the mat and the dog"
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "artifact"), "--prompt", prompt,
                                       "--max-new-tokens", "16", "--ignore-eos", "--json"])
    assert result.exit_code == 0, result.output
    ids = load_tokenizer(load_artifact(tmp_path / "artifact").tokenizer_dir).encode(prompt)
    assert json.loads(result.stdout)["token_ids"] == reference_greedy(model, ids, 16)[0]


def _reference_prefill(model) -> np.ndarray:
    return reference_greedy(model, PROMPT, 1)[1]


@pytest.mark.slow
@pytest.mark.parametrize("change", ["one_rope_base", "no_linear_scaling", "no_embedding_scale", "head_dim_scale",
                                    "no_qk_norm", "no_sliding_window"])
def test_gemma3_negative_controls_differ(compiled, change):
    """transformers' model with one of Gemma's details undone is far from ours: each detail is tested."""
    model, session = compiled("gemma3")
    session.reset()
    ours = session.prefill_all_logits(PROMPT)
    assert _rel_err(ours, _reference_prefill(model)) < 1e-4
    other = build_model("gemma3")
    with torch.no_grad():
        if change == "one_rope_base":  # the sliding layers' base for every layer
            other = _with_config(other, rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10.0},
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10.0}})
        elif change == "no_linear_scaling":
            other = _with_config(other, rope_parameters={**other.config.rope_parameters,
                                                         "full_attention": {"rope_type": "default",
                                                                            "rope_theta": 1000.0}})
        elif change == "no_sliding_window":  # every key visible in the sliding layers too
            other = _with_config(other, sliding_window=64)
        elif change == "no_embedding_scale":
            other.model.embed_tokens.embed_scale.fill_(1.0)
        elif change == "head_dim_scale":
            for layer in other.model.layers:
                layer.self_attn.scaling = other.config.head_dim ** -0.5
        elif change == "no_qk_norm":
            for layer in other.model.layers:
                layer.self_attn.q_norm.weight.fill_(0.0)  # (1 + 0): the normalization stays, the weights go
                layer.self_attn.k_norm.weight.fill_(0.0)
    assert _rel_err(ours, _reference_prefill(other)) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("change", ["attn_logit_softcapping", "final_logit_softcapping", "sliding_window"])
def test_gemma2_negative_controls_differ(compiled, change):
    """Without the attention cap, the logit cap or the window, transformers' Gemma 2 is far from ours."""
    model, session = compiled("gemma2")
    session.reset()
    ours = session.prefill_all_logits(PROMPT)
    assert _rel_err(ours, _reference_prefill(model)) < 1e-4
    other = _with_config(model, **{change: 64 if change == "sliding_window" else None})
    assert _rel_err(ours, _reference_prefill(other)) > 1e-2


def _with_config(model, **changes):
    """The same weights under a config with `changes`."""
    config = type(model.config)(**{**model.config.to_dict(), **changes})
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_gemma3_config_reads_layer_types_rope_bases_and_scale():
    cfg = Gemma3TextConfig.from_hf(_hf_config(), context_window=64)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.rope(0), cfg.rope(1)) == ((10.0, 1.0), (1000.0, 4.0))
    assert (cfg.query_pre_attn_scalar, cfg.head_dim, cfg.sliding_window) == (24, 16, 8)
    # prompts go in chunks of at most the window: the cache's ragged kernel (new tokens among themselves) has none
    assert cfg.prefill_chunk_size == 8
    assert family_for(_hf_config()).name == "gemma3_text"


def test_gemma3_older_config_fields():
    """Configs written before transformers 5: rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern."""
    hf = {k: v for k, v in _hf_config(num_hidden_layers=6).items() if k not in ("rope_parameters", "layer_types")}
    hf.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
              sliding_window_pattern=6)
    cfg = Gemma3TextConfig.from_hf(hf, context_window=64)
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (cfg.rope(0), cfg.rope(5)) == ((1e4, 1.0), (1e6, 8.0))


@pytest.mark.parametrize("changes, field", [
    (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (dict(hidden_activation="silu"), "hidden_activation"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                           "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}), "yarn"),
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_gemma3_config_refusals_name_the_field(changes, field):
    with pytest.raises(MobilecError, match=field):
        Gemma3TextConfig.from_hf(_hf_config(**changes), context_window=64)


def test_gemma3_cache_layers_are_sliding_only_where_the_window_binds():
    window_binds = GemmaForCausalLM(Gemma3TextConfig.from_hf(_hf_config(), context_window=64)).kv_cache_attention()
    assert window_binds["attn_kind"] == ["mha_sliding", "mha", "mha_sliding"]
    assert window_binds["layer_sliding_window_size"] == 8 and window_binds["rope_mode"] == RopeMode.NONE
    fits = GemmaForCausalLM(Gemma3TextConfig.from_hf(_hf_config(), context_window=8)).kv_cache_attention()
    assert fits == {"attn_kind": "mha", "rope_mode": RopeMode.NONE}
    # GPU targets: every page to the sliding layers too (kernels/gpu_attention.py), the window in the kernels
    gpu = dataclasses.replace(Gemma3TextConfig.from_hf(_hf_config(), context_window=64), sliding_pages_all=True)
    assert GemmaForCausalLM(gpu).kv_cache_attention()["layer_sliding_window_size"] == 64


@pytest.mark.parametrize("name, context", [("gemma3", 64), ("gemma2", 8)])
def test_hexagon_npu_takes_them_with_our_kernels_on_its_arm_host(tmp_path, name, context):
    """The NPU target's paged KV cache and its attention run on its ARM host: a binding window (Gemma 3) and capped
    scores (Gemma 2) are mobilec's NEON kernels there, each the one linux-arm64 gets (their numerics at 4 lanes:
    tests/kernels/test_cpu_attention.py), none TVM's (negative control). Then the NPU build goes through."""
    save_compilable_checkpoint(build_model(name), tmp_path / "hf")
    kernels = {}
    for target in ("hexagon-npu", "linux-arm64"):
        plan = resolve_plan(target, "q0f32")
        with open_checkpoint(tmp_path / "hf") as ckpt:
            imported = import_model(ckpt, plan, context).mod
        seen = {}
        pipeline.run_steps(imported, plan, lambda _i, step, mod: seen.__setitem__(step, mod))
        steps = list(seen)  # in the order they ran
        into = seen[steps[steps.index("cpu-attention") - 1]]
        before = {global_symbol(f): f for f in into.functions.values() if _is_attention(f)}
        kernels[target] = {global_symbol(f): f for f in seen["cpu-attention"].functions.values() if _is_attention(f)}
        assert before.keys() == kernels[target].keys() and len(before) >= 3
        replaced = [k for k in before if not _same(before[k], kernels[target][k])]
        assert any("sliding" in k for k in replaced) if name == "gemma3" else len(replaced) >= 3, replaced
    assert all(_same(f, kernels["linux-arm64"][k]) for k, f in kernels["hexagon-npu"].items())
    out = tmp_path / "out"
    compile_model(CompileOptions(str(tmp_path / "hf"), "hexagon-npu", "q0f32", str(out), context_window=context,
                                 progress=False))
    assert (out / "lib" / "hexagon" / "kernels.o").is_file()


def _same(a, b) -> bool:
    try:
        tvm.ir.assert_structural_equal(a, b)
    except ValueError:
        return False
    return True


def _is_attention(func) -> bool:
    symbol = global_symbol(func) or ""
    return "paged_kv" in symbol or "ragged_kv" in symbol


def test_gemma2_config():
    cfg = Gemma2Config.from_hf(_hf_config("gemma2"), context_window=64)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.rope(0), cfg.rope(1)) == ((50000.0, 1.0), (50000.0, 1.0)) and not cfg.qk_norm
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (20.0, 5.0)
    assert family_for(_hf_config("gemma2")).name == "gemma2"
    with pytest.raises(MobilecError, match="linear"):
        Gemma2Config.from_hf(_hf_config("gemma2", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e4}), 64)
    assert "self_attn.q_norm" not in " ".join(name for names in cfg.param_sources().values() for name in names)


@pytest.mark.parametrize("name, config_class", [("gemma3", Gemma3TextConfig), ("gemma2", Gemma2Config)])
def test_checkpoint_tensors_are_all_read(name, config_class):
    """Every tensor of transformers' checkpoint has its place (q/k norms and the four layer norms included)."""
    model = build_model(name)
    sources = config_class.from_hf(json.loads(json.dumps(model.config.to_dict())), 64).param_sources()
    read = {name for names in sources.values() for name in names}
    assert read == set(model.state_dict()) - {"lm_head.weight"}


# ---- GGUF files as llama.cpp's converter writes them ----

# What a GGUF can say of a Gemma: llama.cpp fixes the rest (query_pre_attn_scalar = head_dim, the sliding layers'
# RoPE base 10000, Gemma 3's five sliding layers to one global one, Gemma 2's alternation)
_GGUF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, query_pre_attn_scalar=16, sliding_window=8, max_position_embeddings=256,
                   rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=1, pad_token_id=0, attn_implementation="eager")
GGUF_MODELS = {
    "gemma3": lambda: random_model(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **_GGUF_SHAPE, num_hidden_layers=6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "gemma2": lambda: random_model(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        **_GGUF_SHAPE, num_hidden_layers=4, attn_logit_softcapping=20.0, final_logit_softcapping=5.0,
        rope_theta=10000.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GGUF_MODELS))
def test_gguf_is_read_as_llama_cpp_writes_it(tmp_path, name):
    """A random Gemma written as llama.cpp's converter writes it (norm weights stored as 1 + w, the window and
    Gemma 2's caps in metadata, the pre-MLP norm named ffn_norm): its config read back, and compiled with
    `--quant gguf` its logits equal transformers' model to 1e-4 (the prompt outgrows the window); llama.cpp, where
    installed, computes them from the same file too. Negative control: the logits one position off are far."""
    model = GGUF_MODELS[name]()
    path = write_gguf(model, tmp_path / "model.gguf", tokenizer=True)
    with open_checkpoint(path) as ckpt:
        hf = ckpt.hf_config
        assert hf["model_type"] == model.config.model_type and hf["sliding_window"] == 8
        assert hf["query_pre_attn_scalar"] == 16 and hf["head_dim"] == 16
        if name == "gemma2":
            assert (hf["attn_logit_softcapping"], hf["final_logit_softcapping"]) == (20.0, 5.0)
        norm = "model.layers.0.pre_feedforward_layernorm.weight"
        np.testing.assert_allclose(ckpt.get(norm), model.state_dict()[norm].numpy(), atol=1e-6)
    compile_model(CompileOptions(str(path), "host", "gguf", str(tmp_path / "artifact"), context_window=64,
                                 progress=False, kv_dtype="f32"))
    session = Session(load_artifact(tmp_path / "artifact"))
    session.reset()
    ours = session.prefill_all_logits(PROMPT)
    _, want, _ = reference_greedy(model, PROMPT, 1)
    assert _rel_err(ours, want) < 1e-4
    assert _rel_err(ours[1:], want[:-1]) > 0.3
    assert _rel_err(llama_cpp_logits(path, PROMPT), want) < 1e-2  # F32 weights; its float16 KV cache
