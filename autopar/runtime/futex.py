"""Sleeping on a word of shared memory until another process changes it: Linux's futex, for the
shared-memory barrier (`shared_memory.SharedMemoryGroup.barrier`).

A rank that reaches a barrier before the others used to poll their flags with `sched_yield`; on a
machine with more ranks than cores the pollers kept taking time slices from the ranks still
computing (on this 2-core machine, 4 ranks, back-to-back runs of compare_step_time.py's dp4 row
through shared memory, then named dp4_shm: a step of 163-175 ms polling against 159-160 ms
sleeping). Here it sleeps in the kernel on the
flag's word instead (`wait`), and a rank that changes its flag wakes the sleepers on it (`wake`):
the kernel compares the word with the value the sleeper last read before it sleeps, so a change made
in between is never missed. The words are in a file mapped shared by every rank (not FUTEX_PRIVATE).
Python has no futex call, so this one goes through libc's `syscall` (x86-64's number; the transport
runs only in 64-bit processes on x86-64 Linux, `SharedMemoryGroup` checks).
"""
from __future__ import annotations

import ctypes
import errno
import functools

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _syscall():
    call = ctypes.CDLL(None, use_errno=True).syscall  # loaded at first use: importing works anywhere
    call.restype = ctypes.c_long
    return call


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `address` holds `expected` (its low 32 bits), at most
    `timeout_s`; returns at once if it already holds something else. Callers re-read the word:
    a return says only that it may have changed (woken, timed out or interrupted)."""
    seconds = int(timeout_s)
    timeout = _Timespec(seconds, int((timeout_s - seconds) * 1e9))
    result = _syscall()(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                        ctypes.byref(timeout), None, 0)
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait: {errno.errorcode.get(code, code)}")


def wake(address: int) -> None:
    """Wake every process sleeping on the word at `address`."""
    if _syscall()(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0) == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"futex wake: {errno.errorcode.get(code, code)}")
