"""The planner: the op ledger's FLOPs against PyTorch's own counter, the step estimate's arithmetic,
the search's ranking, `autopar.plan(model, cluster=...)`, the CLI's `--auto`, and its refusals;
`autopar.parallelize(model, cluster=...)` on two gloo ranks against one device.

FLOPs are measured from outside: `torch.utils.flop_counter.FlopCounterMode` counts the single-device
model's forward and backward on the whole batch; data parallelism over n ranks must give each rank
1/n of both, and the tensor-parallel ranks together exactly the model's (every matrix product and
attention product is split, none repeated). The estimate's parts are recomputed here from the
ledgers and the cluster's figures with overlap 0 (nothing hides) and overlap 1 (backward hides
the gradient buckets but the last one). Whether the predicted times rank the measured ones is
the benchmark's question (`benchmarks/planner_vs_measured.py`), not a unit test's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar import Cluster, PlanError, SearchSpace
from autopar.cost.comm_cost import comm_time
from autopar.compiler.ledger.fake_run import rank_ops
from autopar.cost.step_cost import estimate
from autopar.measure.storages import LiveStorages
from examples.gpt import GPT, GPTConfig, example_batch
from autopar.runtime.launch import launch
from tests.cli_in_process import run_cli
from autopar.measure.step_peaks import step_peaks
from tests.numerics import EPS, LR, single_device
from tests.numerics_checks import max_relative_error

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)


def _two_ranks(**changes) -> Cluster:
    figures = dict(nodes=1, gpus_per_node=2, memory_gb=1.0, intra_gbps=1.0, inter_gbps=1.0, peak_tflops=0.05,
                   intra_latency_us=100, inter_latency_us=100, memory_gbps=10, op_overhead_us=5, name="two")
    return Cluster(**{**figures, **changes})


def _single_device_flops(model: torch.nn.Module, batch: tuple) -> tuple[int, int]:
    with FlopCounterMode(display=False) as forward:
        loss = model(*batch)
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def test_the_op_ledger_splits_the_models_flops_over_the_ranks():
    torch.manual_seed(0)
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    forward, backward = _single_device_flops(model, batch)
    assert forward > 0 and backward >= 2 * forward * 0.9
    dp = autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch)
    for rank in range(2):
        ops = rank_ops(dp, rank)
        assert (2 * ops.forward.flops, 2 * ops.backward.flops) == (forward, backward)
    tp = autopar.plan(model, "tp=2", strategies=[autopar.tensor_parallel()], example_inputs=batch)
    both = [rank_ops(tp, rank) for rank in range(2)]
    assert sum(o.forward.flops for o in both) == forward
    assert sum(o.backward.flops for o in both) == backward


def test_the_estimate_adds_compute_exposed_communication_and_the_optimizer():
    torch.manual_seed(0)
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    # small buckets: several gradient all-reduces, of which all but the last can hide behind backward
    dp = autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch, bucket_cap_mb=0.02)
    assert len(dp.buckets) > 2
    ops = rank_ops(dp, 0)
    for overlap in (0.0, 1.0):
        cluster = _two_ranks(overlap=overlap)
        result = estimate(dp, cluster)
        forward, backward = ops.forward.seconds(cluster), ops.backward.seconds(cluster)
        assert result.parts["compute"] == pytest.approx(forward + backward)
        rows = comm_time(dp, cluster).rows
        buckets = [r.per_call for r in rows for _ in range(r.calls) if r.phase == "grad_sync"]
        others = sum(r.seconds for r in rows if r.phase != "grad_sync")
        grad = sum(buckets)
        exposed = grad if overlap == 0 else max(grad - backward, buckets[-1])
        assert result.parts["communication"] == pytest.approx(others + exposed)
        assert result.parts["bubble"] == 0.0
        memory = dp.memory(rank=0).by_category()
        assert result.held_bytes == sum(memory.values())
        assert result.peak_bytes == max(result.moments.values())
        assert result.moments["backward starts"] >= result.held_bytes - memory["transient"]  # all held, the working on top
        # AdamW: 12 calls and 7 x the bytes of every parameter the rank updates
        params = sum(p.numel() * 4 for p in model.parameters())
        tensors = len(list(model.parameters()))
        assert result.parts["optimizer"] == pytest.approx(12 * tensors * 5e-6 + 7 * params / 10e9)
        assert result.seconds == pytest.approx(sum(result.parts.values()))
    assert estimate(dp, _two_ranks(overlap=1.0)).seconds < estimate(dp, _two_ranks(overlap=0.0)).seconds


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_input_gradient_reductions_hide_behind_the_weight_gradient_taps(sequence_parallel):
    """The scheduling pass issues each f's all-reduce (SP: the all-gather's reduce-scatter) in
    backward before the weight-gradient GEMMs of the linears it feeds and lands it after them: the
    ledger marks those reductions, the op ledger counts the taps' calls (their FLOPs are the
    weight-gradient products, computed here from the model's shapes), and the estimate hides the
    reductions behind the taps by the cluster's overlap share. With the pass off nothing is marked."""
    torch.manual_seed(0)
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    layout = [autopar.tensor_parallel()] + ([autopar.sequence_parallel()] if sequence_parallel else [])
    on = autopar.plan(model, "tp=2", strategies=layout, example_inputs=batch)
    off = autopar.plan(model, "tp=2", strategies=layout + [autopar.schedule(overlap=False)], example_inputs=batch)
    reduction = "reduce_scatter" if sequence_parallel else "all_reduce"
    marked = [e for e in on.comm.entries if e.behind]
    # per layer q, k, v's reduction and the up projection's; the head's
    assert len(marked) == 2 * CONFIG.n_layer + 1
    assert {(e.phase, e.kind, e.axis, e.behind) for e in marked} == {("backward", reduction, "tp", "weight gradients")}
    assert not any(e.behind for e in off.comm.entries)
    rows, d = 4 * CONFIG.seq_len, CONFIG.d_model
    tap_flops = 2 * rows * d * (CONFIG.n_layer * (3 * d + CONFIG.d_ff) + CONFIG.vocab_size) // 2
    assert rank_ops(on, 0).taps.flops == tap_flops and rank_ops(off, 0).taps.calls == 0
    for overlap in (0.0, 1.0):
        cluster = _two_ranks(overlap=overlap)
        rows_on = comm_time(on, cluster).rows
        hidden = sum(r.seconds for r in rows_on if r.behind)
        others = sum(r.seconds for r in rows_on if not r.behind)
        taps = rank_ops(on, 0).taps.seconds(cluster)
        assert 0 < hidden and 0 < taps
        exposed = hidden - min(hidden, overlap * taps)
        assert estimate(on, cluster).parts["communication"] == pytest.approx(others + exposed)
        assert estimate(off, cluster).parts["communication"] == pytest.approx(sum(r.seconds for r in
                                                                                  comm_time(off, cluster).rows))
    assert (estimate(on, _two_ranks(overlap=1.0)).parts["communication"]
            < estimate(on, _two_ranks(overlap=0.0)).parts["communication"])


def test_a_pipeline_is_priced_by_its_schedule():
    torch.manual_seed(0)
    model, batch = GPT(dataclasses.replace(CONFIG, n_layer=4)), example_batch(CONFIG, batch=8)
    spans = {}
    for micro in (2, 8):
        pp = autopar.plan(model, "pp=2", strategies=[autopar.pipeline_parallel(microbatches=micro)],
                          example_inputs=batch)
        result = estimate(pp, _two_ranks())
        assert result.parts["bubble"] > 0
        spans[micro] = result.parts["bubble"] / (result.parts["bubble"] + result.parts["compute"])
    assert spans[8] < spans[2]  # more micro-batches, smaller bubble: (p-1)/(m+p-1)


def test_a_pipelines_hand_over_waits_a_lone_messages_latency_where_the_cluster_states_one():
    """Between two stages one rank sends to one other while the rest compute or wait — not a
    collective step of all of them: `Cluster.p2p_latency_us` prices the hand-over where stated
    (`calibrate` measures it; on this machine's shared cores ~50 µs against a collective step's
    ~1 ms: with the step's α every 4-rank pipeline was priced 10–20% slow against dp × pp). The
    first micro-batch crosses the boundary down and the last one's gradient up on the critical
    path, so the span moves by at least twice the change."""
    torch.manual_seed(0)
    model, batch = GPT(dataclasses.replace(CONFIG, n_layer=4)), example_batch(CONFIG, batch=8)
    pp = autopar.plan(model, "pp=2", strategies=[autopar.pipeline_parallel(microbatches=4)], example_inputs=batch)
    slow = dict(intra_latency_us=2000, inter_latency_us=2000)
    link = estimate(pp, _two_ranks(**slow))
    stated = estimate(pp, _two_ranks(**slow, p2p_latency_us=2000))
    lone = estimate(pp, _two_ranks(**slow, p2p_latency_us=50))
    assert stated.parts == pytest.approx(link.parts)  # the same α as the link's: the same estimate
    assert lone.parts["compute"] == pytest.approx(link.parts["compute"])
    assert link.parts["bubble"] - lone.parts["bubble"] >= 2 * (2000 - 50) * 1e-6 * (1 - 1e-9)
    with pytest.raises(PlanError, match="p2p_latency_us=-1; a latency is a number >= 0"):
        _two_ranks(p2p_latency_us=-1)


def test_a_pipeline_stage_pays_for_its_context_ring_at_every_micro_batch():
    """Context parallelism's ring sends are a stage's own work, made at every micro-batch: the
    pipeline's span holds the busiest stage's compute and all of its ring sends (nothing hides
    them at overlap 0). They were once taken for the pipeline's hand-over latency, one send's
    time per boundary, and a pp × cp candidate's step came out 0.6× the measured one."""
    torch.manual_seed(0)
    model, batch = GPT(dataclasses.replace(CONFIG, n_layer=4)), example_batch(CONFIG, batch=8)
    plan = autopar.plan(model, "pp=2,cp=2", strategies=[autopar.pipeline_parallel(microbatches=4),
                                                         autopar.context_parallel()], example_inputs=batch)
    cluster = _two_ranks(gpus_per_node=4, intra_latency_us=2000, inter_latency_us=2000)
    result = estimate(plan, cluster)
    for stage in plan.stages:
        rank = next(r for r in range(4) if stage in plan.stages_of_rank(r))
        ring = [row for row in comm_time(plan, cluster, rank=rank).rows
                if row.axis == "cp" and row.kind == "send" and row.stage == stage.index]
        assert sum(row.calls for row in ring) == 2 * 4 * (2 + 2 + 2 * 2)  # 2 layers x 4 micro-batches x (K, V; K, V again; dK, dV twice, home)
        ops = rank_ops(plan, rank, stage=stage.index)
        busy = ops.forward.seconds(cluster) + ops.backward.seconds(cluster) + sum(row.seconds for row in ring)
        assert result.seconds - result.parts["optimizer"] >= busy


def test_the_search_ranks_every_candidate_and_plan_returns_the_winner():
    torch.manual_seed(0)
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    space = SearchSpace(axes=("dp", "tp"), zero_stages=(0, 3))
    result = autopar.search(model, _two_ranks(), example_inputs=batch, space=space)
    labels = [o.candidate.label for o in result.outcomes]
    assert sorted(labels) == sorted(["dp2", "dp2 zero3", "tp2", "tp2+sp"])
    times = [o.estimate.seconds for o in result.outcomes]
    assert times == sorted(times) and result.best.plan is not None
    assert all(o.plan is None for o in result.outcomes[1:])  # one plan kept: the winner's
    table = result.table()
    assert all(label in table for label in labels) and "chosen" in table and "step:" in table
    assert "binding constraint:" in result.explain()
    chosen = autopar.plan(model, cluster=_two_ranks(), example_inputs=batch, space=space)
    assert str(chosen.mesh) == str(result.best.plan.mesh) and chosen.search.best.candidate == result.best.candidate


def test_recomputation_is_tried_where_memory_does_not_fit():
    """Selective first (the cheaper), full where selective does not fit either (explicit attention:
    the [b, h, s, s] scores are what selective recomputation drops)."""
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, d_model=64, d_ff=256, explicit_attention=True)
    model, batch = GPT(config), example_batch(config, batch=16)
    space = SearchSpace(axes=("dp",), zero_stages=(3,))
    peaks = {policy: estimate(autopar.plan(model, "dp=2", strategies=[autopar.zero(stage=3)] + (
        [autopar.recompute(policy)] if policy else []), example_inputs=batch), _two_ranks()).peak_bytes
        for policy in (None, "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks[None]
    for low, high, chosen in (("selective", None, "selective"), ("full", "selective", "full")):
        between = (peaks[low] + peaks[high]) / 2 / 10 ** 9
        result = autopar.search(model, _two_ranks(memory_gb=between), example_inputs=batch, space=space)
        assert result.best.candidate.label == f"dp2 zero3 × recompute {chosen}"
        assert [o.fits for o in result.outcomes] == [True] + [False] * (2 if chosen == "full" else 1)


def test_the_sequence_parallel_regather_is_tried_before_recomputation():
    """Between the peaks of tp2+SP with and without the re-gather in backward, the composed search
    answers with the re-gather (cheaper than recomputing anything)."""
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, d_model=64, d_ff=256, seq_len=64)
    model, batch = GPT(config), example_batch(config, batch=8)
    space = SearchSpace(axes=("tp",), sequence_parallel=(True,))
    peaks = {regather: estimate(autopar.plan(model, "tp=2", strategies=[autopar.sequence_parallel(
        regather_in_backward=regather)], example_inputs=batch), _two_ranks()).peak_bytes for regather in (False, True)}
    assert peaks[True] < peaks[False]
    between = (peaks[True] + peaks[False]) / 2 / 10 ** 9
    result = autopar.search(model, _two_ranks(memory_gb=between), example_inputs=batch, space=space, method="blocks")
    assert result.best.candidate.label == "tp2+sp regather"
    assert [o.candidate.label for o in result.outcomes] == ["tp2+sp regather", "tp2+sp"]


def test_a_model_that_fits_nowhere_names_the_smallest_memory_it_needs():
    torch.manual_seed(0)
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    space = SearchSpace(axes=("dp",), zero_stages=(0, 3), recompute=())
    with pytest.raises(PlanError, match=r"fits nowhere on two: the smallest peak any candidate needs is .* GB per "
                                        r"rank \(dp2( zero3)?\), and a rank has 1e-06 GB"):
        autopar.search(model, _two_ranks(memory_gb=1e-6), example_inputs=batch, space=space)


def test_a_world_no_layout_fits_and_bad_requests_are_refused():
    model, batch = GPT(CONFIG), example_batch(CONFIG, batch=4)
    two_nodes = _two_ranks(nodes=2, gpus_per_node=1)
    with pytest.raises(PlanError, match="no layout of 2 ranks passes the rules: tp=2 crosses nodes of 1"):
        autopar.search(model, two_nodes, example_inputs=batch, space=SearchSpace(axes=("tp",)))
    odd = example_batch(CONFIG, batch=3)  # 3 rows split over no dp degree of 2; tp=2 needs 2 heads...
    with pytest.raises(PlanError, match="the compiler refused every candidate layout of 2 ranks"):
        autopar.search(model, _two_ranks(), example_inputs=odd, space=SearchSpace(axes=("dp",)))
    with pytest.raises(PlanError, match="give either cluster= alone or a mesh and strategies"):
        autopar.plan(model, "dp=2", strategies=[autopar.data_parallel()], example_inputs=batch, cluster=two_nodes)
    with pytest.raises(PlanError, match="plan needs a mesh and strategies, or neither"):
        autopar.plan(model, "dp=2", example_inputs=batch)
    with pytest.raises(PlanError, match="overlap=1.5"):
        _two_ranks(overlap=1.5)


def test_the_cli_prints_the_ranking_and_explains_the_winner(tmp_path):
    result = run_cli("plan", "examples.gpt:example", "--cluster", "cpu2x4", "--auto", "--axes", "dp,tp", "--top", "3")
    assert result.returncode == 0, result.stderr
    assert "why not chosen" in result.stdout and "chosen:" in result.stdout and "binding constraint:" in result.stdout
    assert len([line for line in result.stdout.splitlines() if line[:1].isdigit()]) == 3
    explained = run_cli("explain", "examples.gpt:example", "--cluster", "cpu2x4", "--axes", "dp")
    assert explained.returncode == 0, explained.stderr
    assert explained.stdout.startswith("chosen: dp4")
    saved = tmp_path / "auto.json"  # the chosen plan is an ordinary plan file
    assert run_cli("plan", "examples.gpt:example", "--cluster", "cpu2x4", "--auto", "--axes", "dp",
                   "--save", str(saved)).returncode == 0
    node = run_cli("explain", str(saved), "layers.0.mlp")
    assert node.returncode == 0 and "module layers.0.mlp" in node.stdout
    missing = run_cli("plan", "examples.gpt:example", "--auto")
    assert missing.returncode == 2 and "need --cluster NAME" in missing.stderr


PARALLELIZE_SPACE = SearchSpace(axes=("dp", "tp"), zero_stages=(0, 3))


def _chosen_and_trained(rank: int, world: int, batches: list[tuple]) -> dict:
    """parallelize(cluster=) on this rank: rank 0's planner chooses, every rank trains the winner;
    then a cluster of another size, a cluster with a mesh, and an option the planner would not honour
    (bucket_cap_mb) are refused before anything is planned."""
    torch.manual_seed(0)
    module = autopar.parallelize(GPT(CONFIG), cluster=_two_ranks(), space=PARALLELIZE_SPACE, example_inputs=batches[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(module.train_step(*module.local_batch(*batch))))
        optimizer.step()
    refused = []
    for wrong in (dict(cluster=_two_ranks(nodes=2)), dict(cluster=_two_ranks(), mesh="dp=2"),
                  dict(cluster=_two_ranks(), bucket_cap_mb=1.0)):
        try:
            autopar.parallelize(GPT(CONFIG), example_inputs=batches[0], **wrong)
            refused.append("")
        except PlanError as error:
            refused.append(str(error))
    return {"mesh": str(module.plan.mesh), "losses": losses, "full": module.full_state_dict(), "refused": refused}


@pytest.mark.timeout(300)
def test_parallelize_with_a_cluster_trains_the_planners_choice_like_one_device():
    """Two gloo ranks: the mesh they run is the search's winner for that cluster (searched here too),
    and three AdamW steps give one device's losses and parameters (fp32, rel <= 1e-5)."""
    batches = [example_batch(CONFIG, batch=4, seed=step) for step in range(3)]
    expected = autopar.search(GPT(CONFIG), _two_ranks(), example_inputs=batches[0], space=PARALLELIZE_SPACE)
    results = launch(_chosen_and_trained, 2, batches, timeout_s=240)
    assert {r["mesh"] for r in results} == {str(_two_ranks().mesh(expected.best.candidate.mesh_spec))}
    reference = single_device(lambda: GPT(CONFIG), batches)
    for result in results:
        assert max(abs(a / float(b) - 1) for a, b in zip(result["losses"], reference["losses"])) <= 1e-5
        for name, value in reference["params"][-1].items():
            assert max_relative_error(result["full"][name], value) <= 1e-5, name
    for result in results:
        too_big, both, ignored = result["refused"]
        assert "cluster two has 4 ranks but this job has 2" in too_big and "fix:" in too_big
        assert "it takes no mesh, strategies" in both and "fix:" in both
        assert "bucket_cap_mb" in ignored and "fix:" in ignored


# ZeRO's gradient reduction and ZeRO-1/2's re-gather declared, not "auto": the prediction is planned
# here, without the measured run's process group, and must describe the program the run executes
# (gloo: the exchange, the owners' broadcasts)
PEAK_CANDIDATES = [("dp=2", lambda: [autopar.data_parallel()]),
                   ("tp=2", lambda: [autopar.tensor_parallel()]),
                   ("dp=2", lambda: [autopar.zero(stage=1, reduce="all_to_all", gather="broadcast")]),
                   ("dp=2", lambda: [autopar.zero(stage=2, reduce="all_to_all", gather="broadcast")]),
                   ("dp=2", lambda: [autopar.zero(stage=3, reduce="all_to_all")]),
                   ("pp=2", lambda: [autopar.pipeline_parallel(schedule="1f1b", microbatches=4)]),
                   ("pp=2", lambda: [autopar.pipeline_parallel(schedule="gpipe", microbatches=2)])]
# on four ranks the peak of sharded units sits where backward gathers the last block again, or
# (a pipeline's last stage) where a micro-batch's backward hands a block's gradients over; the
# reduction and the re-gather declared as above
FOUR_RANK_PEAK_CANDIDATES = [("dp=4", lambda: [autopar.zero(stage=3, reduce="all_to_all")]),
                             ("dp_rep=2,dp_shard=2", lambda: list(autopar.hsdp(reduce="all_to_all"))),
                             ("dp=4", lambda: [autopar.zero(stage=2, reduce="all_to_all", gather="broadcast")]),
                             ("pp=2,dp=2", lambda: [autopar.pipeline_parallel(schedule="gpipe", microbatches=4),
                                                    autopar.zero(stage=1, reduce="all_to_all", gather="broadcast")])]


def _measured_peaks(rank: int, world: int, candidates: str, config: GPTConfig, batch: tuple) -> list[int]:
    """Each candidate's steps after the first (zero_grad, train_step, AdamW) under `LiveStorages`:
    the most live bytes, the batch taken out, the lowest of three steps (gloo's worker threads let
    a finished collective's tensors go a moment late, at random) — measured from outside, nothing
    asked of the runtime (`autopar/measure/step_peaks.py`)."""
    torch.set_num_threads(1)
    peaks = []
    for mesh, strategies in globals()[candidates]:
        storages = LiveStorages()
        storages.track(list(batch))
        with storages:
            torch.manual_seed(0)
            module = autopar.parallelize(GPT(config), mesh, strategies=strategies(), example_inputs=batch)
            optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
            steps = step_peaks(module, optimizer, batch, storages)
        peaks.append(min(steps[1:]))
        del module, optimizer
    return peaks


@pytest.mark.timeout(240)
def test_the_predicted_peak_is_the_measured_peak_within_5_percent():
    """The step's peak memory, predicted as the largest of its moments (`autopar/compiler/ledger/peak.py`), against
    the peak measured from outside on two gloo ranks: DDP-style buckets, tensor parallelism, ZeRO
    1/2/3, 1F1B and GPipe."""
    config = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64, d_ff=256)
    batch = example_batch(config, batch=8)
    measured = launch(_measured_peaks, 2, "PEAK_CANDIDATES", config, batch, timeout_s=120)
    cluster = _two_ranks()
    for index, (mesh, strategies) in enumerate(PEAK_CANDIDATES):
        predicted = estimate(autopar.plan(GPT(config), mesh, strategies=strategies(), example_inputs=batch), cluster)
        peak = max(ranks[index] for ranks in measured)
        assert abs(predicted.peak_bytes / peak - 1) <= 0.05, (mesh, strategies(), predicted.moments, peak)


@pytest.mark.timeout(240)
def test_a_sharded_step_holds_the_heads_gradient_while_backward_gathers_the_blocks_again():
    """ZeRO-3 and HSDP on four ranks (ZeRO-2 beside them): the peak sits where backward gathers
    the last block again, with the head's whole gradient alive — the root unit hands its gradients
    over only when the embedding's is made, at the end of backward. The moment without it read
    5.4% under the measured peak on this model (16 KB: the head's [128, 32] gradient); with it
    the prediction is 232 bytes over (+0.1%), within 1% here. And a pipeline's last stage under
    ZeRO-1 (GPipe, 4 micro-batches): a micro-batch's backward hands the head's unit over first, a
    block's after it holds more; priced at the first unit's, the stage read 3.1% under."""
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
    batch = example_batch(config, batch=8)
    measured = launch(_measured_peaks, 4, "FOUR_RANK_PEAK_CANDIDATES", config, batch, timeout_s=180)
    cluster = _two_ranks(gpus_per_node=4)
    for index, (mesh, strategies) in enumerate(FOUR_RANK_PEAK_CANDIDATES):
        predicted = estimate(autopar.plan(GPT(config), mesh, strategies=strategies(), example_inputs=batch), cluster)
        peak = max(ranks[index] for ranks in measured)
        assert abs(predicted.peak_bytes / peak - 1) <= 0.01, (mesh, predicted.moments, peak)
