"""Pipeline parallelism without processes: schedules as data, the split into stage graphs, the
point-to-point and bubble ledgers, activations in flight, and every bad input refused at plan time.

- Every schedule, for p in 2..4, v in 1..2, m in 1..16, runs to the end in the simulator (no rank
  waits forever) and holds the micro-batches the literature says (GPipe m, 1F1B p - c on rank c,
  ZB-H1 at most p), with the textbook bubble at equal stage costs: (p-1)/(m+p-1) for GPipe and
  1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1, (p-1)/(6m+p-1) for DualPipeV
  (m >= 2p), whose rank c holds its stages c and 2p-1-c and 2p-c micro-batches of the first.
- The example GPT on pp=2 sends exactly the residual stream (b/m·s·h·4 bytes per micro-batch
  per boundary, forward, and its gradient back); rotary tables and masks of HF Llama are
  recomputed in each stage, not sent; a tied GPT-2 embedding and LM head are held by the first
  and last stage and summed over a `pp@0,1` group.
- The memory ledger's activations follow the schedule: 1F1B's first stage holds fewer than GPipe's.
"""
from __future__ import annotations

import pytest
import sympy
import torch

import autopar
from autopar.core import schedules
from autopar.core.errors import PlanError
from autopar.compiler.ledger.activations import saved_activations
from autopar.compiler.ledger.bubble import build_bubble_ledger
from autopar.core.ops import p2p
from examples.gpt import GPT, GPTConfig, example_batch

CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=4, n_head=4, d_model=32, d_ff=64)


def plan_gpt(mesh: str, *strategies, config: GPTConfig = CONFIG, batch: int = 8, **options) -> autopar.Plan:
    torch.manual_seed(0)
    return autopar.plan(GPT(config), mesh, strategies=list(strategies), example_inputs=example_batch(config, batch=batch),
                        **options)


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved_1f1b", 2),
                                              ("zb_h1", 1), ("dualpipev", 2)])
def test_every_schedule_completes_and_matches_the_bubble_formula(schedule, virtual):
    split = schedule in schedules.SPLIT_BACKWARD
    for p in (2, 3, 4):
        for m in range(1, 17):
            if schedule == "interleaved_1f1b" and m % p or schedule == "dualpipev" and m < 2 * p:
                continue
            orders = schedules.actions(schedule, degree=p, virtual=virtual, microbatches=m)
            stages = p * virtual
            every = {(a.kind, a.stage, a.microbatch) for order in orders for a in order}
            assert len(every) == sum(len(o) for o in orders) == stages * m * (3 if split else 2)
            cost = (lambda a: 1.0) if split else (lambda a: 1.0 if a.kind == "F" else 2.0)
            timed = schedules.simulate(orders, cost, stages=stages, split_backward=split)
            idle = schedules.bubble_fractions(timed, p)
            if schedule == "dualpipev":  # each rank idles p - 1 actions of its half-size stages
                expected = (p - 1) / (6 * m + p - 1)
            elif schedule == "zb_h1":
                expected = (p - 1) / (3 * m + p - 1) if m >= p else None
            elif schedule == "interleaved_1f1b" or virtual > 1:  # breadth-first: the formula once m >= p
                expected = (p - 1) / (virtual * m + p - 1) if m >= p else None
            else:
                expected = (p - 1) / (m + p - 1)
            if expected is not None:
                assert all(abs(f - expected) < 1e-9 for f in idle), (p, m, idle, expected)
            held = [schedules.in_flight(order, split_backward=split) for order in orders]
            if schedule == "1f1b":
                assert [h[c] for c, h in enumerate(held)] == [min(p - c, m) for c in range(p)]
            if schedule == "gpipe" and virtual == 1:
                assert all(h[c] == m for c, h in enumerate(held))
            if schedule == "zb_h1":
                assert max(max(h.values()) for h in held) == min(p, m)
            if schedule == "dualpipev":  # rank c: 2p - c micro-batches of its first stage (half a 1F1B stage each)
                assert [h[c] for c, h in enumerate(held)] == [2 * p - c for c in range(p)]
                assert all(set(h) == set(schedules.v_stages(p, c)) for c, h in enumerate(held))


def test_a_schedule_that_waits_on_itself_is_reported():
    orders = [[schedules.Action("B", 0, 0), schedules.Action("F", 0, 0)],
              [schedules.Action("F", 1, 0), schedules.Action("B", 1, 0)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        schedules.simulate(orders, lambda a: 1.0, stages=2)


def test_processor_sharing_slows_what_runs_together():
    orders = schedules.actions("gpipe", degree=4, virtual=1, microbatches=8)
    alone = schedules.simulate(orders, lambda a: 1.0, stages=4)
    shared = schedules.simulate(orders, lambda a: 1.0, stages=4, cores=2)
    assert max(t.end for t in alone) == 22.0
    assert max(t.end for t in shared) >= 4 * 16 / 2  # 64 units of work on 2 cores


def test_the_split_sends_the_residual_stream_and_its_gradient():
    plan = plan_gpt("pp=2", autopar.pipeline_parallel(microbatches=4), dynamic_dims={"b": 0, "s": 1})
    assert [len(s.sends) for s in plan.stages] == [1, 0] and [len(s.receives) for s in plan.stages] == [0, 1]
    assert plan.pipeline.starts == ("layers.2",)
    b, s = sympy.symbols("b s", positive=True, integer=True)
    p2p_entries = [e for e in plan.comm.entries if e.kind in ("send", "recv")]
    assert len(p2p_entries) == 4 and all(e.times == 4 and e.axis == "pp" for e in p2p_entries)
    # traced at one micro-batch: b is the micro-batch, the residual stream is b*s*h fp32
    assert all(sympy.simplify(e.logical_bytes - 4 * 32 * b * s) == 0 for e in p2p_entries)
    assert {(e.stage, e.phase, e.kind) for e in p2p_entries} == {
        (0, "forward", "send"), (0, "backward", "recv"), (1, "forward", "recv"), (1, "backward", "send")}
    by_rank = [plan.comm.by_key(rank=r) for r in range(2)]
    micro_bytes = 2 * 16 * 32 * 4  # b=8/m=4 rows, s=16, h=32, fp32
    assert by_rank[0][("forward", "send", "pp")] == (4, 4 * micro_bytes)
    assert by_rank[1][("backward", "send", "pp")] == (4, 4 * micro_bytes)
    assert by_rank[0][("step", "broadcast", "pp")] == (1, 4)


def test_dualpipev_holds_its_stages_in_a_v_and_hands_over_at_the_turn_in_memory():
    """pp=2: rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and 2; the
    hand-over from stage 1 to 2 stays on rank 1 (no ledger entry), the other two cross; the
    bubble ledger's balanced-stage formula is DualPipeV's (p-1)/(6m+p-1)."""
    plan = plan_gpt("pp=2", autopar.pipeline_parallel(schedule="dualpipev", microbatches=4))
    layout = plan.pipeline
    assert layout.virtual == 2 and [layout.coordinate(s) for s in range(4)] == [0, 1, 1, 0]
    assert [s.index for s in plan.stages_of_rank(0)] == [0, 3] and [s.index for s in plan.stages_of_rank(1)] == [1, 2]
    crossing = {(e.stage, e.phase, e.kind) for e in plan.comm.entries if e.kind in ("send", "recv")}
    assert crossing == {(0, "forward", "send"), (1, "forward", "recv"), (0, "backward", "recv"),
                        (1, "backward", "send"), (2, "forward", "send"), (3, "forward", "recv"),
                        (2, "backward", "recv"), (3, "backward", "send")}
    held = {plan.context.placeholders[n.name].target for s in plan.stages_of_rank(0)
            for n in s.graph_module.graph.nodes if n.op == "placeholder"}
    assert {"embed_tokens.weight", "lm_head.weight"} <= held
    bubble = build_bubble_ledger(plan)
    assert bubble.formula == pytest.approx(1 / 25)


def test_first_and_last_stage_carry_embedding_and_head():
    plan = plan_gpt("pp=2", autopar.pipeline_parallel(microbatches=2))
    held = [{plan.context.placeholders[n.name].target for n in s.graph_module.graph.nodes if n.op == "placeholder"}
            for s in plan.stages]
    assert "embed_tokens.weight" in held[0] and "embed_tokens.weight" not in held[1]
    assert "lm_head.weight" in held[1] and "lm_head.weight" not in held[0]
    assert {p for p in held[0] if p.startswith("layers.")} == {p for p in held[0] if p.startswith(("layers.0", "layers.1"))}


def test_declared_cuts_and_virtual_stages():
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=8, n_head=4, d_model=32, d_ff=64)
    plan = plan_gpt("pp=2", autopar.pipeline_parallel(schedule="interleaved_1f1b", microbatches=4, virtual_stages=2,
                                                      stages=["layers.3", "layers.5", "layers.7"]), config=config)
    assert plan.pipeline.starts == ("layers.3", "layers.5", "layers.7") and plan.pipeline.balance == "declared"
    assert [s.index for s in plan.stages_of_rank(0)] == [0, 2] and [s.index for s in plan.stages_of_rank(1)] == [1, 3]
    assert [(b.source, b.target) for s in plan.stages for b in s.sends] == [(0, 1), (1, 2), (2, 3)]


def test_hf_llama_recomputes_rotary_tables_and_masks_in_each_stage():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from examples.hf_models import tiny_llama, token_batch

    torch.manual_seed(0)
    plan = autopar.plan(tiny_llama(layers=4), "pp=2", strategies=[autopar.pipeline_parallel(microbatches=4)],
                        example_inputs=token_batch(batch=8))
    (boundary,) = plan.stages[0].sends  # the hidden states only; cos/sin and the causal mask are recomputed
    assert boundary.requires_grad and boundary.target == 1
    last = plan.stages[1].graph_module.graph
    assert any("rotary_emb" in str(n.meta.get("nn_module_stack", "")) for n in last.nodes)


def test_tied_embedding_is_held_by_both_ends_and_summed_over_them():
    pytest.importorskip("transformers")
    from examples.hf_models import tiny_gpt2, token_batch

    torch.manual_seed(0)
    plan = autopar.plan(tiny_gpt2(layers=4, tied=True), "pp=4,dp=2", strategies=[
        autopar.pipeline_parallel(microbatches=4), autopar.data_parallel()], example_inputs=token_batch(batch=8))
    assert plan.program.ties == {"model.lm_head.weight": (0, 3)}
    tied = [b for b in plan.buckets if "model.lm_head.weight" in b.params]
    assert len(tied) == 2 and all(b.axes == ("dp", "pp@0,3") for b in tied)
    sums = [e for e in plan.comm.entries if e.axis == "pp@0,3"]
    assert {e.stage for e in sums} == {0, 3} and all(e.kind == "all_reduce" and e.group_size == 2 for e in sums)
    assert plan.mesh.group_ranks(0, "pp", (0, 3)) == [0, 6]


def test_one_f_one_b_holds_fewer_activations_than_gpipe_on_the_first_stage():
    held = {}
    for schedule in ("gpipe", "1f1b"):
        plan = plan_gpt("pp=4", autopar.pipeline_parallel(schedule=schedule, microbatches=8), batch=16)
        per_micro = saved_activations(plan, rank=0, stage=0).number()
        held[schedule] = plan.memory(rank=0).by_category()["activations"]
        assert held[schedule] == per_micro * (8 if schedule == "gpipe" else 4)
    assert held["1f1b"] < held["gpipe"]


def test_the_bubble_ledger_prices_stages_by_their_flops():
    config = GPTConfig(vocab_size=128, seq_len=16, n_layer=8, n_head=4, d_model=32, d_ff=64)
    for schedule, virtual in (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)):
        plan = plan_gpt("pp=4", autopar.pipeline_parallel(schedule=schedule, microbatches=8, virtual_stages=virtual),
                        config=config, batch=16)
        ledger = build_bubble_ledger(plan)
        assert set(ledger.stage_flops) == set(range(4 * virtual)) and min(ledger.stage_flops.values()) > 0
        assert len(ledger.fractions) == 4 and all(0 < f < 1 for f in ledger.fractions)
    assert build_bubble_ledger(plan).formula == pytest.approx(3 / 27)


def test_planning_stand_ins_move_nothing():
    token = torch.zeros((), requires_grad=True)
    received = p2p.plan_recv(token, group="pp", peer=("pp", -1), value=0, shape=[2, 3], dtype=torch.float32)
    assert received.shape == (2, 3) and received.requires_grad
    assert p2p.plan_send(received, group="pp", peer=("pp", 1), value=0).shape == ()


@pytest.mark.parametrize("mesh, strategies, options, words", [
    ("pp=8", [autopar.pipeline_parallel(microbatches=8)], {"batch": 8}, "only 4 blocks"),
    ("pp=2,dp=2", [autopar.pipeline_parallel(microbatches=8), autopar.data_parallel()], {"batch": 8},
     "do not split over the 2 data-parallel ranks"),
    ("pp=2", [autopar.pipeline_parallel(microbatches=3)], {"batch": 8}, "cannot be split into 3 micro-batches"),
    ("pp=2", [autopar.pipeline_parallel(stages=["layers.1.mlp"])], {}, "inside block 'layers.1'"),
    ("pp=2", [autopar.pipeline_parallel(stages=["layers.1.attn"])], {}, "a cut inside a block"),
    ("pp=2", [autopar.pipeline_parallel(stages=["decoder.9"])], {}, "no block is named 'decoder.9'"),
    ("pp=2", [autopar.pipeline_parallel(stages=["layers.1", "layers.2"])], {}, "gives 3 pipeline stages"),
    ("pp=2", [autopar.pipeline_parallel(schedule="interleaved_1f1b", virtual_stages=4, microbatches=4)], {},
     "8 pipeline stages (pp=2 x virtual_stages=4) but the model has only 4 blocks"),
    ("pp=2", [autopar.pipeline_parallel(schedule="interleaved_1f1b", virtual_stages=2, microbatches=3)], {"batch": 6},
     "multiple of the pipeline degree"),
    ("dp=2", [autopar.pipeline_parallel()], {}, "unknown mesh axis 'pp'"),
    ("pp=2,dp=2", [autopar.pipeline_parallel(schedule="zb_h1"), autopar.fsdp()], {}, "ZeRO/FSDP units"),
    ("pp=2", [autopar.pipeline_parallel(schedule="dualpipev", microbatches=2)], {},
     "needs at least as many micro-batches as stages (2 × pp = 4), got 2; fix: microbatches=4"),
    ("pp=2,dp=2", [autopar.pipeline_parallel(schedule="dualpipev"), autopar.zero(stage=1)], {}, "ZeRO/FSDP units"),
])
def test_bad_pipeline_input_is_refused_at_plan_time(mesh, strategies, options, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_gpt(mesh, *strategies, **options)


@pytest.mark.parametrize("options, words", [
    ({"schedule": "looped"}, "unknown pipeline schedule 'looped'"),
    ({"schedule": "interleaved_1f1b"}, "set virtual_stages >= 2"),
    ({"schedule": "1f1b", "virtual_stages": 2}, "use schedule='interleaved_1f1b'"),
    ({"microbatches": 0}, "positive number of micro-batches"),
    ({"schedule": "dualpipev", "virtual_stages": 3}, "two stages per rank in a V"),
    ({"stages": "layers.2"}, "give a list of module paths"),
])
def test_bad_pipeline_declaration_is_refused(options, words):
    with pytest.raises(PlanError, match=words.replace("(", r"\(")):
        autopar.pipeline_parallel(**options)


def test_a_model_without_blocks_cannot_be_pipelined():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x).sum()

    with pytest.raises(PlanError, match="has none"):
        autopar.plan(Loss(), "pp=2", strategies=[autopar.pipeline_parallel(microbatches=2)],
                     example_inputs=(torch.randn(4, 4),))
    del model
