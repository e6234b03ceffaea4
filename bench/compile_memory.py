"""Wall time and peak memory of `mobilec compile` on random checkpoints of real shapes, a table per shape x target.

Each checkpoint is written tensor by tensor (bf16 safetensors in 4 GB shards, tests/helpers/real_shapes.py), so
writing an 8B one needs no more memory than compiling it. Each compile runs in a child process; its peak
resident memory is the kernel's count for that child alone (os.wait4), and the compile's own `--json` summary
splits it by step (import, build, weights, write). Checkpoints and artifacts go under --work and are deleted
as soon as they are measured unless --keep.

    .venv/bin/python bench/compile_memory.py                                 # all shapes, host and android-adreno
    .venv/bin/python bench/compile_memory.py --shape llama-3-8b --target android-arm64 --json
    .venv/bin/python bench/compile_memory.py --shape llama-3.2-3b --calibrate awq
    .venv/bin/python bench/compile_memory.py --shape llama-3-8b --layers 4 --target host --calibrate awq

`host` compiles with --quant q4f16_g32 (its default, q0f32, would write the float32 model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.real_shapes import RELEASED_LAYERS, write_checkpoint  # noqa: E402  pylint: disable=C0413

DEFAULT_SHAPES = ("smollm2-1.7b", "llama-3.2-3b", "llama-3-8b", "qwen2.5-7b")
DEFAULT_TARGETS = ("host", "android-adreno")
GIB = 1 << 30


def measured(command: list[str], work: Path) -> tuple[subprocess.CompletedProcess, float, int]:
    """(the finished process, its wall seconds, its peak resident bytes: this child's alone, from wait4)."""
    start = time.perf_counter()
    with open(work / "stdout", "w+") as out, open(work / "stderr", "w+") as err:
        pid = subprocess.Popen(command, stdout=out, stderr=err).pid  # pylint: disable=consider-using-with
        _, status, usage = os.wait4(pid, 0)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), out.read(), err.read())
    return done, seconds, usage.ru_maxrss * 1024


def compile_row(checkpoint: Path, target: str, calibrate: str | None, work: Path) -> dict:
    out = work / f"art-{target}"
    command = [sys.executable, "-m", "compiler", "compile", "--model", str(checkpoint), "--target", target,
               "-o", str(out), "--json", *(["--quant", "q4f16_g32"] if target == "host" else []),
               *(["--calibrate", calibrate] if calibrate else [])]
    done, seconds, peak = measured(command, work)
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode != 0:
        return {"target": target, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "?"}
    summary = json.loads(done.stdout)
    return {"target": target, "calibrate": calibrate, "wall_s": round(seconds, 1), "peak_rss_bytes": peak,
            "steps": {name: {"seconds": s["seconds"], "peak_rss_bytes": s["peak_rss_bytes"]}
                      for name, s in summary["steps"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--shape", action="append", choices=sorted(RELEASED_LAYERS), help="repeatable (default: %s)"
                        % ", ".join(DEFAULT_SHAPES))
    parser.add_argument("--target", action="append", help="repeatable (default: %s)" % ", ".join(DEFAULT_TARGETS))
    parser.add_argument("--calibrate", choices=["awq"], help="also compile with --calibrate (first target only)")
    # --calibrate's peak is one decoder layer's and its time grows with the layers: a few layers measure both
    parser.add_argument("--layers", type=int, help="decoder layers (default: the released model's)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "compile-memory")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    shapes, targets = args.shape or list(DEFAULT_SHAPES), args.target or list(DEFAULT_TARGETS)
    rows = []
    for shape in shapes:
        work = args.work / (shape + (f"-{args.layers}-layers" if args.layers else ""))
        checkpoint = work / "checkpoint"
        start = time.perf_counter()
        if not (checkpoint / "model.safetensors.index.json").is_file():
            write_checkpoint(shape, checkpoint, args.layers)
        written = time.perf_counter() - start
        size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        runs = [compile_row(checkpoint, t, None, work) for t in targets]
        if args.calibrate:
            runs.append(compile_row(checkpoint, targets[0], args.calibrate, work))
        rows.append({"shape": shape, "layers": args.layers or RELEASED_LAYERS[shape], "checkpoint_bytes": size,
                     "write_s": round(written, 1), "compiles": runs})
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        if not args.json:
            print_rows(rows[-1:])
    if args.json:
        print(json.dumps({"rows": rows}))


def print_rows(rows: list[dict]) -> None:
    for row in rows:
        print(f"{row['shape']} ({row['layers']} layers): checkpoint {row['checkpoint_bytes'] / GIB:.1f} GiB "
              f"(written in {row['write_s']} s)")
        for c in row["compiles"]:
            if "error" in c:
                print(f"  {c['target']:16s} failed: {c['error']}")
                continue
            steps = "  ".join(f"{name} {s['seconds']:.0f} s/{s['peak_rss_bytes'] / GIB:.2f} GiB"
                              for name, s in c["steps"].items())
            label = c["target"] + (f" --calibrate {c['calibrate']}" if c["calibrate"] else "")
            print(f"  {label:28s} wall {c['wall_s']:7.1f} s  peak {c['peak_rss_bytes'] / GIB:5.2f} GiB  ({steps})")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
