"""bench/random_llama_gguf.py: the random Llama GGUF that mobilec, transformers and llama.cpp must all read alike.

The "tiny" preset (2 layers, hidden 128, SmolLM2's 49152-token vocabulary) is written once per module. Its
weights are checked against the script's own float weights (within Q4_1/Q8_0 rounding) and against gguf's
dequantization of the stored blocks (exactly); its config against the preset; its logits in mobilec (gguf scheme,
compiled), transformers and llama.cpp against each other. Negative controls: another seed, the q/k rows left in
llama.cpp's order, a truncated file, an invalid shape and an interrupted write.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

import bench.random_llama_gguf as rlg
from compiler.artifacts.artifact import load_artifact
from compiler.commands.compile_model import CompileOptions, compile_model
from compiler.loaders import open_checkpoint
from compiler.loaders.default_model import default_model_path
from compiler.loaders.tokenizer import load_tokenizer
from compiler.runtime.session import Session
from tests.helpers.assertions import assert_mobilec_error
from tests.helpers.reference import llama_cpp_logits, reference_greedy

pytestmark = pytest.mark.slow  # writes and compiles a GGUF: ~1 minute

Q = GGMLQuantizationType
SHAPE = rlg.PRESETS["tiny"]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{seed: rlg.Written} for seeds 0 and 1, each in a folder of its own (transformers loads a folder)."""
    root = tmp_path_factory.mktemp("random_llama")
    return {seed: rlg.write_random_llama_gguf(root / f"seed{seed}" / "model.gguf", SHAPE, seed=seed, label="tiny")
            for seed in (0, 1)}


@pytest.fixture(scope="module")
def path(written):
    return written[0].path


@pytest.fixture(scope="module")
def plan():
    return rlg.tensor_plan(SHAPE, vocab=49152)


@pytest.fixture(scope="module")
def reader(path):
    return GGUFReader(path)  # parsing the 49k-token vocabulary takes ~2 s: once per module


@pytest.fixture(scope="module")
def smollm2_reader():
    return GGUFReader(default_model_path())


@pytest.fixture(scope="module")
def ckpt(path):
    with open_checkpoint(path) as c:
        yield c


@pytest.fixture(scope="module")
def reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def artifact(path, tmp_path_factory):
    out = tmp_path_factory.mktemp("random_llama_artifact") / "gguf"
    compile_model(CompileOptions(str(path), "host", "gguf", str(out), context_window=64, progress=False,
                                 kv_dtype="f32"))
    return load_artifact(out)


@pytest.fixture(scope="module")
def prompt_ids(artifact):
    return load_tokenizer(artifact.tokenizer_dir).encode(PROMPT)


def _hf_rows(values: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order back to HF's, written here independently of the loader (rows per head: the
    GGUF interleaves the two rotate-half halves)."""
    return values.reshape(n_head, -1, 2, values.shape[1]).swapaxes(1, 2).reshape(values.shape)


def _quantization_bound(want: np.ndarray, qtype: Q) -> np.ndarray:
    """Largest |dequantized - float| each value may show: half a step of its 32-value block, plus fp16 rounding
    of the block's scale (and min)."""
    blocks = want.reshape(-1, 32)
    if qtype == Q.Q4_1:
        lo, step = blocks.min(1, keepdims=True), np.ptp(blocks, 1, keepdims=True) / 15
        bound = 0.5 * step + 15 * step * 2.0**-10 + np.abs(lo) * 2.0**-10
    else:
        assert qtype == Q.Q8_0
        step = np.abs(blocks).max(1, keepdims=True) / 127
        bound = 0.5 * step + 127 * step * 2.0**-10
    return np.broadcast_to(bound + 1e-7, blocks.shape).reshape(want.shape)


def _within_quantization(got: np.ndarray, want: np.ndarray, qtype: Q) -> bool:
    return bool(np.all(np.abs(got - want) <= _quantization_bound(want, qtype)))


# --- the file and the config mobilec reads ---


def test_config_matches_preset(ckpt, artifact, written, plan):
    cfg = ckpt.hf_config
    expected = {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": SHAPE.hidden,
        "intermediate_size": SHAPE.intermediate, "num_hidden_layers": SHAPE.layers,
        "num_attention_heads": SHAPE.heads, "num_key_value_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim,
        "rms_norm_eps": SHAPE.rms_eps, "rope_theta": SHAPE.rope_theta,
        "max_position_embeddings": SHAPE.context_length, "tie_word_embeddings": True, "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    assert {k: cfg[k] for k in expected} == expected
    assert "rope_scaling" not in cfg and "partial_rotary_factor" not in cfg
    assert ckpt.description == "GGUF model.gguf (Q4_1)"
    compiled = artifact.config["model"]["config"]
    assert {k: compiled[k] for k in expected if k in compiled} == {k: expected[k] for k in expected if k in compiled}
    assert written[0].n_params == sum(s.n_params for s in plan) == 6_587_008
    assert written[0].file_bytes == written[0].path.stat().st_size


def test_tensor_types_are_smollm2s_mix(reader, smollm2_reader):
    """Q8_0 embedding, Q4_1 matrices, F32 norms, no output.weight: what SmolLM2's GGUF holds, in miniature."""

    def mix(reader):
        return {(t.name.split(".")[-2] if t.name.startswith("blk.") else t.name, t.tensor_type.name)
                for t in reader.tensors}

    ours = reader
    assert mix(ours) == mix(smollm2_reader)
    assert Counter(t.tensor_type.name for t in ours.tensors) == {"Q4_1": 7 * SHAPE.layers, "F32": 2 * SHAPE.layers + 1,
                                                                 "Q8_0": 1}
    assert "output.weight" not in {t.name for t in ours.tensors}


def test_tokenizer_fields_are_smollm2s(reader, smollm2_reader):
    ours, smollm2 = reader.fields, smollm2_reader.fields
    names = [k for k in smollm2 if k.startswith("tokenizer.")]
    assert sorted(names) == sorted(k for k in ours if k.startswith("tokenizer."))
    assert len(ours["tokenizer.ggml.tokens"].data) == 49152
    for name in names:
        assert ours[name].types == smollm2[name].types, name
        assert ours[name].contents() == smollm2[name].contents(), name


# --- weights: the loader returns the generated weights, up to quantization ---


def test_loader_weights_equal_the_stored_blocks_and_the_generated_floats(ckpt, reader, plan):
    stored = {t.name: t for t in reader.tensors}
    assert sorted(ckpt.tensor_names()) == sorted(s.hf_name for s in plan)
    for spec in plan:
        got = ckpt.get(spec.hf_name)
        assert got.shape == spec.hf_shape, spec.hf_name
        t = stored[spec.gguf_name]
        assert t.tensor_type == spec.qtype, spec.gguf_name
        blocks = dequantize(np.asarray(t.data), t.tensor_type).reshape(spec.hf_shape)
        if spec.qk_heads:
            blocks = _hf_rows(blocks, spec.qk_heads)
        np.testing.assert_array_equal(got, blocks, err_msg=spec.hf_name)
        want = rlg.float_weight(spec, seed=0)
        if spec.qtype == Q.F32:
            np.testing.assert_array_equal(got, np.ones(spec.hf_shape, np.float32), err_msg=spec.hf_name)
            continue
        assert abs(float(want.std()) - rlg.STD) < 0.1 * rlg.STD and abs(float(want.mean())) < 0.1 * rlg.STD
        assert _within_quantization(got, want, spec.qtype), spec.hf_name
        # the rounding is real but small: the bound is not so loose that anything passes
        assert 0 < np.abs(got - want).max() < 0.25 * rlg.STD, spec.hf_name


def test_negative_controls_other_seed_and_unpermuted_rows_fail(ckpt, reader, plan):
    q = next(s for s in plan if s.gguf_name == "blk.0.attn_q.weight")
    embed = plan[0]
    for spec in (q, embed):
        assert not _within_quantization(ckpt.get(spec.hf_name), rlg.float_weight(spec, seed=1), spec.qtype)
    # q rows as the file stores them (llama.cpp's order) are not the generated HF rows
    raw = next(t for t in reader.tensors if t.name == q.gguf_name)
    in_file_order = dequantize(np.asarray(raw.data), raw.tensor_type).reshape(q.hf_shape)
    assert not _within_quantization(in_file_order, rlg.float_weight(q, seed=0), q.qtype)
    # seed 1 changes every weight tensor, not only the few checked above; norms stay 1
    by_name = {s.gguf_name: s for s in plan}
    for t in reader.tensors:
        other = rlg.stored_bytes(by_name[t.name], seed=1)
        same = np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), other.view(np.uint8).reshape(-1))
        assert same == (t.tensor_type == Q.F32), t.name


def test_generation_is_deterministic_and_chunking_does_not_change_it(plan):
    embed = plan[0]
    whole = rlg.float_weight(embed, seed=0)
    chunked = np.concatenate(list(rlg._float_rows(embed, 0, 1000)))
    np.testing.assert_array_equal(whole, chunked)
    q = plan[2]
    np.testing.assert_array_equal(rlg.stored_bytes(q, 0), rlg.stored_bytes(q, 0))


def test_truncated_file_fails_with_a_clear_error(path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(path.stat().st_size // 2))
    assert_mobilec_error(lambda: open_checkpoint(cut), "truncated", "cut.gguf")


# --- mobilec, transformers and llama.cpp compute the same model ---


def test_transformers_reads_the_same_weights(reference, ckpt):
    state = reference.state_dict()
    for name in ckpt.tensor_names():
        np.testing.assert_array_equal(state[name].numpy(), ckpt.get(name), err_msg=name)
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    assert reference.num_parameters() == 6_587_008


def test_mobilec_logits_match_transformers(artifact, reference, prompt_ids):
    assert json.loads((artifact.path / "mobilec-config.json").read_text())["quantization"]["name"] == "gguf"
    ref_tokens, ref_prefill, ref_decode = reference_greedy(reference, prompt_ids, 5)
    session = Session(artifact)
    session.reset()
    scale = np.abs(ref_prefill).max()
    assert np.abs(session.prefill_all_logits(prompt_ids) - ref_prefill).max() < 1e-4 * scale
    for step, token in enumerate(ref_tokens[:-1]):
        assert np.abs(session.decode(token) - ref_decode[step]).max() < 1e-4 * scale, f"decode step {step}"
    # negative control: the same prompt reversed gives clearly different logits
    session.reset()
    assert np.abs(session.prefill(prompt_ids[::-1]) - ref_prefill[-1]).max() > 1e-2 * scale


def test_llama_cpp_reads_the_same_weights(path, written, reference, prompt_ids):
    """llama.cpp quantizes activations for its Q4_1 dot products, so its logits are close, not equal."""
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab_only = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    assert vocab_only.tokenize(PROMPT.encode(), add_bos=False) == prompt_ids
    _, ref, _ = reference_greedy(reference, prompt_ids, 1)
    ours = llama_cpp_logits(path, prompt_ids)
    scale = np.abs(ref).max()
    assert ours.shape == ref.shape and np.abs(ours - ref).max() < 0.1 * scale
    for i in range(len(prompt_ids)):
        assert np.corrcoef(ours[i], ref[i])[0, 1] > 0.999, i
    # negative control: llama.cpp on the seed-1 file computes another model
    other = llama_cpp_logits(written[1].path, prompt_ids)
    assert max(np.corrcoef(other[i], ref[i])[0, 1] for i in range(len(prompt_ids))) < 0.5


# --- the script's command line ---


def test_cli_writes_atomically_and_reports(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sub" / "m.gguf"
    assert rlg.main(["-o", str(out), "--preset", "tiny", "--layers", "1", "--quiet"]) == 0
    line = capsys.readouterr().out
    n_params = sum(s.n_params for s in rlg.tensor_plan(dataclasses.replace(SHAPE, layers=1), vocab=49152))
    assert f"{out}: {n_params:,} parameters" in line and "MiB" in line
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]

    # an interrupted write leaves the old file untouched and no temporary file behind
    before = out.read_bytes()
    calls = []

    def failing(spec, seed):
        calls.append(spec)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(spec, seed)

    real = rlg.stored_bytes
    monkeypatch.setattr(rlg, "stored_bytes", failing)
    with pytest.raises(KeyboardInterrupt):
        rlg.main(["-o", str(out), "--preset", "tiny", "--seed", "5", "--quiet"])
    assert out.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("args, fragment", [
    (["--heads", "3"], "not a multiple of --heads"),
    (["--hidden", "96", "--heads", "32", "--kv-heads", "32"], "even for RoPE"),
    (["--intermediate", "100"], "multiple of 32"),
    (["--tokenizer-from", "/nonexistent.gguf"], "/nonexistent.gguf"),
])  # fmt: skip
def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys, args, fragment):
    out = tmp_path / "m.gguf"
    assert rlg.main(["-o", str(out), "--preset", "tiny", "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("random_llama_gguf.py: error: ") and err.count("\n") == 1 and fragment in err, err
    assert not any(tmp_path.iterdir())


def test_1b_preset_is_about_1_07b_parameters():
    plan = rlg.tensor_plan(rlg.PRESETS["1b"], vocab=49152)
    n = sum(s.n_params for s in plan)
    assert 1.06e9 < n < 1.08e9
    assert 0.70e9 < sum(s.nbytes for s in plan) < 0.72e9  # Q4_1 matrices + Q8_0 embedding: 680 MiB on disk



# --- the qwen3 and gemma3 architectures (q/k norms, q/k rows in HF order; Gemma's norms and windows) ---


@pytest.fixture(scope="module", params=["qwen3-tiny", "gemma3-tiny"])
def other_arch(request, tmp_path_factory):
    """(preset, path, transformers' model of it, mobilec's artifact)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    path = rlg.write_random_llama_gguf(root / "model.gguf", rlg.PRESETS[request.param], seed=0, label="tiny").path
    reference = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, dtype=torch.float32).eval()
    compile_model(CompileOptions(str(path), "host", "gguf", str(root / "gguf"), context_window=64, progress=False,
                                 kv_dtype="f32"))
    return request.param, path, reference, load_artifact(root / "gguf")


def test_other_architectures_are_read_alike_by_mobilec_transformers_and_llama_cpp(other_arch):
    """The file is a qwen3 (q/k norm tensors, the head size in attention.key_length, q/k rows unpermuted) or a
    gemma3 (its four norms a layer stored as 1 + w, a window of 8 the prompt outgrows): mobilec's logits equal
    transformers' to 1e-4 of the largest (the blocks dequantize exactly on both sides), llama.cpp's within its
    8-bit activations' error; the logits one position off are far (negative control)."""
    preset, path, reference, artifact = other_arch
    arch = rlg.PRESETS[preset].arch
    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    assert artifact.config["model"]["family"] == reference.config.model_type == model_type
    names = {t.name for t in GGUFReader(path).tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    assert (arch == "gemma3") == ("blk.0.post_ffw_norm.weight" in names)
    ids = [5, 17, 3, 29, 40, 11, 8, 200, 1000, 30000]
    _, ref, _ = reference_greedy(reference, ids, 1)
    session = Session(artifact)
    session.reset()
    ours = session.prefill_all_logits(ids)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() < 1e-4 * scale
    assert np.abs(ours[1:] - ref[:-1]).max() > 0.3 * scale
    theirs = llama_cpp_logits(path, ids)
    assert np.abs(theirs - ref).max() < 0.1 * scale
