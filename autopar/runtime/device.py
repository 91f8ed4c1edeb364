"""Which device a rank computes on, and which process-group backend goes with it.

`rank_device` reads the rank's accelerator through `torch.accelerator` (CUDA today; any backend
PyTorch registers as an accelerator) and takes the one `LOCAL_RANK` (torchrun's) names; without
an accelerator it is the CPU. `backend_for` is PyTorch's default backend for a device (NCCL on
CUDA, gloo on CPU). `group_device` is the device a running process group's tensors live on: the
rank's accelerator unless the group is gloo (gloo's collectives run on CPU tensors here), so a
gloo job on a host with GPUs stays on the CPU exactly as on a host without.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from autopar.core.comm_kinds import runtime_backend


def rank_device(*, local_rank: int | None = None) -> torch.device:
    """This rank's device: accelerator `local_rank` (default: `LOCAL_RANK`, else 0), or the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    index = local_rank if local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
    accelerator = torch.accelerator.current_accelerator()
    count = torch.accelerator.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"rank's LOCAL_RANK is {index} but this host has {count} {accelerator.type} devices; "
                           f"launch at most {count} ranks per host (torchrun --nproc-per-node={count})")
    return torch.device(accelerator.type, index)


def backend_for(device: torch.device) -> str:
    """PyTorch's default process-group backend for `device` ("nccl" on CUDA, "gloo" on CPU)."""
    return dist.get_default_backend_for_device(device)


def group_device() -> torch.device:
    """The device the default process group's tensors live on (CPU under gloo)."""
    if runtime_backend() == "gloo":
        return torch.device("cpu")
    return rank_device()
