"""One validation layer (compiler/validate.py) for options and target-file values: types, ranges and known names,
the same rule (and message) for the same kind of value in every command, checked before anything expensive. Config
fields that change the model's math and are not implemented are refused naming the field. Valid values still
work (negative controls)."""

from __future__ import annotations

import json
import os
import time

import pytest
from transformers import LlamaConfig as HFLlamaConfig

from compiler import validate
from compiler.errors import MobilecError
from compiler.models.llama import LlamaConfig
from compiler.target.targets import TARGETS_DIR, load_target
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint
from tests.robustness.conftest import CONTEXT, one_line_error, run_cli, run_subprocess

# --- target files ---------------------------------------------------------------------------------------------


def _edited(tmp_path, source, old, new):
    text = (TARGETS_DIR / f"{source}.toml").read_text()
    assert old in text, old
    path = tmp_path / "edited.toml"
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.mark.parametrize("source, old, new, needle", [
    ("x86-64-v3", 'compute_dtype = "float32"', 'compute_dtype = "banana"', "'device.compute_dtype' is 'banana'"),
    ("x86-64-v3", 'default_quant = "q4f16_g32"', 'default_quant = "q3f7"', "'device.default_quant' is 'q3f7'"),
    ("linux-arm64", 'decode_activations = "int8"', 'decode_activations = "int4"',
     "'device.decode_activations' is 'int4'; valid: int16, int8"),
    ("x86-64-v3", "memory_bandwidth_gbs = 20.0", "memory_bandwidth_gbs = 0.0", "must be a positive number"),
    ("x86-64-v3", "memory_bandwidth_gbs = 20.0", "memory_bandwidth_gbs = inf", "must be a positive number"),
    ("x86-64-v3", "ram_gb = 16.0", "ram_gb = -1.0", "must be a positive number"),
    ("x86-64-v3", "max_alloc_gb = 16.0", "max_alloc_gb = 64.0", "cannot exceed the RAM"),
    ("x86-64-v3", "num-cores = 4", "num-cores = 0", "num-cores' must be at least 1"),
    ("x86-64-v3", 'mcpu = "x86-64-v3"', 'mcpu = "not-a-cpu"', "LLVM knows no CPU 'not-a-cpu'"),
    ("linux-arm64", 'mattr = ["+neon", "+dotprod"]', 'mattr = ["+neon", "+dotprd"]', "LLVM knows no feature 'dotprd'"),
    ("linux-arm64", 'mattr = ["+neon", "+dotprod"]', 'mattr = ["neon"]', "\"+feature\""),
    ("android-adreno", "ts = 2\n", "ts = 0\n", "'schedule.gemv.ts' must be at least 1"),
    ("android-adreno", "ndk_api = 28", "ndk_api = -3", "'link.ndk_api' must be at least 1"),
    ("android-adreno", "max_kernel_args = 128", "max_kernel_args = 0", "'device.max_kernel_args' must be at least 1"),
    # fields we do not read: a typo would otherwise build for a default the file did not mean
    ("x86-64-v3", "memory_bandwidth_gbs = 20.0", "memory_bandwith_gbs = 20.0", "field 'device.memory_bandwidth_gbs'"),
    ("x86-64-v3", "ram_gb = 16.0", "ram_gb = 16.0\nswap_gb = 4.0", "unknown field 'device.swap_gb'"),
    ("x86-64-v3", 'rules = "cpu"', 'rules = "cpu"\nunroll = 8', "unknown field 'schedule.unroll'"),
    ("x86-64-v3", 'name = "x86-64-v3"', 'name = "x86-64-v3"\nversion = 2', "unknown field 'version'"),
    ("linux-arm64", 'method = "cross"', 'method = "cross"\nndk_api = 28', "unknown field 'link.ndk_api'"),
    ("linux-arm64", "big_count = 4", "big_count = 4\nmid_count = 3", "unknown field 'device.cpu.mid_count'"),
    ("linux-arm64", "big_count = 4", "big_count = 0", "'device.cpu.big_count' must be at least 1"),
    ("android-adreno", "ts = 2\n", "ts = 2\ntile = 4\n", "unknown field 'schedule.gemv.tile'"),
])
def test_bad_target_file_values_are_named(tmp_path, source, old, new, needle):
    with pytest.raises(MobilecError) as err:
        load_target(_edited(tmp_path, source, old, new))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_target_file_errors_are_one_line_in_every_command(tmp_path, tiny_artifact):
    path = _edited(tmp_path, "x86-64-v3", 'compute_dtype = "float32"', 'compute_dtype = "banana"')
    for args in (["compile", "--target", path, "-o", tmp_path / "out"], ["estimate", "--target", path],
                 ["inspect", "--target", path], ["tune", "--target", path]):
        one_line_error(run_cli(args), "banana")
    assert not (tmp_path / "out").exists()


def test_shipped_targets_and_valid_values_load():
    for name in ("host", "x86-64-v3", "x86-64-v4", "linux-arm64", "android-arm64", "android-adreno", "android-mali",
                 "hexagon-npu"):
        load_target(name)


# --- options: the same rule for the same kind of value everywhere ----------------------------------------------


def _commands_taking_threads(artifact, text):
    return [["generate", artifact, "--prompt", "hi"], ["profile", artifact], ["eval", artifact, "--text", text],
            ["bench", artifact, "--prompt-len", "4", "--gen-len", "2"]]


@pytest.mark.parametrize("value, needle", [("0", "--threads must be at least 1, got 0"),
                                           ("-2", "--threads must be at least 1, got -2"),
                                           (str(validate.USABLE_CORES + 1), f"--threads must be at most {validate.USABLE_CORES}"),
                                           ("abc", "'abc' is not a valid integer")])
def test_thread_counts_have_one_rule(tiny_artifact, tmp_path, value, needle):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat")
    messages = set()
    for args in _commands_taking_threads(tiny_artifact, text):
        messages.add(one_line_error(run_cli([*args, "--threads", value]), needle).split(" (see ")[0])
    assert len(messages) == 1, messages  # word for word the same in every command


def test_tvm_num_threads_is_checked_too(tiny_artifact):
    one_line_error(run_cli(["generate", tiny_artifact, "--prompt", "hi"], env={"TVM_NUM_THREADS": "lots"}),
                   "TVM_NUM_THREADS='lots'")


@pytest.mark.parametrize("args, needle", [
    (["generate", "{a}", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "{a}", "--prompt", "hi", "--max-new-tokens", "99999999"], "--max-new-tokens must be at most"),
    (["generate", "{a}", "--prompt", "hi", "--temperature", "-1"], "--temperature must be 0 (greedy)"),
    (["generate", "{a}", "--prompt", "hi", "--temperature", "nan"], "--temperature must be 0 (greedy)"),
    (["generate", "{a}", "--prompt", "hi", "--top-p", "0"], "--top-p must be above 0 and at most 1"),
    (["generate", "{a}", "--prompt", "hi", "--top-p", "1.5"], "--top-p must be above 0 and at most 1"),
    (["generate", "{a}", "--prompt", "hi", "--seed", "-1"], "--seed must be at least 0"),
    (["generate", "{a}", "--prompt", "   "], "--prompt is empty"),
    (["bench", "{a}", "--prompt-len", "0"], "--prompt-len must be at least 1"),
    (["bench", "{a}", "--gen-len", "1"], "--gen-len must be at least 2"),
    (["bench", "{a}", "--repeat", "0"], "--repeat must be at least 1"),
    (["bench", "{a}", "--sustained", "0"], "--sustained must be a positive number of seconds"),
    (["bench", "{a}", "--sustained", "inf"], "--sustained must be a positive number of seconds"),
    (["bench", "{a}", "--session-timeout", "nan"], "--session-timeout must be a positive number of seconds"),
    (["bench", "{a}", "--session-timeout", "-5"], "--session-timeout must be a positive number of seconds"),
    (["bench", "{a}", "--device-ram-mb", "0"], "--device-ram-mb must be a positive number"),
    (["bench", "{a}", "--tracker", "127.0.0.1:9190", "--key", "my phone"], "--key must be a non-empty word"),
    (["profile", "{a}", "--steps", "0"], "--steps must be at least 1"),
    (["profile", "{a}", "--context-len", "0"], "--context-len must be at least 1"),
    (["eval", "{a}", "--text", "{t}", "--window", "1"], "--window must be at least 2"),
    (["eval", "{a}", "--text", "{t}", "--max-tokens", "0"], "--max-tokens must be at least 2"),
    (["compile", "--model", "{c}", "-o", "{o}", "--context-window", "0"], "--context-window must be at least 1"),
    (["compile", "--model", "{c}", "-o", "{o}", "--context-window", "-5"], "--context-window must be at least 1"),
    (["compile", "--model", "{c}", "-o", "{o}", "--context-window", str(2**21)], "--context-window must be at most"),
    (["estimate", "--model", "{c}", "--context-window", "0"], "--context-window must be at least 1"),
    (["inspect", "--model", "{c}", "--context-window", "0"], "--context-window must be at least 1"),
    (["tune", "--model", "{c}", "--trials", "0"], "--trials must be at least 1"),
    (["tune", "--model", "{c}", "--max-seconds", "nan"], "--max-seconds must be a positive number of seconds"),
    (["compile", "--model", "{c}", "-o", "{o}", "--quant", "q4f16_g32", "--calib-text", "{t}.missing", "--calibrate",
      "awq"],
     "--calib-text"),
    (["compile", "--model", "{c}", "--no-such-option"], "No such option"),
])
def test_bad_option_values_are_one_line_before_any_work(tiny_artifact, tiny_checkpoint, tmp_path, args, needle):
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat " * 20)
    args = [a.format(a=tiny_artifact, c=tiny_checkpoint, t=text, o=tmp_path / "out") for a in args]
    started = time.monotonic()
    one_line_error(run_cli(args), needle)
    assert time.monotonic() - started < 30  # before a model is built or a reference model loaded
    assert not (tmp_path / "out").exists()


def test_eval_checks_its_inputs_before_loading_the_reference(tiny_artifact, tmp_path, monkeypatch):
    def must_not_load(*_args, **_kwargs):
        raise AssertionError("the reference model was loaded before the inputs were checked")

    monkeypatch.setattr("compiler.runtime.evaluate.load_reference", must_not_load)
    empty, blank, latin = tmp_path / "empty.txt", tmp_path / "blank.txt", tmp_path / "latin.txt"
    empty.write_text("")
    blank.write_text(" \n\n ")
    latin.write_bytes("caf\xe9".encode("latin-1"))
    good = tmp_path / "good.txt"
    good.write_text("the cat sat on the mat " * 20)
    one_line_error(run_cli(["eval", tiny_artifact, "--text", empty]), "is empty")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", blank]), "is empty")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", latin]), "not UTF-8")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", tmp_path / "nope.txt"]), "does not exist")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", good, "--window", "0"]), "--window must be at least 2")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", good, "--reference", tmp_path / "gone"]), "not found")
    short = tmp_path / "short.txt"
    short.write_text("a")
    one_line_error(run_cli(["eval", tiny_artifact, "--text", short]), "perplexity needs at least 2")


def test_valid_values_are_accepted(tiny_artifact):
    """Negative control: the boundary values of the same rules work (in subprocesses: sizing TVM's thread pool
    pins the calling thread to that many cores, which would change what later tests in this process see)."""
    result = run_subprocess(["generate", tiny_artifact, "--prompt", "the cat", "--max-new-tokens", "3", "--threads",
                             "1", "--top-p", "1", "--temperature", "0.7", "--seed", "0", "--ignore-eos", "--json"])
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["token_ids"]) == 3
    result = run_subprocess(["generate", tiny_artifact, "--prompt", "the cat", "--max-new-tokens", "2",
                             "--threads", str(validate.USABLE_CORES), "--json"],
                            env={**os.environ, "TVM_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr


# --- model configs: what changes the math and is not implemented is refused, naming the field -----------------


def _hf_config(**extra):
    config = HFLlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, **extra).to_dict()
    return {**config, "model_type": "llama"}


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


@pytest.mark.parametrize("change, needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
      "rope_parameters": None}, "rope_scaling asks for RoPE scaling 'yarn'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters asks for RoPE "
                                                                                   "scaling 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_parameters": None}, "RoPE scaling 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
      "rope_parameters": None}, "RoPE scaling 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama4", "factor": 8.0}, "rope_parameters": None}, "RoPE scaling 'llama4'"),
    ({"rope_scaling": "llama3", "rope_parameters": None}, "RoPE scaling 'llama3'"),  # not a dict
    ({"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": None}}, "rope_parameters.low_freq_factor must be a "
                                                                    "positive number, got None"),
    ({"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"},
      "rope_parameters": None}, "rope_scaling.original_max_position_embeddings must be a positive number"),
    ({"rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 1.0}, "rope_parameters": None},
     "rope_scaling.high_freq_factor (1.0) must exceed low_freq_factor (1.0)"),
    ({"rope_scaling": {"type": "linear", "factor": 0}, "rope_parameters": None},
     "rope_scaling.factor must be a positive number, got 0"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config ('fp8')"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"head_dim": 15}, "head_dim 15 is odd"),
    ({"hidden_size": "sixty-four"}, "hidden_size must be a positive whole number"),
    ({"vocab_size": 0}, "vocab_size must be a positive whole number"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a positive number"),
    ({"max_position_embeddings": None, "rope_theta": 0}, "rope_theta must be a positive number"),
])
def test_unimplemented_or_malformed_config_fields_are_named(change, needle):
    with pytest.raises(MobilecError) as err:
        LlamaConfig.from_hf({**_hf_config(), **change})
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_qwen2_sliding_window_layers_are_read_or_refused():
    """As transformers reads them: layer_types when given, else sliding from max_window_layers on where
    use_sliding_window (and sliding_window) say so; what is malformed is one line naming the field."""
    from compiler.models.qwen2 import Qwen2Config

    base = {**_hf_config(), "model_type": "qwen2"}
    assert Qwen2Config.from_hf(base).layer_types == ("full_attention", "full_attention")
    cfg = Qwen2Config.from_hf({**base, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert (cfg.layer_types, cfg.sliding_window) == (("full_attention", "sliding_attention"), 16)
    assert Qwen2Config.from_hf({**base, "use_sliding_window": True, "sliding_window": None}).sliding_window == 0
    assert Qwen2Config.from_hf({**base, "layer_types": ["sliding_attention"] * 2, "sliding_window": 4}).layer_types == (
        "sliding_attention", "sliding_attention")
    for change, field in (({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
                          ({"use_sliding_window": "yes"}, "use_sliding_window"),
                          ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": -1},
                           "max_window_layers"),
                          ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 0}, "sliding_window")):
        with pytest.raises(MobilecError, match=field):
            Qwen2Config.from_hf({**base, **change})


def test_plain_configs_are_accepted():
    cfg = LlamaConfig.from_hf(_hf_config(rope_scaling={"rope_type": "default"}, hidden_act="silu"))
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 2)
    assert (cfg.rope_scaling, cfg.rope_scale, cfg.tvm_rope_scaling) == (None, 1, {})


@pytest.mark.parametrize("change", [
    {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},  # transformers 5
    {"rope_scaling": LLAMA3_ROPE, "rope_parameters": None, "rope_theta": 500000.0},  # transformers 4 (the Hub's)
])
def test_llama3_rope_scaling_is_read(change):
    """Llama 3.1/3.2's RoPE scaling, as either transformers writes it: TVM's rope_scaling dict for the kernels."""
    cfg = LlamaConfig.from_hf({**_hf_config(), **change})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scale == 1
    assert cfg.tvm_rope_scaling == cfg.rope_scaling == {**LLAMA3_ROPE, "original_max_position_embeddings": 64.0}


def test_linear_rope_scaling_is_read():
    """Linear scaling divides positions by its factor: TVM's rope_scale, no rope_scaling dict."""
    for change in ({"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_parameters": None},
                   {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}):
        cfg = LlamaConfig.from_hf({**_hf_config(), **change})
        assert (cfg.rope_scale, cfg.tvm_rope_scaling) == (0.25, {}), change


def test_qwen3_config():
    """Qwen3: q/k norms on, head_dim as stated (not hidden / heads), no biases unless attention_bias says so, and
    Qwen2's sliding layers."""
    from compiler.models.qwen3 import Qwen3Config

    base = {**_hf_config(), "model_type": "qwen3", "head_dim": 32, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
    cfg = Qwen3Config.from_hf(base)
    assert (cfg.qk_norm, cfg.head_dim, cfg.attention_bias, cfg.attention_out_bias) == (True, 32, False, False)
    sources = cfg.param_sources()
    assert sources["model.layers.1.self_attn.q_norm.weight"] == ["model.layers.1.self_attn.q_norm.weight"]
    assert cfg.source_shapes()["model.layers.0.self_attn.k_norm.weight"] == (32,)
    assert "model.layers.0.self_attn.q_norm.weight" not in LlamaConfig.from_hf(base).param_sources()
    sliding = Qwen3Config.from_hf({**base, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert sliding.layer_types == ("full_attention", "sliding_attention") and sliding.qk_norm


def test_yarn_checkpoint_is_refused_by_compile_before_building(tmp_path):
    """A RoPE scaling mobilec does not implement (YaRN: Qwen2.5's long-context configs) is refused in one line by
    compile and estimate, before anything is built: compiled with plain RoPE, the model would diverge from
    transformers after a few tokens. (Llama 3's is implemented: tests/test_architectures.py.)"""
    model = build_model("llama_gqa")
    ckpt = save_compilable_checkpoint(model, tmp_path / "yarn")
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "rope_theta": 50000.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    one_line_error(run_cli(["compile", "--model", ckpt, "--quant", "q0f32", "--context-window", CONTEXT,
                            "-o", tmp_path / "out"]), "rope_parameters", "yarn")
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()
    one_line_error(run_cli(["estimate", "--model", ckpt]), "yarn")
