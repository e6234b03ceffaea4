"""TVM's paged-KV-cache kernels parsed once per shape (kernels/parse_cache.py: kept in the process and on disk):
TIRPagedKVCache builds about fifteen TVMScript kernels for every module it is created in (4-7 s of a tiny model's
15-40 s compile), the same ones again for each model of the same geometry, target and RoPE. Every later compile
(tests, notebooks, `tune`'s candidates, another `mobilec compile`) reuses them; they are immutable TIR, so sharing
them between modules is safe."""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

from tvm.relax.frontend.nn.llm import kv_cache

from ..kernels import parse_cache

# The kernel factories TIRPagedKVCache.__init__ calls by their names in kv_cache's namespace.
FACTORIES = tuple(name for name in kv_cache.__all__ if inspect.isfunction(getattr(kv_cache, name)))


_MEMOIZED = {name: parse_cache.cached(getattr(kv_cache, name)) for name in FACTORIES}


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """While open, TIRPagedKVCache takes its kernels from parse_cache (kv_cache's factories, only for the duration:
    nothing else of TVM sees them)."""
    originals = {name: getattr(kv_cache, name) for name in FACTORIES}
    for name, build in _MEMOIZED.items():
        setattr(kv_cache, name, build)
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(kv_cache, name, factory)
