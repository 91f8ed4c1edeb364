"""The planner's layouts measured by this process and a forked copy (`autopar/layout_workers.py`):
the same results as one process, what the copy does not return measured here, a copy that hangs
killed, and a composed search that forks ranks the same candidates the same way as one that
does not (in a fresh interpreter: a pytest-xdist worker runs its channel's thread, so the search
itself would not fork here)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from autopar import layout_workers
from autopar.block_ledgers import Layout

pytestmark = pytest.mark.timeout(240)


def _square(n: int) -> tuple[int, int]:
    return n * n, os.getpid()


def test_items_split_with_a_forked_copy_give_what_one_process_gives():
    results = layout_workers.measured(_square, list(range(12)), fork=True)
    assert {n: value for n, (value, _) in results.items()} == {n: n * n for n in range(12)}
    pids = {pid for _, pid in results.values()}
    assert os.getpid() in pids and len(pids) == 2, "both processes measured some"


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

    def slow_in_the_copy(n: int) -> int:
        if os.getpid() != parent:
            time.sleep(0.3)
        return n

    warmed = []
    results = layout_workers.measured(slow_in_the_copy, list(range(8)), fork=True, warm=lambda: warmed.append(1),
                                      variants=lambda here: [100 + n for n in here if n < 100])
    assert warmed == [1] and all(results[n] == n for n in range(8))
    assert any(n >= 100 for n in results), "this process measured variants while the copy slept"
    assert all(n - 100 in results for n in results if n >= 100), "variants of what was measured"


def test_layouts_of_one_mesh_stay_together_and_those_without_context_parallelism_stay_here():
    layouts = [Layout(tp=t, cp=c, sequence_parallel=sp) for t in (2, 4) for c in (1, 2, 4) for sp in (False, True)]
    mine, theirs = layout_workers.split(layouts)
    assert sorted(mine + theirs, key=repr) == sorted(layouts, key=repr)
    assert {l.mesh_spec for l in mine}.isdisjoint({l.mesh_spec for l in theirs})
    assert all(l.cp > 1 for l in theirs) and theirs


SEARCH = textwrap.dedent('''
    import torch
    from autopar import layout_workers
    from autopar.cluster import Cluster
    from autopar.planner import search
    from autopar.search_space import SearchSpace
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


@pytest.mark.skipif(not sys.platform.startswith("linux") or layout_workers.usable_cpus() < 2,
                    reason="forks on Linux with two CPUs only")
def test_a_search_that_forks_ranks_every_candidate_as_one_that_does_not():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", SEARCH], cwd=root, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same" in done.stdout


def test_a_rank_of_an_initialised_process_group_does_not_fork(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(layout_workers.threading, "enumerate", lambda: [layout_workers.threading.current_thread()])
    monkeypatch.setattr(layout_workers, "usable_cpus", lambda: 2)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    assert not layout_workers.can_fork()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert layout_workers.can_fork() == sys.platform.startswith("linux")
