"""Data parallelism as data: every user input sharded on its batch dimension along one axis.

Parameters stay replicated; the planner finds their gradients partial over the axis and the
runtime all-reduces them in buckets after backward (`autopar.runtime.grad_sync`).

`transport="shared_memory"` all-reduces those buckets through a shared-memory file instead of the
process group (`autopar.runtime.shared_memory`): for the ranks of one host on gloo, whose
all-reduce goes through loopback TCP. The axis' groups must stay inside one node.
`transport="auto"` (the default) does so where the axis stays inside one node and the job's
process group is gloo on a machine that runs it (`autopar.comm_kinds.transport_kind`), and
uses the process group otherwise (NCCL, an axis across nodes, planning without a process group);
`transport="process_group"` always uses the process group.
"""
from __future__ import annotations

from torch.distributed.tensor import Shard

from autopar.comm_kinds import check_transport
from autopar.strategies import InputRule, Strategy


def data_parallel(*, axis: str = "dp", batch_dim: int = 0, transport: str = "auto") -> Strategy:
    check_transport("data_parallel", transport)
    return Strategy(name="data_parallel", axis=axis, inputs=(InputRule(index=None, placement=Shard(batch_dim)),),
                    transport=transport)
