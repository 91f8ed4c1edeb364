"""Mixed precision as data: the dtype parameters compute in and the dtype gradients are reduced in.

`mixed_precision(param_dtype=torch.bfloat16)` declares, for every parallelism of the plan, the
recipe of PyTorch's FSDP2 `MixedPrecisionPolicy` and of torchtitan:
- the model is traced as it runs, with its floating-point parameters in `param_dtype` (buffers keep
  theirs), so dtype-dependent code (an RMSNorm's `.to(input_dtype)`) records the compute dtype and
  activations, their collectives and pipeline sends are in `param_dtype`;
- the optimizer updates fp32 master weights (the model's own dtype): a ZeRO/FSDP unit keeps its
  shard as the master and gathers it in `param_dtype` (`autopar/compiler/passes/shard_parameters.py`);
  any other trainable parameter is held as its master and cast to `param_dtype` in the rank graph
  where the forward starts (`autopar/compiler/passes/cast_parameters.py`), so its gradient reaches
  the master in the master's dtype through the cast's backward;
- gradients are reduced in `reduce_dtype`, float32 by default (torchtitan's default: sums of many
  ranks' bf16 partials lose bits). A ZeRO unit reduce-scatters in any `reduce_dtype`; a replicated
  gradient (data parallelism's all-reduce) is reduced in its master's dtype, and another
  `reduce_dtype` for it is refused at plan time, naming the parameter;
- `output_dtype` (None: as traced) casts the model's floating-point outputs, as FSDP2's does: a
  loss or logits handed back in fp32 (`autopar/compiler/passes/cast_outputs.py`).

The declaration belongs to no mesh axis; `resolve_strategies` takes it out of the strategy list
(`ResolvedStrategy.mixed_precision`). ZeRO's own `param_dtype=`/`reduce_dtype=` are the same
declaration for its units; declaring both with different dtypes is refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.errors import PlanError


@dataclass(frozen=True)
class MixedPrecisionDeclaration:
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype | None = None
    name: str = "mixed_precision"

    def describe(self) -> str:
        out = f", outputs {_short(self.output_dtype)}" if self.output_dtype is not None else ""
        return f"compute {_short(self.param_dtype)}, reduce {_short(self.reduce_dtype)}{out}, fp32 masters"


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def mixed_precision(param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
                    output_dtype: torch.dtype | None = None) -> MixedPrecisionDeclaration:
    """Parameters computed in `param_dtype` from fp32 masters; gradients reduced in `reduce_dtype`;
    the model's floating-point outputs in `output_dtype` (None: as computed). Module docstring."""
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype), ("output_dtype", output_dtype)):
        if name != "output_dtype" or dtype is not None:
            check_precision_dtype("mixed_precision", name, dtype)
    return MixedPrecisionDeclaration(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=output_dtype)


def check_precision_dtype(owner: str, name: str, dtype: object) -> None:
    """A dtype a plain cast can compute or reduce in: a 16- or 32-bit float (`owner(name=dtype)` refused
    otherwise). `mixed_precision()` and `zero(param_dtype=, reduce_dtype=)` check theirs here."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise PlanError(f"{owner}({name}={dtype!r}): expected a floating-point torch.dtype "
                        f"(torch.bfloat16, torch.float16, torch.float32)")
    if dtype.itemsize < 2:
        raise PlanError(f"{owner}({name}={dtype}): 8-bit floats need scales beside them, which a plain cast does "
                        f"not keep; fix: a 16- or 32-bit dtype")
