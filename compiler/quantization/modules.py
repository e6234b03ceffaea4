"""nn.Modules whose weights are stored quantized and dequantized inside the kernels that read them."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op

from .dequantize_te import dequantize_te, take_dequantize_te
from .group import GroupLayout

# The dequantize kernels carry their layout: later passes (IntegerDotGEMV) read the codes directly.
LAYOUT_ATTR = "mobilec.group_layout"


class _QuantizedWeight(nn.Module):
    """Parameters q_weight, q_scale (and q_min) for an [out_features, in_features] weight."""

    def __init__(self, out_features: int, in_features: int, layout: GroupLayout, dtype: str):
        self.out_features, self.in_features = out_features, in_features
        self.layout, self.dtype = layout, dtype
        for suffix, (shape, param_dtype) in layout.shapes(out_features, in_features).items():
            setattr(self, suffix, nn.Parameter(shape, param_dtype))

    def _stored(self) -> list[Tensor]:
        return [getattr(self, suffix) for suffix in self.layout.shapes(self.out_features, self.in_features)]

    def to(self, dtype: str | None = None) -> None:  # stored dtypes are fixed by the layout
        del dtype

    def dequantized_weight(self) -> Tensor:
        layout = {"bits": self.layout.bits, "group": self.layout.group, "symmetric": self.layout.symmetric,
                  "offset": self.layout.offset, "code_order": self.layout.code_order}
        return op.tensor_expr_op(dequantize_te(self.layout, self.in_features, self.dtype), "dequantize", self._stored(),
                                 attrs={LAYOUT_ATTR: layout})


class QuantizedLinear(_QuantizedWeight):
    def __init__(self, in_features: int, out_features: int, layout: GroupLayout, bias: bool, dtype: str):
        super().__init__(out_features, in_features, layout, dtype)
        self.bias = nn.Parameter((out_features,), dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = op.matmul(x, op.permute_dims(self.dequantized_weight()))
        return y + self.bias if self.bias is not None else y


class QuantizedEmbedding(_QuantizedWeight):
    """Looks up rows without dequantizing the table; `project` is the tied output layer."""

    def __init__(self, num: int, dim: int, layout: GroupLayout, dtype: str):
        super().__init__(num, dim, layout, dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return op.tensor_expr_op(take_dequantize_te(self.layout, self.in_features, self.dtype), "take_dequantize",
                                 [ids, *self._stored()])

    def project(self, hidden: Tensor) -> Tensor:
        return op.matmul(hidden, op.permute_dims(self.dequantized_weight()))
