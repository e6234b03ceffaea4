"""mobilec: compiles a Hugging Face LLM into a library for phones, edge boards and CPUs (see README.md)."""

import os

# TVM's thread-pool workers wait for work by calling sched_yield() TVM_THREAD_POOL_SPIN_COUNT times (default
# 300000) before they sleep, and see the pool's exit signal only after that. On a busy machine every yield gives the
# core away for a time slice, so a process running 2+ threads hung for minutes when it exited or resized its pool
# (measured: `generate --threads 2` beside three busy processes on 2 cores, >60 s every time). 1000 yields (~1 ms
# idle) still span the gaps between kernels and decode steps: decode tok/s at 2 threads unchanged within noise.
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "1000")
