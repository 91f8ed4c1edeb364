"""Which host each rank of a job runs on, and the node size that follows.

`parallelize` needs the node size to know which mesh axes stay inside a node: the ledger's
links, and where the transport "auto" may pick shared memory (only inside one host). torchrun
says it (`LOCAL_WORLD_SIZE`), and a user may (`ranks_per_node=`, `;node=` in the mesh). Where
neither does (a job started by SLURM, mpirun or its own `init_process_group`), the ranks' host
names give it: `job_hosts` exchanges them through the job's store (as process groups
rendezvous; no collective is issued) and `node_size` reads the node size off them. A declared
node size is checked against them (`check_node_size`): a node that would span several hosts is
refused at plan time, where shared memory would otherwise fail at setup and the ledger would
price cross-host links as a node's.

All ranks on one host (every test on this machine) accept any declared node size: that is how a
multi-node job is rehearsed on one machine (`torchrun --nnodes=2` on localhost, `ranks_per_node=2`).
"""
from __future__ import annotations

import socket

import torch.distributed as dist

from autopar.errors import PlanError

_exchanges = 0  # exchanges so far in this process (every rank runs them in the same order)


def job_hosts() -> tuple[str, ...]:
    """The host name of every rank of the initialised default group, by rank."""
    global _exchanges
    _exchanges += 1
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"autopar/hosts/{_exchanges}"
    store.set(f"{key}/{rank}", socket.gethostname())
    if rank == 0:  # one reader of every key, then one key every rank reads: O(world) store operations
        names = [store.get(f"{key}/{other}").decode() for other in range(world)]
        store.set(key, "\n".join(names))
    return tuple(store.get(key).decode().split("\n"))


def node_size(hosts: "tuple[str, ...] | list[str]") -> int | None:
    """Ranks per node from the ranks' hosts: None when they share one host; k when each host runs k
    consecutive ranks; 1 when the hosts hold the ranks unevenly or interleaved (the mesh's nodes are
    blocks of consecutive ranks, so no size fits: every axis then counts as crossing nodes)."""
    if len(set(hosts)) <= 1:
        return None
    size = len(hosts) // len(set(hosts))
    blocks = [hosts[start:start + size] for start in range(0, len(hosts), size)]
    regular = len(hosts) % size == 0 and all(len(set(block)) == 1 for block in blocks) and \
        len({block[0] for block in blocks}) == len(blocks)
    return size if regular else 1


def check_node_size(declared: int | None, hosts: "tuple[str, ...] | list[str]", where: str) -> None:
    """Refuse a declared node size (None: the whole world) under which one node spans several hosts."""
    size = declared or len(hosts)
    for start in range(0, len(hosts), size):
        block = hosts[start:start + size]
        if len(set(block)) > 1:
            raise PlanError(f"{where} gives {size} ranks per node, so ranks {start}..{start + len(block) - 1} share "
                            f"one, but they run on hosts {sorted(set(block))}\n  fix: ranks_per_node={node_size(hosts)} (what the hosts "
                            f"give), or leave the node size undeclared to take it from them")
