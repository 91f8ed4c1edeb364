"""Bucketed gradient synchronisation for parameters whose gradients come out Partial.

The buckets are the plan's (`autopar/core/buckets.py`; the communication ledger counts the
same ones). `GradSynchronizer` registers post-accumulate-grad
hooks: when a bucket's last gradient arrives its gradients are flattened and all-reduced over
each axis (functional collectives), asynchronously while backward goes on; the end-of-backward
callback waits for them and writes the reduced values back into `param.grad`.

A bucket's `axes` are group keys (`Mesh.sync_keys`): a gradient partial over several axes on
one link (dp × cp, dp × ep, the norms of sequence parallelism under dp) is one key, all-reduced
once over the flattened group. Axes on different links stay apart, and such a bucket
all-reduces over one key after the other, each on the previous one's result: its first
key is issued when the bucket is complete, and each later one when the next bucket is
launched (its previous collective has had a bucket's worth of backward to finish) or at the end
of backward — a chain of asynchronous collectives, where waiting on every axis but the last
held backward up at each bucket. Every rank advances the chains at the same points, so each
process group sees the same order of collectives on every rank.

"""
from __future__ import annotations

import torch

from autopar.core.buckets import Bucket
from autopar.runtime import progress


class GradSynchronizer:
    """Launches each bucket's all-reduce as soon as its gradients exist; finishes at end of backward.

    Each bucket owns one flat buffer. A gradient is copied into its slice when autograd has
    accumulated it the first time, and `param.grad` becomes that slice (a view): later backward
    passes of an accumulation (no_sync, a pipeline's micro-batches) add into it in place. A
    complete bucket is all-reduced in place, asynchronously, while backward goes on; nothing is
    copied back. Gradients must be zeroed or set to None between backward passes (optimizer.zero_grad,
    either way): the reduction sums Partial gradients, so gradients left from a synchronised step
    would be counted once per rank. Accumulate micro-batches under `ParallelModule.no_sync()` (the
    synchronising backward then reduces the accumulated sum), or by summing their losses; a pipeline
    step does the same over its micro-batches (`runtime/stage.py`)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], buckets: list[Bucket], groups: dict[str, str]) -> None:
        self.buckets = buckets
        self.groups = groups
        self.params = params
        self._slot = {}
        for index, bucket in enumerate(buckets):
            offset = 0
            for fqn in bucket.params:
                self._slot[fqn] = (index, offset)
                offset += self.params[fqn].numel()
        self._flat = [torch.zeros(b.numel, dtype=b.dtype, device=self.params[b.params[0]].device)
                      for b in buckets]
        self._ready: list[set[str]] = [set() for _ in buckets]
        self._launched: dict[int, torch.Tensor] = {}
        self._axes_issued: dict[int, int] = {}  # bucket -> its axes issued so far (a chain, module docstring)
        self._callback_queued = False
        self.enabled = True  # False under ParallelModule.no_sync: gradients accumulate in param.grad
        for fqn in self._slot:
            self.params[fqn].register_post_accumulate_grad_hook(self._make_hook(fqn))

    def _view(self, fqn: str) -> torch.Tensor:
        """`fqn`'s slice of its bucket, a new view each time (views built once and reused were
        suspected in a heap corruption, not explained: docs/known-limits.md)."""
        index, offset = self._slot[fqn]
        param = self.params[fqn]
        return self._flat[index][offset:offset + param.numel()].view_as(param)

    def _make_hook(self, fqn: str):
        def hook(param: torch.Tensor) -> None:
            view, grad = self._view(fqn), param.grad
            # already there: zero_grad(set_to_none=False) kept it
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                # the gradient lives in the bucket from now on: accumulating micro-batches add into it
                # in place (autograd's AccumulateGrad), so no second copy of the gradients exists
                param.grad = view
            if not self.enabled:
                return
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
                progress.mark(2)
            index = self._slot[fqn][0]
            self._ready[index].add(fqn)
            if len(self._ready[index]) == len(self.buckets[index].params):
                self._launch(index)
        return hook

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        for fqn in bucket.params:
            if fqn not in self._ready[index]:  # unused in this step: contributes zeros
                self._view(fqn).zero_()
        for earlier in list(self._axes_issued):  # the chains of earlier buckets move on by one axis
            self._next_axis(earlier)
        self._axes_issued[index] = 0
        self._next_axis(index)

    def _next_axis(self, index: int) -> None:
        """Issue bucket `index`'s next axis (after waiting its previous one); nothing past its last."""
        issued, axes = self._axes_issued[index], self.buckets[index].axes
        if issued == len(axes):
            return
        if issued:
            torch.ops._c10d_functional.wait_tensor(self._launched[index])
        self._launched[index] = torch.ops._c10d_functional.all_reduce_(self._flat[index], "sum",
                                                                        self.groups[axes[issued]])
        self._axes_issued[index] = issued + 1

    def synchronise_all(self) -> None:
        """Reduce every bucket now: gradients accumulated without autograd's post-accumulate hooks
        (a split backward's weight-gradient passes assign `.grad` directly)."""
        for index, bucket in enumerate(self.buckets):
            for fqn in bucket.params:
                param = self.params[fqn]
                if param.grad is not None:
                    view = self._view(fqn)
                    if param.grad.data_ptr() != view.data_ptr():
                        view.copy_(param.grad)
                    self._ready[index].add(fqn)
            self._launch(index)
        self._finish()

    def _finish(self) -> None:
        for index in range(len(self.buckets)):
            if index not in self._launched:
                self._launch(index)
        while any(self._axes_issued[i] < len(self.buckets[i].axes) for i in self._axes_issued):
            for index in list(self._axes_issued):  # the chains' remaining axes, bucket by bucket in step
                self._next_axis(index)
        for index, pending in self._launched.items():
            torch.ops._c10d_functional.wait_tensor(pending)
            for fqn in self.buckets[index].params:
                param, view = self.params[fqn], self._view(fqn)
                param.grad = view
        self._launched.clear()
        self._axes_issued.clear()
        self._ready = [set() for _ in self.buckets]
        self._callback_queued = False
        progress.mark(3)
