"""Which host each rank of a job runs on, and the node size that follows.

`parallelize` needs the node size to know which mesh axes stay inside a node: the ledger's
links (intra or inter node) and the cost model's prices of them. torchrun
says it (`LOCAL_WORLD_SIZE`), and a user may (`ranks_per_node=`, `;node=` in the mesh,
`Cluster(gpus_per_node=)`). Where none does (a job started by SLURM, mpirun or its own
`init_process_group`), the ranks' host names give it (`node_size`). In a gloo job a declared
node size is checked against them (`check_node_size`): a node that would span several hosts is
refused at plan time (its groups would be counted as intra-node links). Under other backends
the declaration stands (it only prices the links there).

`job_node_size` runs the exchange through the job's store, as process groups rendezvous (no
collective): every rank leaves its host name, rank 0 alone reads them all and publishes one
verdict on its own declaration, the node size or the error, which every rank reads, so all ranks
raise the same error or none does (a rank that declares another size is refused next, when the
plans' fingerprints are compared). All ranks on one host accept any declared size: that is how
a multi-node job is rehearsed on one machine (`torchrun --nnodes=2` on localhost).
"""
from __future__ import annotations

import math
import socket
from itertools import groupby

import torch.distributed as dist

from autopar.core.comm_kinds import runtime_backend
from autopar.core.errors import PlanError

_exchanges = 0  # exchanges so far in this process (every rank runs them in the same order)
_OK, _REFUSED = "ok ", "refused "
CHECKED_BACKENDS = ("gloo",)  # backends whose jobs have a declared node size checked against the hosts


def job_node_size(declared: int | None, source: str = "", fix: str = "") -> int | None:
    """This job's node size: `declared` (said by `source`; `fix` names the setting to change,
    with "{size}" for the size the hosts give) checked against the ranks' hosts in a gloo job, or,
    where None, read off them (None: one host)."""
    global _exchanges
    _exchanges += 1
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"autopar/hosts/{_exchanges}"
    if rank != 0:
        store.set(f"{key}/{rank}", socket.gethostname())
    else:
        others = [f"{key}/{other}" for other in range(1, world)]
        hosts = [socket.gethostname()] + [name.decode() for name in (store.multi_get(others) if others else [])]
        try:
            verdict = _OK + str(_checked(declared, hosts, source, fix) if declared is not None else node_size(hosts))
        except PlanError as error:
            verdict = _REFUSED + str(error)
        store.set(key, verdict)
        for name in others:
            store.delete_key(name)
    verdict = store.get(key).decode()
    if verdict.startswith(_REFUSED):
        raise PlanError(verdict[len(_REFUSED):])
    return declared if declared is not None else (None if verdict == _OK + "None" else int(verdict[len(_OK):]))


def _checked(declared: int, hosts: list[str], source: str, fix: str) -> int:
    if runtime_backend() in CHECKED_BACKENDS:
        check_node_size(declared, hosts, source, fix)
    return declared


def node_size(hosts: "tuple[str, ...] | list[str]") -> int | None:
    """Ranks per node from the ranks' hosts: None when they share one host, else the largest size
    whose blocks of consecutive ranks each lie on one host (the gcd of the runs of ranks on one
    host: k for k ranks per host, 1 for hosts that interleave their ranks; every axis then counts
    as crossing nodes)."""
    if len(set(hosts)) <= 1:
        return None
    return math.gcd(*(len(list(run)) for _, run in groupby(hosts)))


def check_node_size(declared: int | None, hosts: "tuple[str, ...] | list[str]", source: str,
                    fix: str = "ranks_per_node={size}") -> None:
    """Refuse a declared node size (None: the whole world) under which one node spans several hosts."""
    size = declared or len(hosts)
    for start in range(0, len(hosts), size):
        block = hosts[start:start + size]
        if len(set(block)) > 1:
            raise PlanError(f"{source} gives {size} ranks per node, so ranks {start}..{start + len(block) - 1} "
                            f"share one, but they run on hosts {sorted(set(block))}\n  fix: "
                            f"{fix.format(size=node_size(hosts))} (what the hosts give)")
