"""Measurements taken from outside the program under test, for the tests to compare with the ledgers.

Nothing here imports autopar's runtime, passes, plan or ledgers: each tool watches what PyTorch
sees, so that "measured" never means "asked the runtime".

- `comm_counter`: every collective and point-to-point op handed to torch.distributed, by phase
  (kind, group, logical bytes, peer); an unknown communication op raises.
- `profiled_collectives`: the collectives of a compiled step, from PyTorch's profiler (no dispatch
  mode watches compiled code), totalled per kind.
- `profiled_memory`: the peak of a compiled step's allocations, from PyTorch's profiler.
- `storages`: every live tensor storage (a dispatch mode with weak references), its peak, and
  on request what is live at the peak, each storage with the op that made it.
- `memory`: those live bytes split by PyTorch's public interfaces (parameters, gradients,
  optimizer state, buffers, other).
- `activations`: what a forward pass leaves alive for backward, seen through any saved-tensor hooks.
- `reassemble`: whole tensors from the ranks' pieces, by all-gather and DTensor, not by the
  functions that cut the pieces.
"""
