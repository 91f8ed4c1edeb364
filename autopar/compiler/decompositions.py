"""The decomposition table `trace.py` hands to `ExportedProgram.run_decompositions`.

torch.export's default table (core ATen), with three changes:
- kept whole: `scaled_dot_product_attention` and `nll_loss_forward`, which
  `autopar.compiler.rules.op_rules` shards as they are (head/batch-sharded attention, the
  vocab-parallel loss); and SiLU: decomposed, it becomes x * sigmoid(x) computed in fp32, and
  autograd keeps the fp32 input and sigmoid (4 bytes each per element of a bf16 model's SwiGLU
  width) where the whole op keeps its input; DTensor shards it as the pointwise op it is;
- `linear` written out in Python (`linear`), node for node what ATen's own C++ kernel
  (`at::native::linear` through `matmul`) records. Why our own: with symbolic batch and sequence
  (`dynamic_dims`), the C++ path reshapes through symbolic stride arithmetic that costs about 25 ms
  a call (a Llama-3 block has seven linears, each run twice by `run_decompositions`), where the
  same graph written directly costs a few. `tests/test_decompositions.py` holds the two to the
  same nodes, with and without bias, contiguous or not, 1-D to 4-D, static and dynamic.
"""
from __future__ import annotations

import math

import torch
from torch._prims_common import is_contiguous_or_false

aten = torch.ops.aten


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten.linear as ATen's C++ kernel records it: a contiguous input folded to 2-D for one
    `mm` (`addmm` with a bias) and viewed back; a non-contiguous one through `matmul`."""
    if x.dim() > 2 and not is_contiguous_or_false(x):
        out = aten.matmul.default(x, aten.t.default(weight))
        return out if bias is None else aten.add.Tensor(out, bias)
    lead = x.shape[:-1]  # their product is a node of its own under symbolic sizes: made below where ATen makes it
    if bias is None:
        transposed = aten.permute.default(weight, [1, 0])
        if x.dim() == 1:
            return aten.squeeze.dims(aten.mm.default(aten.unsqueeze.default(x, 0), transposed), [0])
        if x.dim() == 2:
            return aten.mm.default(x, transposed)
        folded = aten.mm.default(aten.view.default(x, [math.prod(lead), x.shape[-1]]), transposed)
        return aten.view.default(folded, [*lead, weight.shape[0]])
    if x.dim() == 2:
        return aten.addmm.default(bias, x, aten.permute.default(weight, [1, 0]))
    flat = aten.view.default(x, [math.prod(lead), x.shape[-1]])
    folded = aten.addmm.default(bias, flat, aten.permute.default(weight, [1, 0]))
    return aten.view.default(folded, [*lead, weight.shape[0]])


def decomposition_table() -> dict:
    """torch.export's default decompositions less the ops autopar shards whole, with `linear` ours."""
    table = torch.export.default_decompositions()
    for op in (aten.scaled_dot_product_attention.default, aten.nll_loss_forward.default, aten.silu.default):
        table.pop(op, None)
    table[aten.linear.default] = linear
    return table
