"""The planner's layouts measured by this process and a forked copy (`autopar/planner/layout_workers.py`):
the same results as one process, what the copy does not return measured here, a copy that hangs
killed, and a composed search that forks ranks the same candidates the same way as one that
does not, and a copy forked after parallel tensor ops runs (both in a fresh interpreter: what
earlier tests in this process ran would otherwise decide)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from autopar.planner import layout_workers
from autopar.planner.block_ledgers import Layout

pytestmark = pytest.mark.timeout(240)


def _square(n: int) -> tuple[int, int]:
    time.sleep(0.02)
    return n * n, os.getpid()


def test_items_split_with_a_forked_copy_give_what_one_process_gives():
    results = layout_workers.measured(_square, list(range(12)), fork=True)
    assert {n: value for n, (value, _) in results.items()} == {n: n * n for n in range(12)}
    pids = {pid for _, pid in results.values()}
    assert os.getpid() in pids and len(pids) == 2, "both processes measured some"


def test_groups_are_claimed_by_whichever_process_is_free():
    parent = os.getpid()

    def slow_in_the_copy(layout: Layout) -> int:
        time.sleep(0.5 if os.getpid() != parent else 0.02)
        return os.getpid()

    layouts = [Layout(tp=1, cp=2 ** (1 + n % 3), ep=2 ** (n // 3)) for n in range(12)]  # 12 meshes, none stays here
    results = layout_workers.measured(slow_in_the_copy, layouts, fork=True, warm=lambda: None)
    assert set(results) == set(layouts)
    here = sum(pid == parent for pid in results.values())
    assert here >= 10, f"this process measured {here} of 12 while the copy took 0.5 s each: claims are not dynamic"


def test_claims_that_do_not_fit_the_pipe_are_left_unclaimed_not_waited_for(monkeypatch):
    """More groups than a pipe holds (shrunk to one page, as a user over `pipe-user-pages-soft`
    gets): writing them all before anyone reads would block for ever; the records that fit are
    claimable, whole and in order, as many as the pipe holds."""
    import fcntl

    made = os.pipe

    def one_page() -> tuple[int, int]:
        reader, writer = made()
        fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)  # rounded up to a page
        return reader, writer

    monkeypatch.setattr(os, "pipe", one_page)
    claims = layout_workers._Claims(40_000)
    capacity = fcntl.fcntl(claims.reader, fcntl.F_GETPIPE_SZ)
    try:
        taken = []
        while (index := claims.next()) is not None:
            taken.append(index)
    finally:
        claims.close()
    assert taken == list(range(capacity // 2)) and len(taken) < 40_000


def test_groups_a_full_pipe_leaves_unclaimed_are_measured_here(monkeypatch):
    """As if the pipe held one group's record: the copy or this process claims it, the rest are
    measured here at the end — nothing waits, nothing is lost."""
    real = layout_workers._Claims

    def one_record(count: int):
        return real(min(count, 1))

    monkeypatch.setattr(layout_workers, "_Claims", one_record)
    layouts = [Layout(tp=1, cp=2 ** (1 + n % 3), ep=2 ** (n // 3)) for n in range(12)]
    results = layout_workers.measured(lambda layout: layout.cp * 10 + layout.ep, layouts, fork=True, warm=lambda: None)
    assert results == {layout: layout.cp * 10 + layout.ep for layout in layouts}


def test_what_a_dying_copy_does_not_return_is_measured_here():
    parent = os.getpid()

    def dies_in_the_copy(n: int) -> int:
        if os.getpid() != parent:
            os._exit(3)
        return n + 1

    assert layout_workers.measured(dies_in_the_copy, list(range(8)), fork=True) == {n: n + 1 for n in range(8)}


def test_a_copy_that_does_not_answer_is_killed_and_its_share_measured_here(monkeypatch):
    parent = os.getpid()
    monkeypatch.setattr(layout_workers, "timeout", lambda own: 1.0)

    def hangs_in_the_copy(n: int) -> int:
        if os.getpid() != parent:
            time.sleep(600)
        return -n

    start = time.perf_counter()
    assert layout_workers.measured(hangs_in_the_copy, list(range(8)), fork=True) == {n: -n for n in range(8)}
    assert time.perf_counter() - start < 30


def test_variants_are_measured_here_while_the_copy_works():
    parent = os.getpid()

    def slow_in_the_copy(layout: Layout) -> int:
        if os.getpid() != parent:
            time.sleep(0.3)
        return layout.tp

    def variants(here: dict):  # read lazily: each after the one before it was measured
        for layout in [layout for layout in here if layout.recompute is None and layout.cp == 1]:
            yield Layout(tp=layout.tp, recompute="full")
            assert Layout(tp=layout.tp, recompute="full") in here

    layouts = [Layout(tp=t, cp=c) for t in (1, 2, 4) for c in (1, 2, 4)]
    warmed = []
    results = layout_workers.measured(slow_in_the_copy, layouts, fork=True, warm=lambda: warmed.append(1),
                                      variants=variants)
    assert warmed == [1] and all(results[layout] == layout.tp for layout in layouts)
    measured_variants = [layout for layout in results if layout.recompute]
    assert measured_variants, "this process measured variants while the copy slept"
    assert all(Layout(tp=v.tp) in results for v in measured_variants), "variants of what was measured here"


def test_layouts_of_one_mesh_stay_together_and_those_without_context_parallelism_stay_here():
    layouts = [Layout(tp=t, cp=c, sequence_parallel=sp) for t in (2, 4) for c in (1, 2, 4) for sp in (False, True)]
    here, shared = layout_workers.split(layouts)
    assert sorted(here + [l for g in shared for l in g], key=repr) == sorted(layouts, key=repr)
    assert all(len({l.mesh_spec for l in group}) == 1 for group in shared), "a group is one mesh"
    assert {l.mesh_spec for l in here}.isdisjoint({l.mesh_spec for g in shared for l in g})
    assert here and all(l.cp == 1 for l in here) and all(l.cp > 1 for g in shared for l in g)
    weights = [sum(layout_workers._weight(l) for l in g) for g in shared]
    assert weights == sorted(weights, reverse=True), "the heaviest groups are claimed first"


def test_without_context_parallelism_half_stays_here_and_half_is_claimed():
    layouts = [Layout(tp=t, sequence_parallel=sp) for t in (1, 2, 4, 8) for sp in (False, True)]
    here, shared = layout_workers.split(layouts)
    assert len(here) == 4 and sum(len(g) for g in shared) == 4


SEARCH = textwrap.dedent('''
    import torch
    from autopar.planner import layout_workers
    from autopar.cost.cluster import Cluster
    from autopar.planner.search import search
    from autopar.planner.search_space import SearchSpace
    from examples.gpt import GPT, GPTConfig, example_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(n_layer=4, d_model=64, n_head=4, d_ff=256, seq_len=64)
    model, batch = GPT(config), example_batch(config, batch=16)
    cluster = Cluster(nodes=4, gpus_per_node=8, memory_gb=0.05, intra_gbps=100, inter_gbps=10, peak_tflops=10)
    space = SearchSpace(context_tokens=16)

    def ranked():
        result = search(model, cluster, example_inputs=batch, space=space, method="blocks")
        return [(o.candidate.label, None if o.estimate is None else (o.estimate.seconds, o.estimate.peak_bytes),
                 o.refused) for o in result.outcomes]

    forks = []
    real_fork = layout_workers.os.fork
    def counted():
        forks.append(1)
        return real_fork()
    layout_workers.os.fork = counted
    assert layout_workers.can_fork(), "a fresh interpreter on a machine with two CPUs may fork"
    forked = ranked()
    assert forks, "the search forked"
    layout_workers.can_fork = lambda: False
    assert forked == ranked(), "forked and serial searches differ"
    print("same", len(forked))
''')


def _fresh_interpreter(script: str) -> str:
    """`script`'s standard output, run by a new Python in the repository (it must exit 0)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux") or layout_workers.usable_cpus() < 2,
                    reason="forks on Linux with two CPUs only")
def test_a_search_that_forks_ranks_every_candidate_as_one_that_does_not():
    assert "same" in _fresh_interpreter(SEARCH)


AFTER_PARALLEL_OPS = textwrap.dedent('''
    import os, time
    import torch
    from autopar.planner import layout_workers

    torch.set_num_threads(2)
    a = torch.randn(256, 256)
    for _ in range(20):  # this process's OpenMP pool started, as by any training step before planning
        (a @ a).exp_().sum()

    def measure(n):
        b = torch.randn(256, 256)
        return float((b @ b).exp().sum() > -1), os.getpid()

    start = time.perf_counter()
    results = layout_workers.measured(measure, list(range(12)), fork=True)
    print("copy answered", len({pid for _, pid in results.values()}) == 2, "seconds", time.perf_counter() - start)
''')


@pytest.mark.skipif(not sys.platform.startswith("linux") or layout_workers.usable_cpus() < 2,
                    reason="forks on Linux with two CPUs only")
def test_a_copy_forked_after_parallel_tensor_ops_runs_its_kernels():
    """A fork copies the calling thread alone: in a process whose OpenMP pool has started, the
    copy's first parallel kernel waited for ever for workers it does not have, and the planner
    waited out the copy's timeout (a composed search of the Qwen3-MoE test: 75 s instead of 8,
    after one matmul). The copy runs on one thread (`layout_workers._one_thread`); fresh
    interpreter: a pytest worker has run tensor ops of its own."""
    output = _fresh_interpreter(AFTER_PARALLEL_OPS)
    assert "copy answered True" in output, output


def test_a_rank_of_an_initialised_process_group_does_not_fork(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(layout_workers.threading, "enumerate", lambda: [layout_workers.threading.current_thread()])
    monkeypatch.setattr(layout_workers, "usable_cpus", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert not layout_workers.can_fork()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert layout_workers.can_fork() == sys.platform.startswith("linux")
