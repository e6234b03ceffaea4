"""FuseDequantizeMatmul: fuse call_tir(dequantize*) into the call_tir(NT_matmul*) that consumes it as its weight."""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import GlobalVarPattern, is_op, is_tuple, wildcard

# relay/relax OpPatternKind::kOutEWiseFusable: FuseOps still fuses bias/residual adds into the fused kernel.
_OUT_EWISE_FUSABLE = 4


def _call_tir(name_part: str, args) -> relax.dpl.DFPattern:
    # GlobalVarPattern matches a substring of the callee's name; `_check` pins the prefix.
    return is_op("relax.call_tir")(GlobalVarPattern(name_part), args, add_constraint=False)


_DEQUANTIZE = _call_tir("dequantize", wildcard())
_MATMUL = _call_tir("NT_matmul", is_tuple([wildcard(), _DEQUANTIZE]))


def _callee(call: relax.Call) -> str:
    return call.args[0].name_hint


def _check(ctx: relax.transform.PatternCheckContext) -> bool:
    dequantize = ctx.annotated_expr["dequantize"]
    matmul = ctx.annotated_expr["matmul"]
    if not _callee(dequantize).startswith("dequantize") or not _callee(matmul).startswith("NT_matmul"):
        return False
    # A dequantized weight read by anything else must stay materialized: fusing would dequantize it twice.
    weight_var = ctx.value_to_bound_var.get(dequantize)
    return weight_var is not None and len(ctx.var_usages.get(weight_var, [])) == 1


@tvm.transform.module_pass(opt_level=0, name="FuseDequantizeMatmul")
class FuseDequantizeMatmul:  # pylint: disable=too-few-public-methods
    """Group each dequantize -> NT_matmul pair (FuseOpsByPattern) and merge it into one PrimFunc (FuseTIR).

    The dequantize stays a block of its own inside the kernel: the schedule decides where it runs (the CPU rules
    inline it into the reduction; a prefill schedule may instead dequantize one weight tile per thread and
    reuse it across rows). Run after FuseTransposeMatmul and before FuseOps."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        pattern = relax.transform.FusionPattern(
            "dequantize_matmul", _MATMUL, {"dequantize": _DEQUANTIZE, "matmul": _MATMUL}, _check
        )
        before = {gv.name_hint for gv in mod.get_global_vars()}
        mod = relax.transform.FuseOpsByPattern([pattern], bind_constants=False)(mod)
        mod = relax.transform.FuseTIR()(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc) and gv.name_hint not in before:
                mod[gv] = func.with_attr("op_pattern", _OUT_EWISE_FUSABLE)
        # The standalone dequantize PrimFuncs are unused now.
        return relax.transform.DeadCodeElimination()(mod)
