"""TVMScript kernels parsed once: a kernel factory's PrimFunc is kept in this process and on disk (user_cache's
`kernels/`), keyed by the factory, its arguments and a fingerprint of mobilec's sources and TVM's version, so that a
later compile, in this process or another, loads it instead of parsing it again.

Parsing TVMScript was about a third of a tiny model's compile (a tiny Llama, one thread: host q4f16_g32 10 of 27 s,
android-adreno 5.6 of 15 s); loading the same kernel from its JSON takes a sixth of parsing it (integer GEMV:
0.03 against 0.2 s). A call whose arguments have no stable key (a callable, an IR object) is parsed as before. Any
change to a file of the `compiler` package or another TVM starts a new set of kept kernels; the oldest sets beyond
KEPT_SETS are deleted. A test that patches what a factory reads calls the factory itself (`factory.__wrapped__`):
through the cache it would get the unpatched kernel, or keep a patched one for every later compile."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any, Callable

import tvm
from tvm_ffi.serialization import from_json_graph_str, to_json_graph_str

from ..user_cache import cache_path, drop_older_folders, keep_file

KEPT_SETS = 8  # fingerprints kept on disk (branches a developer moves between)
_PACKAGE = Path(__file__).resolve().parent.parent
_MEMORY: dict[tuple[str, str], Any] = {}


class _NoKey(Exception):
    """An argument whose value has no stable text."""


def _text(value: Any) -> str:
    """A text that two calls share exactly when their argument values are equal."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}[{','.join(_text(v) for v in value)}]"
    if isinstance(value, dict):
        return "dict{" + ",".join(sorted(f"{_text(k)}:{_text(v)}" for k, v in value.items())) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ",".join(f"{f.name}={_text(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    if isinstance(value, tvm.target.Target):
        return f"target:{value}"  # its whole JSON
    raise _NoKey(type(value).__qualname__)


@functools.cache
def fingerprint() -> str:
    """mobilec's Python sources and TVM's version: what a kept kernel was parsed with."""
    digest = hashlib.sha256(f"tvm {tvm.__version__}\0".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def _kept_set() -> Path:
    """This fingerprint's folder (under the cache directory of the moment: tests move it), made on first use."""
    folder = cache_path("kernels", fingerprint())
    if not folder.is_dir():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            drop_older_folders(folder, KEPT_SETS - 1)
        except OSError:  # a cache that cannot be written: parse every time
            pass
    return folder


def _load(path: Path):
    try:
        # written by this TVM (the fingerprint): no need of tvm.ir.load_json's upgrade of older JSON, slower than the
        # load itself
        return from_json_graph_str(path.read_text())
    except (OSError, ValueError):  # absent, or not JSON: parse it again
        return None


def cached(factory: Callable) -> Callable:
    """`factory` (arguments -> a TVMScript PrimFunc), its results kept by argument values (on disk where the result
    is a TVM object)."""
    name = f"{factory.__module__}.{factory.__qualname__}"

    @functools.wraps(factory)
    def build(*args, **kwargs):
        try:
            key = _text((args, sorted(kwargs.items())))
        except _NoKey:
            return factory(*args, **kwargs)
        if (name, key) in _MEMORY:
            return _MEMORY[name, key]
        digest = hashlib.sha256(name.encode() + b"\0" + key.encode()).hexdigest()
        path = _kept_set() / f"{digest[:32]}.json"
        func = _load(path)
        if func is None:
            func = factory(*args, **kwargs)
            if isinstance(func, tvm.runtime.Object):
                keep_file(path, lambda tmp: Path(tmp).write_text(to_json_graph_str(func)))
        _MEMORY[name, key] = func
        return func

    return build
