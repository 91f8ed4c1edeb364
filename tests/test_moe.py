"""Mixture-of-experts models under every strategy, and expert parallelism, on gloo processes.

Models: the example MoE (`examples/moe.py`: load-balancing and z auxiliary losses in the loss),
Hugging Face Qwen3-MoE and Mixtral from small configs with their default experts implementation
(`transformers.grouped_mm_fallback`), router auxiliary loss on (`output_router_logits=True`).
Under each case of CASES — among them experts folded onto tp or dp (`expert_parallel(fold=)`, on
8 ranks too) and DualPipeV on pp=2 × ep=2 and pp=4 — loss (auxiliary losses included), whole
gradients and parameters after each of 3 AdamW steps equal one device's (fp32 rel <= 1e-5,
`tests/numerics_checks.py`).

Communication: every collective each step hands to the process groups (counted from outside,
`autopar.measure.comm_counter`) equals the static ledger, except the bytes of expert
parallelism's all-to-alls, whose row counts depend on the routing: those equal, exactly, the
bytes the step's recorded routing implies (`runtime.moe.routing_bytes` of the row counts each
dispatch recorded in `runtime.moe.ROUTING`); their number of calls equals the ledger's.
Memory: parameters, gradients and optimizer state held after each step equal the ledger (expert
weights split over `ep`); activations too where the routing does not move rows between ranks.

Hugging Face's `grouped_mm_fallback` keeps its offsets (E int32 per MoE layer, per rank's local
experts under EP) as a plain attribute of its autograd node (`ctx.offs`, not a saved tensor), so
they live as long as the loss's graph: `HF_OFFSETS` names those bytes in the held-bytes check.
Activations are compared exactly on the example only: on the Hugging Face models with the router
loss on, the ledger counts two [T, E] softmax outputs of `load_balancing_loss_func` (1,024 bytes
per rank here) that the real run does not keep alive — an activation-ledger discrepancy outside
the MoE lowering (without the router loss the HF models' activations equal the ledger plus
HF_OFFSETS), left open.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

import autopar
from autopar.compiler.strategies.expert import ExpertParallel
from autopar.core.ops import moe
from autopar.runtime.launch import launch
from examples.gpt import example_batch
from examples.moe import MoEConfig, MoEGPT
from tests.numerics import STEPS, distributed_rank, single_device, train_step
from tests.numerics_checks import (_merged, assert_activations_equal_ledger, assert_held_equals_ledger,
                                   assert_ledger_equals_measured, assert_matches,
                                   assert_peak_within_ledger, expected_by_phase)

EXAMPLE = MoEConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)
CASES = {
    "dp2": ("dp=2", [autopar.data_parallel()]),
    "zero3_dp2": ("dp=2", [autopar.zero(stage=3)]),
    "tp2": ("tp=2", [autopar.tensor_parallel()]),
    "ep2": ("ep=2", [autopar.expert_parallel()]),
    "ep4": ("ep=4", [autopar.expert_parallel()]),
    "ep2_dp2": ("dp=2,ep=2", [autopar.data_parallel(), autopar.expert_parallel()]),
    "ep2_tp2": ("ep=2,tp=2", [autopar.expert_parallel(), autopar.tensor_parallel()]),
    # folded: the experts over all 4 ranks (ep × tp or dp × ep), the rest as declared on tp / dp (under
    # sequence parallelism: dp2_ep2_tp2sp_folded, on 8 ranks)
    "ep2_tp2_folded": ("ep=2,tp=2", [autopar.expert_parallel(fold=("tp",)), autopar.tensor_parallel()]),
    "dp2_ep2_folded": ("dp=2,ep=2", [autopar.data_parallel(), autopar.expert_parallel(fold=("dp",))]),
    # 8 ranks, attention on 4-way data (ep) × 2-way tensor parallelism: experts on ep=8 (folded onto
    # tp, no expert-tensor split), and on ep=4 × etp=2 (each expert's FFN split on tp)
    "ep4_tp2_folded": ("ep=4,tp=2", [autopar.expert_parallel(fold=("tp",)), autopar.tensor_parallel()]),
    "ep4_tp2": ("ep=4,tp=2", [autopar.expert_parallel(), autopar.tensor_parallel()]),
    # DualPipeV (two stages per rank in a V): with the experts' all-to-alls inside its stages on 2
    # pipeline ranks, and on 4 (4 and 8 stages: the example MoE with 4 and 8 blocks)
    "pp2_ep2_dualpipev": ("pp=2,ep=2", [autopar.pipeline_parallel(schedule="dualpipev", microbatches=4),
                                        autopar.expert_parallel()]),
    "pp4_dualpipev": ("pp=4", [autopar.pipeline_parallel(schedule="dualpipev", microbatches=8)]),
    # attention dp=4 (dp × ep) × tp=2+SP, experts ep=4 (ep × tp) × edp=2 (replicated on dp)
    "dp2_ep2_tp2sp_folded": ("dp=2,ep=2,tp=2", [autopar.data_parallel(), autopar.expert_parallel(fold=("tp",)),
                                                autopar.tensor_parallel(sequence_parallel=True)]),
    # a capacity no expert can exceed (factor E): the capacity path runs and drops nothing
    "ep2_capacity": ("ep=2", [autopar.expert_parallel(capacity_factor=4.0)]),
    "fsdp_dp2_ep2": ("dp=2,ep=2", [autopar.fsdp(), autopar.expert_parallel()]),
    "pp2_ep2": ("pp=2,ep=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=2), autopar.expert_parallel()]),
    # recomputed MoE blocks: the dispatch and combine run again in backward, with the forward's routing
    "ep2_recompute_full": ("ep=2", [autopar.expert_parallel(), autopar.recompute("full")]),
    "dp2_recompute_full": ("dp=2", [autopar.data_parallel(), autopar.recompute("full")]),
    "ep2_dp2_recompute_experts": ("dp=2,ep=2", [autopar.data_parallel(), autopar.expert_parallel(),
                                                autopar.recompute(["layers.*.moe"])]),
}
# cases run on one model only: compositions on the example; each folded layout on one model (the
# lowering is the same for all three), the 8-rank ones on a Qwen3-MoE with 8 experts
ONLY_ON = {**dict.fromkeys(("ep2_capacity", "fsdp_dp2_ep2", "pp2_ep2", "dp2_recompute_full",
                            "ep2_dp2_recompute_experts", "dp2_ep2_folded"), "example"),
           "ep2_tp2_folded": "qwen3_moe",
           "ep4_tp2_folded": "qwen3_moe_8", "ep4_tp2": "qwen3_moe_8", "dp2_ep2_tp2sp_folded": "qwen3_moe",
           "pp2_ep2_dualpipev": "example4", "pp4_dualpipev": "example8"}
# case -> (micro-batches, data ranks): one device's micro-batches cut the same way
PIPELINED = {"pp2_ep2": (2, 2), "pp2_ep2_dualpipev": (4, 2), "pp4_dualpipev": (8, 1)}


def hf_moe(model_type: str, **sizes: int):
    from examples.hf_models import tiny_causal_lm

    model = tiny_causal_lm(model_type, **sizes)
    model.model.config.output_router_logits = True  # the router's load-balancing loss in the loss
    return model


DEEPER = {layers: dataclasses.replace(EXAMPLE, n_layer=layers) for layers in (4, 8)}  # a stage per block under DualPipeV
BUILDS = {"example": (functools.partial(MoEGPT, EXAMPLE), [example_batch(EXAMPLE, batch=4, seed=s) for s in range(STEPS)]),
          **{f"example{layers}": (functools.partial(MoEGPT, config),  # a row per micro-batch per replica
                                  [example_batch(config, batch=8, seed=s) for s in range(STEPS)])
             for layers, config in DEEPER.items()},
          "qwen3_moe": (functools.partial(hf_moe, "qwen3_moe"), None),
          "mixtral": (functools.partial(hf_moe, "mixtral"), None),
          "qwen3_moe_8": (functools.partial(hf_moe, "qwen3_moe", num_experts=8), None)}  # experts over 8 ranks
# hidden size, experts, layers of each model (bytes of a routed row, of a counts exchange; HF_OFFSETS)
ACTIVATIONS_EXACT = {"example"}
SIZES = {"example": (32, 4, 2), "qwen3_moe": (64, 4, 2), "mixtral": (64, 4, 2), "qwen3_moe_8": (64, 8, 2),
         "example4": (32, 4, 4), "example8": (32, 4, 8)}


def _batches(model: str) -> list:
    build, batches = BUILDS[model]
    if batches is None:
        from examples.hf_models import token_batch

        batches = [token_batch(batch=4, seq=16, seed=s) for s in range(STEPS)]
    return batches


def routed_step(module, local):
    """The default step body (a pipeline's `train_step` under pp), keeping each step's routing
    (row counts of every dispatch)."""
    moe.ROUTING.clear()
    loss = module.train_step(*local) if module.plan.pipeline is not None else train_step(module, local)
    _routing.append(list(moe.ROUTING))
    return loss


_routing: list = []


def _after(module, rank) -> dict:
    return {"routing": list(_routing)}


def run_cases(rank: int, world: int, runs: list[tuple[str, str]]) -> list[dict]:
    results = []
    for model, name in runs:
        mesh, strategies = CASES[name]
        _routing.clear()
        results.append(distributed_rank(rank, world, BUILDS[model][0], _batches(model), mesh, strategies,
                                        step=routed_step, after=_after))
    return results


_references: dict[tuple[str, int], dict] = {}


def _as_pipelined(batch: tuple, data_ranks: int, microbatches: int) -> tuple:
    """The batch's rows reordered so that one device's micro-batch m (chunk m of `microbatches`)
    holds what the pipeline's micro-batch m holds: chunk m of every data rank's rows. The
    auxiliary losses are products of batch means, so they depend on which rows form a
    micro-batch (cross-entropy alone would not)."""
    rows = batch[0].shape[0]
    per_rank, per_micro = rows // data_ranks, rows // data_ranks // microbatches
    order = [r * per_rank + m * per_micro + i for m in range(microbatches) for r in range(data_ranks)
             for i in range(per_micro)]
    return tuple(t[order] for t in batch)


def reference(model: str, microbatches: int = 1, data_ranks: int = 1) -> dict:
    if (model, microbatches) not in _references:
        batches = [_as_pipelined(b, data_ranks, microbatches) for b in _batches(model)] if microbatches > 1 \
            else _batches(model)
        _references[(model, microbatches)] = single_device(BUILDS[model][0], batches, microbatches=microbatches)
    return _references[(model, microbatches)]


def assert_comm_equals_ledger_and_routing(results: list[dict], model: str, name: str, *, element_bytes: int = 4
                                          ) -> None:
    """Each step: every (kind, axis) the ledger names, counted over the step, equals it; the
    all-to-alls' bytes equal what the step's routing implies (module docstring). Under ep×tp the
    experts' rows are also replicated on tp, so the gradient of the dispatched rows is all-reduced
    over tp (Megatron's f, once per block): its bytes follow the rows received, not the ledger's
    uniform routing — the ledger's plus (rows received - rows routed) · d · 4 per block (not when
    the experts are folded onto tp: each tp rank then routes rows of its own). A ZeRO
    unit's gradients exchanged by an all-to-all (`zero(reduce=)`, gloo's default) add the ledger's
    bytes of that exchange to backward's, whatever the routing. `element_bytes`: of the routed rows'
    dtype (2 under bf16 mixed precision)."""
    hidden, experts, _ = SIZES[model]
    tensor_parallel = "tp" in autopar.Mesh.parse(CASES[name][0]).names and "tp" not in _folded(name)
    for result in results:
        expected = expected_by_phase(result["ledger"])
        exchanged = {("all_to_all", axis): nbytes for (phase, kind, axis), (_, nbytes) in result["ledger"].items()
                     if phase == "grad_sync" and kind == "all_to_all"}
        routed_keys = {(kind, axis) for (phase, kind, axis) in result["ledger"]
                       if phase in ("forward", "backward") and kind == "all_to_all"}
        for step, measured in enumerate(result["comm"]):
            routing = result["routing"][step]
            implied = moe.routing_bytes(routing, row_bytes={b: hidden * element_bytes for b, *_ in routing},
                                        count_bytes={b: experts * 8 for b, *_ in routing})
            extra_rows = sum(sum(receive) - sum(send) for _, send, receive, _, again in routing if not again)
            where = f"rank {result['rank']} step {step}"
            phases = {phase: (expected.get(phase, {}), implied[phase]) for phase in ("forward", "backward")}
            if "step" in measured:  # a pipeline schedule runs forward and backward in one call
                phases = {"step": (_merged(expected, ("forward", "backward")), implied["forward"] + implied["backward"])}
            for phase, (ledger, implied_bytes) in phases.items():
                got, want = dict(measured.get(phase, {})), dict(ledger)
                for key in [k for k in want if k[0] == "all_to_all"]:
                    calls, nbytes = got.pop(key, (0, 0))
                    assert calls == want.pop(key)[0], f"{where} {phase} {key}: {calls} calls != ledger"
                    routed = (implied_bytes if key in routed_keys else 0) + (
                        exchanged.get(key, 0) if phase != "forward" else 0)
                    assert nbytes == routed, f"{where} {phase} {key}: {nbytes} bytes != routing's {routed}"
                if phase != "forward" and tensor_parallel and routing:
                    calls, nbytes = want[("all_reduce", "tp")]
                    want[("all_reduce", "tp")] = (calls, nbytes + extra_rows * hidden * element_bytes)
                assert got == want, f"{where} {phase}: measured {got} != ledger {want}"


def assert_memory(results: list[dict], model: str, name: str) -> None:
    """Held bytes after each step equal the ledger (plus HF_OFFSETS); the forward's activations
    too when every rank's experts received as many rows as it routed (the ledger's uniform
    routing); the peak within the ledger's bounds."""
    for result in results:
        balanced = all(sum(send) == sum(receive) for routing in result["routing"] for _, send, receive, *_ in routing)
        kept = _hf_offsets(model, name)
        result = dict(result, device_mesh_bytes=[b + kept for b in result["device_mesh_bytes"]])
        assert_held_equals_ledger(result)
        if balanced and model in ACTIVATIONS_EXACT and name not in PIPELINED:  # a schedule's forward: not apart
            assert_activations_equal_ledger(result)
        assert_peak_within_ledger(result, reference(model, *PIPELINED.get(name, (1, 1)))["backward_temporaries"])


def _hf_offsets(model: str, name: str) -> int:
    """HF_OFFSETS (module docstring): int32 offsets of the rank's experts, one tensor per MoE layer."""
    if model.startswith("example"):
        return 0
    _, experts, layers = SIZES[model]
    mesh = autopar.Mesh.parse(CASES[name][0])
    ranks = math.prod(mesh.size(axis) for axis in ("ep", *_folded(name)) if axis in mesh.names)
    return layers * experts // ranks * 4


def _folded(name: str) -> tuple[str, ...]:
    """The axes a case folds its experts onto (`expert_parallel(fold=)`)."""
    return next((s.fold for s in CASES[name][1] if isinstance(s, ExpertParallel)), ())


RUNS = [(model, name) for model in BUILDS for name in CASES
        if (ONLY_ON[name] == model if name in ONLY_ON else model in ("example", "qwen3_moe", "mixtral"))]


def _world(name: str) -> int:
    return autopar.Mesh.parse(CASES[name][0]).world_size


RECOMPUTED = {name for name in CASES if "recompute" in name}


LAUNCHES = sorted({(_world(name), name in RECOMPUTED) for _, name in RUNS})


# one launch per world size runs up to 17 cases: 272 s for the 4-rank one in CI (2026-12-07, 3 workers),
# past the suite's 300 s default with 4 workers
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world,recomputed", LAUNCHES,
                         ids=[f"{world}" + ("-recomputed" if again else "") for world, again in LAUNCHES])
def test_moe_matches_single_device(world, recomputed, transformers):
    """Every case of one world size in one launch (recomputed MoE blocks in a launch of their own)."""
    chosen = [run for run in RUNS if _world(run[1]) == world and (run[1] in RECOMPUTED) == recomputed]
    per_rank = launch(run_cases, world, chosen, timeout_s=120 * len(chosen))
    for index, (model, name) in enumerate(chosen):
        results = [rank_results[index] for rank_results in per_rank]
        try:
            assert_matches(reference(model, *PIPELINED.get(name, (1, 1))), results)
            assert_comm_equals_ledger_and_routing(results, model, name)
            assert_memory(results, model, name)
        except AssertionError as error:
            raise AssertionError(f"{model} {name} ({CASES[name][0]}): {error}") from None


# ---- checkpoints: expert shards written and read back whole, and under another expert layout

def _train_and_save(rank: int, world: int, mesh: str, strategies: list, path: str, source: str | None) -> dict:
    from autopar.artifacts.checkpoint import load, save

    batches = BUILDS["example"][1]
    torch.manual_seed(0)
    module = autopar.parallelize(MoEGPT(EXAMPLE), mesh, strategies=strategies, example_inputs=batches[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    if source is None:
        for batch in batches[:2]:
            optimizer.zero_grad()
            module(*module.local_batch(*batch)).backward()
            optimizer.step()
    else:
        load(source, module, optimizer)
    save(path, module, optimizer)
    return {"full": module.full_state_dict()}


def _whole(path) -> tuple[dict, dict]:
    from autopar.artifacts.checkpoint import load_into_model

    model = MoEGPT(EXAMPLE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_into_model(path, model, optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v.clone() for p, entries in optimizer.state.items() for k, v in entries.items()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {sorted(a.keys() ^ b.keys())[:4]}"
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def test_an_expert_parallel_checkpoint_reads_whole_and_reshards(tmp_path):
    """Written under dp=2×ep=2 after 2 steps; read whole into one process it equals the job's
    gathered `full_state_dict()`; loaded under ep=4 and written again, bit-identical."""
    first = launch(_train_and_save, 4, "dp=2,ep=2", [autopar.data_parallel(), autopar.expert_parallel()],
                   str(tmp_path / "a"), None, timeout_s=150)
    params, state = _whole(tmp_path / "a")
    assert len(state) == 3 * len(params)
    _assert_identical(params, {k: v for k, v in first[0]["full"].items() if k in params}, "written vs gathered")
    again = launch(_train_and_save, 4, "ep=4", [autopar.expert_parallel()], str(tmp_path / "b"),
                   str(tmp_path / "a"), timeout_s=150)
    params_b, state_b = _whole(tmp_path / "b")
    _assert_identical(params, params_b, "parameters via ep=4")
    _assert_identical(state, state_b, "optimizer state via ep=4")
    _assert_identical(params, {k: v for k, v in again[0]["full"].items() if k in params}, "ep=4's gathered parameters")


def _dropping_step(rank: int, world: int, factor: float) -> dict:
    from autopar.measure.comm_counter import CommCounter

    batches = BUILDS["example"][1]
    torch.manual_seed(0)
    module = autopar.parallelize(MoEGPT(EXAMPLE), "ep=2", strategies=[
        autopar.expert_parallel(capacity_factor=factor, drop_tokens=True)], example_inputs=batches[0])
    moe.ROUTING.clear()
    counter = CommCounter()
    with counter:
        loss = module(*module.local_batch(*batches[0]))
        loss.backward()
    group_to_axis = module.group_keys()
    moved = sum(nbytes for (kind, _), (_, nbytes) in counter.by_key(group_to_axis).items() if kind == "all_to_all")
    grads = [p.grad for p in module.parameters()]
    return {"routing": list(moe.ROUTING), "moved": moved, "loss": float(loss),
            "finite": all(g is None or bool(torch.isfinite(g).all()) for g in grads)}


def test_a_capacity_factor_drops_the_rows_beyond_it_when_asked():
    """factor 0.5 with drop_tokens=True: each expert takes at most ceil(0.5 · rows / E) of a rank's
    rows (the rest contribute zero); what is sent equals that, and the bytes moved equal what the
    recorded routing implies."""
    results = launch(_dropping_step, 2, 0.5, timeout_s=120)
    hidden, experts, _ = SIZES["example"]
    for result in results:
        assert result["finite"] and result["loss"] == result["loss"]
        dropped = 0
        for block, send, receive, demand, _ in result["routing"]:
            rows = sum(demand)
            capacity = -(-rows // (2 * experts))  # ceil(0.5 * rows / E)
            kept = [min(d, capacity) for d in demand]
            assert list(send) == [sum(kept[:experts // 2]), sum(kept[experts // 2:])]
            dropped += rows - sum(kept)
        assert dropped > 0
        implied = moe.routing_bytes(result["routing"], row_bytes={b: hidden * 4 for b, *_ in result["routing"]},
                                    count_bytes={b: experts * 8 for b, *_ in result["routing"]})
        assert result["moved"] == implied["forward"] + implied["backward"]


# ---- multi-head latent attention under batch-sharding axes (DeepSeek-V3's small config: block 0
# dense, block 1 MoE with a shared expert): its queries and keys are assembled by writing the
# rotary part into slices (copy of a key broadcast over heads, slice_scatter), which keep the
# batch shard; they once gathered every rank's activations over the axis and ran attention whole

MLA_CASES = {"dp2": ("dp=2", [autopar.data_parallel()]), "ep2": ("ep=2", [autopar.expert_parallel()])}


def _deepseek():
    from examples.hf_models import tiny_causal_lm

    return tiny_causal_lm("deepseek_v3")


def _mla_batches() -> list:
    from examples.hf_models import token_batch

    return [token_batch(batch=4, seq=16, seed=s) for s in range(STEPS)]


def _run_mla_cases(rank: int, world: int, names: list[str]) -> list[dict]:
    return [distributed_rank(rank, world, _deepseek, _mla_batches(), *MLA_CASES[name]) for name in names]


def test_latent_attention_keeps_its_batch_shard_and_equals_one_device(transformers):
    ids = _mla_batches()[0]
    for mesh, strategies in MLA_CASES.values():
        plan = autopar.plan(_deepseek(), mesh, strategies=strategies, example_inputs=ids)
        gathers = [e for e in plan.comm.entries if e.kind == "all_gather" and "self_attn" in e.module]
        assert gathers == [], (mesh, gathers[:2])
    names = list(MLA_CASES)
    per_rank = launch(_run_mla_cases, 2, names, timeout_s=240)
    reference = single_device(_deepseek, _mla_batches())
    for index, name in enumerate(names):
        results = [rank_results[index] for rank_results in per_rank]
        assert_matches(reference, results)
        if name == "dp2":  # under ep the all-to-alls move what the routing chose, not the ledger's uniform rows
            assert_ledger_equals_measured(results)
        # memory is not compared: on this model each rank holds 16 bytes its memory ledger does not
        # list and saves 880 bytes fewer activations than it lists (dp2; not analysed yet)
