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

Accumulation has one device's semantics: any number of backward passes between optimizer steps,
synchronising or not (`ParallelModule.no_sync`), leave in `param.grad` the sum of their
gradients. After a synchronising backward a bucket holds the reduced gradient R, the same on every
rank of its group (of size n, the product of its axes' groups). A backward that adds into it
would have the next sum-reduction count R n times; so before the first gradient of a new backward
lands in a synchronised bucket (a tensor hook, which autograd runs before it accumulates), the
bucket is divided by n in place (`_to_share`): each rank holds R/n, its share, and the reduction
gives back R plus the new gradients' sum — what DDP's averaging does to an accumulated gradient.
Memory and communication: none beyond the buckets — no copy of R is kept (keeping R aside and
adding it back after the reduction would cost a copy of every synchronised bucket from the next
backward to the end of the next synchronising one), and nothing is reduced but the plan's
buckets, so the communication ledger stays exact per synchronising backward. The division is
exact for n a power of two and otherwise costs R an ulp or so of rounding; it relies on R being
equal on the group's ranks, which holds unless a rank changes its gradients alone between
backward passes. Until the next synchronising backward ends, a rank's `param.grad` holds its
share: inside `no_sync` gradients are this rank's unreduced part, as without a previous step.
The hook also runs under `torch.autograd.grad` (a split backward's weight passes, which then add
into `.grad` directly). A parameter no gradient reaches in a synchronising backward contributes
what its `.grad` holds (earlier micro-batches, its share), zeros when it has none.

"""
from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from autopar.core.buckets import Bucket
from autopar.runtime import progress


class GradSynchronizer:
    """Launches each bucket's all-reduce as soon as its gradients exist; finishes at end of backward.

    Each bucket owns one flat buffer. A gradient is copied into its slice when autograd has
    accumulated it the first time, and `param.grad` becomes that slice (a view): later backward
    passes of an accumulation (no_sync, a pipeline's micro-batches, another synchronising backward)
    add into it in place. A complete bucket is all-reduced in place, asynchronously, while backward
    goes on; nothing is copied back. A gradient already synchronised is turned into this rank's
    share before anything is added to it (module docstring), so backward passes accumulate as on
    one device whether gradients are zeroed, set to None (optimizer.zero_grad, either way) or kept
    between them."""

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
        self._synchronised: set[int] = set()  # buckets holding their reduced gradient (module docstring)
        self._group_sizes: list[int] | None = None  # n per bucket, read from the process groups when first needed
        self.enabled = True  # False under ParallelModule.no_sync: gradients accumulate in param.grad
        for fqn in self._slot:
            self.params[fqn].register_hook(self._make_pre_hook(fqn))
            self.params[fqn].register_post_accumulate_grad_hook(self._make_hook(fqn))

    def _view(self, fqn: str) -> torch.Tensor:
        """`fqn`'s slice of its bucket, a new view each time."""
        index, offset = self._slot[fqn]
        param = self.params[fqn]
        return self._flat[index][offset:offset + param.numel()].view_as(param)

    def _make_pre_hook(self, fqn: str):
        """Runs before autograd adds `fqn`'s new gradient into `param.grad`."""
        def hook(grad: torch.Tensor) -> None:
            index = self._slot[fqn][0]
            if index in self._synchronised:
                self._to_share(index)
        return hook

    def _to_share(self, index: int) -> None:
        """Bucket `index`'s reduced gradient R becomes this rank's share R/n (module docstring). Slices
        of parameters whose `.grad` is elsewhere (None, reassigned) are stale and overwritten later."""
        if self._group_sizes is None:
            self._group_sizes = [math.prod(_resolve_process_group(self.groups[key]).size() for key in bucket.axes)
                                 for bucket in self.buckets]
        self._synchronised.discard(index)
        with torch.no_grad():
            self._flat[index].div_(self._group_sizes[index])

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
        if index in self._synchronised:  # no gradient of this backward reached the bucket
            self._to_share(index)
        for fqn in bucket.params:
            if fqn not in self._ready[index]:  # no gradient in this backward: contributes what it holds
                self._hold_in_view(fqn)
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

    def _hold_in_view(self, fqn: str) -> None:
        """`fqn`'s slice holds its `.grad` (accumulated earlier, a share) or zeros when it has none."""
        grad, view = self.params[fqn].grad, self._view(fqn)
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)

    def synchronise_all(self) -> None:
        """Reduce every bucket now: gradients accumulated without autograd's post-accumulate hooks
        (a split backward's weight-gradient passes add into `.grad` directly, after `torch.autograd.grad`
        ran the tensor hooks that make synchronised buckets shares)."""
        for index in range(len(self.buckets)):
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
        self._synchronised.update(self._launched)
        self._launched.clear()
        self._axes_issued.clear()
        self._ready = [set() for _ in self.buckets]
        self._callback_queued = False
        progress.mark(3)
