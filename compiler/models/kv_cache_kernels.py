"""TVM's paged-KV-cache kernels parsed once per process and shape: TIRPagedKVCache builds about fifteen TVMScript
kernels for every module it is created in (4-7 s of a tiny model's 15-40 s compile), the same ones again for each
model of the same geometry, target and RoPE. Every later compile in the process (tests, notebooks, `tune`'s
candidates) reuses them; they are immutable TIR, so sharing them between modules is safe."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from typing import Any, Callable, Iterator

from tvm.relax.frontend.nn.llm import kv_cache
from tvm.target import Target

# The kernel factories TIRPagedKVCache.__init__ calls by their names in kv_cache's namespace.
FACTORIES = tuple(name for name in kv_cache.__all__ if inspect.isfunction(getattr(kv_cache, name)))


def _key(value: Any) -> Any:
    """A hashable stand-in for a factory's argument: a Target by its full JSON, a dict by its sorted JSON."""
    if isinstance(value, Target):
        return ("target", str(value))
    if isinstance(value, dict):
        return ("dict", json.dumps(value, sort_keys=True, default=str))
    return value


def _memoized(factory: Callable) -> Callable:
    built: dict = {}

    @functools.wraps(factory)
    def build(*args, **kwargs):
        key = (tuple(_key(a) for a in args), tuple(sorted((k, _key(v)) for k, v in kwargs.items())))
        if key not in built:
            built[key] = factory(*args, **kwargs)
        return built[key]

    return build


_MEMOIZED = {name: _memoized(getattr(kv_cache, name)) for name in FACTORIES}


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """While open, TIRPagedKVCache takes its kernels from this process's memo (kv_cache's factories, only for the
    duration: nothing else of TVM sees them)."""
    originals = {name: getattr(kv_cache, name) for name in FACTORIES}
    for name, build in _MEMOIZED.items():
        setattr(kv_cache, name, build)
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(kv_cache, name, factory)
