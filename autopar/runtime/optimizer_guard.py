"""Refuses an optimizer step over the parameters of a model that `parallelize` replaced.

`parallelize(model, ...)` returns a `ParallelModule` holding this rank's shards as new
parameters; the model it was given is not trained any more. An optimizer built before, over
`model.parameters()`, would step tensors that no forward reads and no backward reaches: the loss
stays where it was and nothing says why. `retire(model)` records the model's parameters
(weakly: they are freed with the model) and installs, once per process, a global optimizer
step pre-hook (`torch.optim.optimizer.register_optimizer_step_pre_hook`) that checks each
optimizer's parameters at its first step (and again when its parameter groups change): any
retired one is an `OptimizerParametersError` naming the parameter and the fix. Later steps cost
one dictionary lookup.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(parameter) -> the parameter, weakly; and its name in the retired model
_retired: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_names: dict[int, str] = {}
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_hook: list[Any] = []


class OptimizerParametersError(RuntimeError):
    """An optimizer over parameters that a ParallelModule replaced."""


def retire(model: torch.nn.Module) -> None:
    """Record `model`'s parameters as replaced by a ParallelModule's (module docstring)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if _retired.get(id(param)) is not param:
            _retired[id(param)] = param
            _names[id(param)] = name
    if not _hook:
        _hook.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == params:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if _retired.get(id(param)) is param:
                raise OptimizerParametersError(
                    f"{type(optimizer).__name__} steps parameter {_names.get(id(param), '?')!r} of the model given "
                    f"to autopar.parallelize; the ParallelModule it returned holds this rank's shards as new "
                    f"parameters, so this optimizer would train nothing\n  fix: build the optimizer after "
                    f"parallelize, over the returned module's parameters: "
                    f"torch.optim.AdamW(module.parameters(), ...)")
    _checked[optimizer] = params
