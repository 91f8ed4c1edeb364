"""Linears whose weight gradient is computed straight into its shared-memory gradient bucket.

A data-parallel gradient bucket through shared memory (`runtime/grad_sync.py`) is this rank's
slice of a row the other ranks read. autograd computes a weight gradient into a tensor of its own,
and the post-accumulate hook then copies it into the row: 13 MiB a step for the example GPT at dp4,
2.6 ms of a rank's ~57 ms of CPU on this 2-core machine (the copies of 1 MiB ran at 6-7 GB/s inside
a step, 2026-12-05). Megatron's gradient-accumulation fusion writes the weight gradient GEMM's output
into the parameter's main_grad buffer instead; this file does that on CPU.

`bind_bucket_linears(graph_module, weights, slices)` rewrites the executable rank graph (not the
plan's: the ledgers read that one) once, when `StageRunner` binds it: an
`addmm(bias, x, permute(weight, [1, 0]))` or `mm(x, permute(weight, [1, 0]))` whose weight is a
parameter with a slice in a shared-memory bucket, read by this linear alone (a weight read twice
would have its second gradient written over the first), becomes one `_BucketLinear`. Its backward
computes the input and bias gradients as autograd's addmm does, and the weight gradient
- into the bucket slice (`torch.mm(out=)`), handed to autograd as a fresh view of it, which
  AccumulateGrad then keeps as `param.grad` without a copy (the hook finds it in place), when it is
  the parameter's first gradient and autograd will accumulate it untouched (`BucketLinears.takes`:
  no gradient there yet nor written by this backward already, the parameter's AccumulateGrad node
  will run — `_will_engine_execute_node` —, no tensor hook on the weight, no `create_graph`);
- as a tensor of its own otherwise: a gradient already there (accumulated micro-batches,
  `no_sync`) or a second one of this backward (two forwards, one backward) is added by autograd as
  before, and `torch.autograd.grad` gets a gradient that is not the bucket's memory.
Under autocast, torch.func's transforms, forward-mode AD and a torch.compile trace the plain addmm
runs instead. A hook on the AccumulateGrad node itself (`register_prehook`) is not looked for: it
would see the slice.

Same bits as the addmm it replaces: autograd computes the transposed weight's gradient as
gradᵀ·x transposed back, the input gradient as grad·weight and the bias gradient as grad summed
over rows. Measured on the example GPT at dp4 (4 ranks, 2 cores, medians of 20 alternating steps,
2026-12-05): the hooks' CPU time per step 2.6 → 0.6 ms; with the blocked all-reduce of the same
day, a rank's step 58.9 → 54.0 ms of CPU against the rank's slice trained alone's 53.2 and 49.9 in
the same jobs (README, "Benchmarks"). Not bound under torch.compile (its graph is traced from
the plan's) nor in a pipeline (its split backward assigns weight gradients itself).
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import fx
from torch.autograd import forward_ad

_PERMUTE = torch.ops.aten.permute.default
_LINEARS = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)


def _accumulates(accumulator: torch.autograd.graph.Node) -> bool:
    """Whether this backward will run the parameter's AccumulateGrad node (False under
    `torch.autograd.grad`, which captures the gradient instead, and raises when asked)."""
    try:
        return torch._C._will_engine_execute_node(accumulator)
    except RuntimeError:
        return False


def _plain_only(x: torch.Tensor) -> bool:
    """Where the plain addmm must run: under autocast (the function's backward would mix dtypes),
    torch.func's transforms, forward-mode AD and a trace by torch.compile (none takes this function)."""
    return (torch.is_autocast_enabled(x.device.type) or torch.compiler.is_compiling()
            or torch._C._functorch.peek_interpreter_stack() is not None or forward_ad._current_level >= 0)


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The linear as the rank graph had it: addmm (mm without a bias) of the transposed weight."""
    return torch.addmm(bias, x, weight.t()) if bias is not None else torch.mm(x, weight.t())


class _BucketLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, linears, fqn):
        ctx.save_for_backward(x, weight)
        ctx.linears, ctx.fqn, ctx.has_bias = linears, fqn, bias is not None
        return _plain(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            bucket_slice = ctx.linears.slices[ctx.fqn]
            if grad.dtype == x.dtype == bucket_slice.dtype and ctx.linears.takes(ctx.fqn):
                # a new view: AccumulateGrad keeps a gradient nobody else holds as param.grad itself
                grad_weight = torch.mm(grad.t(), x, out=bucket_slice).view_as(weight)
            else:
                grad_weight = grad.t().mm(x)
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None


class BucketLinears:
    """The bucket slices of the rewritten linears' weights, their parameters and AccumulateGrad nodes."""

    def __init__(self, slices: dict[str, torch.Tensor], parameters: dict[str, torch.nn.Parameter]) -> None:
        self.slices = slices
        self.parameters = {fqn: parameters[fqn] for fqn in slices}
        # a leaf's AccumulateGrad node, held here so that it stays the one autograd uses
        self.accumulators = {fqn: parameters[fqn].view_as(parameters[fqn]).grad_fn.next_functions[0][0]
                             for fqn in slices}
        # slices written and not yet accumulated: a second gradient of the same backward, or of a
        # backward run inside it (reentrant checkpoint), must not write the slice while autograd still
        # holds the first one; a parameter's own post-accumulate hook clears its entry
        self._pending: set[str] = set()
        pending = weakref.ref(self._pending)
        for fqn in slices:
            parameters[fqn].register_post_accumulate_grad_hook(functools.partial(_accumulated, pending, fqn))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, fqn: str) -> torch.Tensor:
        """x·weightᵀ (+ bias), its weight gradient computed into the bucket slice of `fqn` where it can be."""
        if not weight.requires_grad or _plain_only(x):
            return _plain(x, weight, bias)
        return _BucketLinear.apply(x, weight, bias, self, fqn)

    def takes(self, fqn: str) -> bool:
        """Whether the running backward may compute `fqn`'s weight gradient into its slice: the
        gradient is the parameter's first (none there yet, no slice written and not accumulated yet:
        a forward run twice before one backward, a reentrant checkpoint's inner backward),
        AccumulateGrad will keep it (not `torch.autograd.grad`), nobody sees it first (no tensor
        hook on the weight, which could keep it), and no graph of the gradient is built
        (`create_graph`: an out= GEMM has none)."""
        parameter = self.parameters[fqn]
        if torch.is_grad_enabled() or parameter.grad is not None or parameter._backward_hooks or fqn in self._pending:
            return False
        if not _accumulates(self.accumulators[fqn]):
            return False
        self._pending.add(fqn)
        return True


def _accumulated(pending: "weakref.ref[set[str]]", fqn: str, _parameter: torch.Tensor) -> None:
    """A parameter's gradient has been accumulated: its slice may take the next backward's. (Held by
    the parameter's hooks, so it holds its set weakly: no cycle through the parameter. A backward that
    fails after writing a slice leaves it pending until the parameter's next accumulation, one
    backward later, which takes the copying path meanwhile.)"""
    entries = pending()
    if entries is not None:
        entries.discard(fqn)


def bind_bucket_linears(graph_module: fx.GraphModule, weights: dict[str, str], slices: dict[str, torch.Tensor],
                        parameters: dict[str, torch.nn.Parameter]) -> int:
    """Rewrite the linears of `graph_module` whose weight (placeholder name -> parameter fqn in
    `weights`) has a bucket slice in `slices`; returns how many were rewritten."""
    sites = []
    for node in graph_module.graph.nodes:
        site = _site(node, weights, slices, parameters)
        if site is not None:
            sites.append((node, *site))
    if not sites:
        return 0
    linears = BucketLinears({fqn: slices[fqn] for _, _, _, _, fqn in sites}, parameters)
    for node, x, weight, bias, fqn in sites:
        transpose = node.args[-1]
        with graph_module.graph.inserting_before(node):
            rewritten = graph_module.graph.call_function(linears.linear, (x, weight, bias), {"fqn": fqn})
        rewritten.meta = dict(node.meta)
        node.replace_all_uses_with(rewritten)
        graph_module.graph.erase_node(node)
        graph_module.graph.erase_node(transpose)
    graph_module.recompile()
    return len(sites)


def _site(node: fx.Node, weights: dict[str, str], slices: dict[str, torch.Tensor],
          parameters: dict[str, torch.nn.Parameter]) -> tuple | None:
    """(x, weight, bias, fqn) of a linear to rewrite, or None."""
    if node.op != "call_function" or node.target not in _LINEARS or node.kwargs:
        return None
    bias = node.args[0] if node.target is torch.ops.aten.addmm.default else None
    x, transpose = node.args[-2:]
    if len(node.args) != (3 if bias is not None else 2) or not isinstance(transpose, fx.Node):
        return None
    if transpose.target is not _PERMUTE or list(transpose.args[1]) != [1, 0] or len(transpose.users) != 1:
        return None
    weight = transpose.args[0]
    fqn = weights.get(weight.name) if isinstance(weight, fx.Node) and weight.op == "placeholder" else None
    if fqn not in slices or len(weight.users) != 1 or not parameters[fqn].requires_grad:
        return None
    out_features = parameters[fqn].shape[0]
    if bias is not None and not (isinstance(bias, fx.Node) and _shape(bias) == (out_features,)):
        return None  # addmm's added term is a bias of the output features only
    if slices[fqn].shape != parameters[fqn].shape:
        return None
    return x, weight, bias, fqn


def _shape(node: fx.Node) -> tuple | None:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or any(not isinstance(size, int) for size in value.shape):
        return None
    return tuple(value.shape)
