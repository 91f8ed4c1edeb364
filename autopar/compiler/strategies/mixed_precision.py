"""Low precision as data: the dtype parameters compute in and the dtype gradients are reduced in
(`mixed_precision`), and the linears computed in FP8 (`float8`).

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

`float8(recipe="rowwise")` declares, for every parallelism of the plan, torchao's float8 training
recipe (`autopar/core/ops/float8_matmul.py`: "tensorwise" or "rowwise" scaling) for the linears it
names; `autopar/compiler/passes/float8_linears.py` puts their products in the graph:
- `modules`: module-path globs (`fnmatch`, e.g. `"layers.*.mlp.*"`) of the linears to convert;
  None (the default) converts every linear but the head: the last linear the model runs, when it
  lies outside the model's repeated blocks (an LM's vocabulary projection, which torchtitan and
  torchao's recipes keep in high precision);
- `exclude`: globs of linears kept in high precision among those.

Every scale is the one a single device would compute (largest magnitudes all-reduced where a mesh
axis cuts them), so a plan equals one device running torchao's `Float8Linear` with the same recipe.
`data_scales="local"` declares torchao's and torchtitan's way instead: a scale spanning the rows
(tokens) is taken over the rows the rank holds, with no all-reduce over the axes cutting them
(data, expert, context axes); the plan then equals one device accumulating gradients over the
ranks' rows as micro-batches (as a pipeline's micro-batches are scaled one by one). At scale those
all-reduces are many small latency-bound calls over the data axis (one or two per linear and
micro-batch), which the planner prices.
Both operand dimensions of a converted linear must be multiples of 16 (the FP8 matrix kernels'
alignment); another is refused by name. The declaration belongs to no mesh axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.errors import PlanError
from autopar.core.ops.float8_matmul import RECIPES


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

@dataclass(frozen=True)
class Float8Declaration:
    recipe: str
    modules: tuple[str, ...] | None
    exclude: tuple[str, ...]
    data_scales: str = "global"
    name: str = "float8"

    def describe(self) -> str:
        which = "every linear but the head" if self.modules is None else ", ".join(self.modules)
        unless = f", except {', '.join(self.exclude)}" if self.exclude else ""
        local = ", each rank's rows scaled alone" if self.data_scales == "local" else ""
        return f"fp8 {self.recipe}: {which}{unless}{local}"

    @property
    def label(self) -> str:
        """Short form for the planner's tables: `fp8 rowwise`, `fp8 rowwise local`."""
        return f"fp8 {self.recipe}" + (" local" if self.data_scales == "local" else "")


def float8(recipe: str = "rowwise", modules: "str | tuple[str, ...] | list[str] | None" = None,
           exclude: "str | tuple[str, ...] | list[str]" = (), data_scales: str = "global") -> Float8Declaration:
    """Linears computed in FP8 with torchao's `recipe` ("tensorwise" or "rowwise"); `data_scales`:
    "global" (one device's scales) or "local" (each rank's rows scaled alone). Module docstring."""
    if recipe not in RECIPES:
        raise PlanError(f"float8(recipe={recipe!r}): the recipes are {sorted(RECIPES)}")
    if data_scales not in ("global", "local"):
        raise PlanError(f"float8(data_scales={data_scales!r}): 'global' (one device's scales) or 'local' (each rank "
                        f"scales the rows it holds)")
    as_tuple = lambda value: (value,) if isinstance(value, str) else tuple(value)  # noqa: E731
    return Float8Declaration(recipe=recipe, modules=None if modules is None else as_tuple(modules),
                             exclude=as_tuple(exclude), data_scales=data_scales)
