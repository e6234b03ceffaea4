"""InlineLetExpressions: every `Let` expression in a kernel becomes its body with the bound value substituted."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx


@tvm.transform.module_pass(opt_level=0, name="InlineLetExpressions")
class InlineLetExpressions:  # pylint: disable=too-few-public-methods
    """TVM 0.27's CommonSubexprElim mishandles `Let` expressions: on TVM's tree-attention kernel
    (`batch_tree_attn`, the KV cache's `tir_attention_prefill_with_tree_mask`) for OpenCL, whose Llama 3 RoPE
    frequency is two nested Lets (`orig_freq`, `smoothed_freq`, relax/frontend/nn/llm/position_embedding.py), it
    binds a common subexpression after its first use ("variable cse_v20 has been used before definition"), so no
    Llama-3-8B / Mistral-7B-shaped model (32 query heads over 8 KV heads) built for a phone GPU. With the values
    substituted, CSE finds the repeated frequency itself. Statement-level bindings (`T.let`) are not expressions
    and stay. Run after the schedule step, so tuning-database keys (taken before it) keep matching."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()  # the input module may still be seen by others (after_step inspection)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and _has_let(func):
                mod[gv] = tvm_ffi.structural_map(func, [(tirx.Let, _substituted)])
        return mod


def _has_let(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.Let, found.append))
    return bool(found)


def _substituted(let: tirx.Let):
    """Post-order, so the body's own Lets are already gone."""
    var, value = let.var, let.value
    return tvm_ffi.structural_map(let.body, [(tirx.Var, lambda v: value if v.same_as(var) else v)])
