"""The map of which weights each Relax VM call reads, from the compiled library's bytecode, written into the
artifact at compile time ("call_sites" in mobilec-config.json) so that `mobilec profile` can label every kernel
call by the projection it computes and the bytes it reads."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import tvm

_FUNC_LINE = re.compile(r"^@(\S+):\s*$")
_CALL_LINE = re.compile(r"^\s*call\s+(\S+)\s+in:(.*?)\s*dst:\s*(\S+)\s*$")
# The paged KV cache's attention call (every model's, compiler/models/llama.py), which runs its kernels inside it; the
# cache's other builtins (query positions) launch none.
ATTENTION_BUILTIN = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"


@dataclasses.dataclass(frozen=True)
class CallSite:
    name: str
    params: tuple[int, ...]  # indices into the artifact's parameters of the weights the call reads


def vm_call_sites(library: tvm.runtime.Module, n_params: int) -> dict[str, list[CallSite] | None]:
    """Every Relax VM function of the library: its call instructions in order, with the parameters each
    reads (followed from `vm.builtin.tuple_getitem` on the packed parameter tuple); None for a function
    with control flow, whose calls are not one fixed sequence."""
    functions: dict[str, list[CallSite] | None] = {}
    current: str | None = None
    sites: list[CallSite] | None = None
    params_reg = None
    reg_param: dict[str, int] = {}
    for line in library["as_text"]().splitlines():
        if match := _FUNC_LINE.match(line):
            current, sites, params_reg, reg_param = match[1], [], None, {}
            functions[current] = sites
            continue
        if line.startswith("@"):  # "@name packed_func;": the function table, listed after each function
            current = None
            continue
        if current is None or not line.strip() or sites is None:
            continue
        match = _CALL_LINE.match(line)
        if match is None:
            if not line.strip().startswith("ret"):
                functions[current] = sites = None  # a branch or goto
            continue
        name, args, dst = match[1], match[2].replace(",", " ").split(), match[3]
        if name == "vm.builtin.check_tuple_info" and len(args) > 1 and args[1] == f"i{n_params}":
            params_reg = args[0]
        reads = tuple(reg_param[a] for a in args if a in reg_param)
        reg_param.pop(dst, None)
        if name == "vm.builtin.tuple_getitem" and args and args[0] == params_reg and args[1].startswith("i"):
            reg_param[dst] = int(args[1][1:])
        sites.append(CallSite(name, reads))
    return functions


def library_functions(library: tvm.runtime.Module, sites: dict[str, list[CallSite] | None]) -> list[str]:
    """The names the VM calls (in `sites`, from vm_call_sites) that are compiled functions of the library
    (PrimFuncs), not VM builtins."""
    names = {site.name for calls in sites.values() if calls for site in calls}
    return sorted(n for n in names if any(m.implements_function(n) for m in library.imports))


def call_site_map(library: tvm.runtime.Module, n_params: int) -> dict[str, Any]:
    """What the artifact's config stores: per VM function its calls as [name, [parameter indices]] (None for one
    with control flow), and the names that are compiled kernels (the rest are VM builtins)."""
    sites = vm_call_sites(library, n_params)
    return {"functions": {fn: None if calls is None else [[c.name, list(c.params)] for c in calls]
                          for fn, calls in sites.items()},
            "kernels": library_functions(library, sites)}


def stored_call_sites(entry: dict[str, Any]) -> tuple[dict[str, list[CallSite] | None], set[str]]:
    """call_site_map's JSON back as (function -> CallSites, kernel names)."""
    functions = {fn: None if calls is None else [CallSite(name, tuple(params)) for name, params in calls]
                 for fn, calls in entry["functions"].items()}
    return functions, set(entry["kernels"])
