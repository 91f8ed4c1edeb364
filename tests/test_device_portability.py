"""A plan runs on the rank's device, not on the device it was traced on (issue 46, the checks
that need no GPU).

- Graph-only: the rank graphs of the example GPT (and the example MoE) under each strategy hold
  no device constant — a factory op (`arange`, `full`, `scalar_tensor`, ...) takes the device of
  a parameter (`autopar/compiler/passes/emit_rank_graph.py`) — and no host-only op (a copy to a
  constant device, `.item()`, pinning). A graph that passes runs wherever its inputs and
  parameters live: CUDA under NCCL, CPU under gloo.
- Lint: the runtime modules (`autopar/runtime/*.py`, `autopar/core/ops/*.py`) call no `.cpu()`,
  `.numpy()`, `.tolist()` or `pin_memory`, and allocate nothing on the CPU (`device="cpu"`, or a
  torch factory call without `device=`, which allocates on the default device) unless the same
  line says why in a comment. `KNOWN_HOST_CALLS` lists the lines that do so today without one,
  each with what it is: a ratchet (a new one fails; drop an entry once its line is fixed).
- The rank's device: `runtime/device.py` on a host without an accelerator.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import autopar
from autopar.compiler.passes.recompute import is_region_call
from autopar.compiler.rules.expert_rules import is_grouped_mm
from autopar.core.errors import PlanError
from autopar.core.ops.grouped_matmul import fused_applies, grouped_matmul
from autopar.runtime.device import backend_for, rank_device
from examples.gpt import GPT, GPTConfig, example_batch
from examples.moe import MoEConfig, MoEGPT

ROOT = Path(__file__).resolve().parent.parent
CONFIG = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64)
# causal mask built with torch.ones(..., device=x.device) and dropout: more factory ops in the trace
EXPLICIT = GPTConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, d_ff=64, dropout=0.1,
                     explicit_attention=True)
MOE = MoEConfig(vocab_size=128, seq_len=16, n_layer=2, n_head=4, d_model=32, n_experts=4, top_k=2, d_expert=32)

CASES = {
    "dp2": (CONFIG, "dp=2", [autopar.data_parallel()]),
    "zero1_dp2": (CONFIG, "dp=2", [autopar.zero(stage=1)]),
    "fsdp_dp2": (CONFIG, "dp=2", [autopar.fsdp()]),
    "tp2": (CONFIG, "tp=2", [autopar.tensor_parallel()]),
    "tp2_sp": (CONFIG, "tp=2", [autopar.sequence_parallel()]),
    "cp2": (CONFIG, "cp=2", [autopar.context_parallel()]),
    "pp2": (CONFIG, "pp=2", [autopar.pipeline_parallel(microbatches=2)]),
    "ep2": (MOE, "ep=2", [autopar.expert_parallel()]),
    "tp2_explicit_recompute": (EXPLICIT, "tp=2", [autopar.tensor_parallel(), autopar.recompute("full")]),
    # compositions: every rank graph of each (first and last rank, every stage)
    "dp2_tp2_sp": (CONFIG, "dp=2,tp=2", [autopar.data_parallel(), autopar.sequence_parallel()]),
    "fsdp_dp2_tp2_sp": (CONFIG, "dp=2,tp=2", [autopar.fsdp(), autopar.sequence_parallel()]),
    "zero2_dp2_cp2": (CONFIG, "dp=2,cp=2", [autopar.zero(stage=2), autopar.context_parallel()]),
    "cp2_tp2_sp": (CONFIG, "cp=2,tp=2", [autopar.context_parallel(), autopar.sequence_parallel()]),
    "pp2_dp2": (CONFIG, "pp=2,dp=2", [autopar.pipeline_parallel(microbatches=2), autopar.data_parallel()]),
    "pp2_tp2_sp": (CONFIG, "pp=2,tp=2", [autopar.pipeline_parallel(microbatches=2), autopar.sequence_parallel()]),
    "dp2_cp2_tp2_sp": (CONFIG, "dp=2,cp=2,tp=2", [autopar.data_parallel(), autopar.context_parallel(),
                                                  autopar.sequence_parallel()]),
    "ep2_dp2": (MOE, "dp=2,ep=2", [autopar.data_parallel(), autopar.expert_parallel()]),
    "fsdp_dp2_ep2": (MOE, "dp=2,ep=2", [autopar.fsdp(), autopar.expert_parallel()]),
    "ep2_tp2": (MOE, "ep=2,tp=2", [autopar.expert_parallel(), autopar.tensor_parallel()]),
    "pp2_ep2": (MOE, "pp=2,ep=2", [autopar.pipeline_parallel(schedule="1f1b", microbatches=2),
                                   autopar.expert_parallel()]),
    # mixed precision: the masters' casts to the compute dtype carry no device
    "bf16_fsdp_dp2_tp2_sp": (CONFIG, "dp=2,tp=2", [autopar.fsdp(), autopar.sequence_parallel(),
                                                  autopar.mixed_precision()]),
    "bf16_pp2_dp2": (CONFIG, "pp=2,dp=2", [autopar.pipeline_parallel(microbatches=2), autopar.data_parallel(),
                                          autopar.mixed_precision()]),
}
# ops that move data to the host or synchronise with it: none belongs in a rank graph
HOST_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten._pin_memory.default,
            torch.ops.aten.is_pinned.default, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout}


def _graphs(gm: torch.fx.GraphModule) -> list[torch.fx.Graph]:
    """The rank graph and the graphs of its recomputed regions."""
    graphs = [gm.graph]
    for node in gm.graph.nodes:
        if is_region_call(node):
            graphs += _graphs(node.target.__self__.graph_module)
    return graphs


def _device_bound(node: torch.fx.Node) -> list[str]:
    """What ties `node` to one device: a device constant among its arguments, a host-only op, pinning."""
    found = [f"device constant {leaf}" for leaf in pytree.tree_leaves((node.args, dict(node.kwargs)))
             if isinstance(leaf, torch.device)]
    if node.target in HOST_OPS:
        found.append("host-only op")
    if node.kwargs.get("pin_memory"):
        found.append("pin_memory=True")
    if is_grouped_mm(node.target) and node.target is not torch.ops.aten._grouped_mm.default:
        found.append("a grouped matmul called as traced, not through grouped_matmul (torch._grouped_mm on CUDA)")
    return found


def _rank_graphs(plan: autopar.Plan) -> list[torch.fx.GraphModule]:
    last = plan.mesh.world_size - 1
    return [plan.rank_graph(rank, stage=stage.index) for rank in (0, last) for stage in plan.stages_of_rank(rank)]


@pytest.mark.parametrize("name", list(CASES))
def test_rank_graphs_hold_no_device(name):
    config, mesh, strategies = CASES[name]
    torch.manual_seed(0)
    model = MoEGPT(config) if isinstance(config, MoEConfig) else GPT(config)
    plan = autopar.plan(model, mesh, strategies=strategies, example_inputs=example_batch(config))
    bound = [f"{node.format_node()}: {why}" for gm in _rank_graphs(plan) for graph in _graphs(gm)
             for node in graph.nodes if node.op == "call_function" for why in _device_bound(node)]
    assert not bound, f"{name}: rank graph nodes tied to one device:\n" + "\n".join(bound)
    code = "\n".join(gm.code for gm in _rank_graphs(plan))
    assert "device(type=" not in code and ".cpu()" not in code
    sources = [node.args[0].name for gm in _rank_graphs(plan) for node in gm.graph.nodes if node.name == "rank_device"]
    kinds = {plan.context.placeholders[name].kind for name in sources}
    assert sources and kinds == {"parameter"}, f"the factory ops take the device of a parameter, not of {kinds}"


class ToHost(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).to("meta").sum()


def test_a_copy_to_a_constant_device_is_refused():
    with pytest.raises(PlanError, match="constant device meta") as caught:
        autopar.plan(ToHost(), "dp=2", strategies=[autopar.data_parallel()], example_inputs=(torch.randn(4, 4),))
    assert "test_device_portability.py" in str(caught.value) and "fix:" in str(caught.value)


# --- grouped expert matmuls ------------------------------------------------------------------------

def test_grouped_matmuls_reach_the_dispatcher():
    torch.manual_seed(0)
    plan = autopar.plan(MoEGPT(MOE), "ep=2", strategies=[autopar.expert_parallel()], example_inputs=example_batch(MOE))
    calls = [node for node in plan.rank_graph(0).graph.nodes if node.target is grouped_matmul]
    assert calls and {str(node.kwargs["traced"]) for node in calls} == {"examples.grouped_mm.default"}


def _transformers_fallback():
    pytest.importorskip("transformers")
    import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)
    return torch.ops.transformers.grouped_mm_fallback.default


@pytest.mark.parametrize("traced", ["examples", "transformers"])
def test_torch_grouped_mm_computes_what_the_traced_op_does(traced):
    """What the dispatcher runs on CUDA against what it replaces, here on the CPU in bf16: small
    integers, so both sums are exact; int64 offsets (as routing makes them) and an empty expert."""
    op = torch.ops.examples.grouped_mm.default if traced == "examples" else _transformers_fallback()
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(-3, 4, (10, 16), generator=generator).to(torch.bfloat16)
    weight = torch.randint(-3, 4, (4, 16, 8), generator=generator).to(torch.bfloat16)
    offsets = torch.tensor([3, 3, 7, 10])
    fused = torch._grouped_mm(rows, weight, offs=offsets.to(torch.int32))
    assert torch.equal(fused, op(rows, weight, offsets))
    assert torch.equal(grouped_matmul(rows, weight, offsets, traced=op), op(rows, weight, offsets))


@pytest.mark.parametrize("device, dtype, inner, outer, fused", [
    ("cuda", torch.bfloat16, 64, 32, True), ("cpu", torch.bfloat16, 64, 32, False),
    ("cuda", torch.float32, 64, 32, False), ("cuda", torch.bfloat16, 60, 32, False),
    ("cuda", torch.bfloat16, 64, 36, False),
])
def test_the_fused_grouped_matmul_is_chosen_where_it_runs(device, dtype, inner, outer, fused):
    assert fused_applies(device, dtype, inner, outer) is fused


# --- lint: no host round trip in the runtime ---------------------------------------------------

HOST_METHODS = {"cpu", "numpy", "tolist", "pin_memory"}
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "scalar_tensor", "rand", "randn",
             "randint", "linspace", "eye"}
# (file, stripped source line) -> what it is; fix each by allocating on the device of a tensor at
# hand (device=x.device), or say why on the line
KNOWN_HOST_CALLS: dict[tuple[str, str], str] = {}


def _is_torch_factory(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and func.attr in FACTORIES and isinstance(func.value, ast.Name)
            and func.value.id == "torch")


def _host_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) for each call in `source` that goes through the host."""
    found = []
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call):
            continue
        keywords = {k.arg: k.value for k in call.keywords}
        device = keywords.get("device")
        if isinstance(call.func, ast.Attribute) and call.func.attr in HOST_METHODS:
            found.append((call.lineno, f".{call.func.attr}()"))
        elif isinstance(device, ast.Constant) and str(device.value).startswith("cpu"):
            found.append((call.lineno, 'device="cpu"'))
        elif _is_torch_factory(call) and "device" not in keywords:
            found.append((call.lineno, f"torch.{call.func.attr} without device="))
        elif keywords.get("pin_memory") is not None and not (isinstance(keywords["pin_memory"], ast.Constant)
                                                             and keywords["pin_memory"].value is False):
            found.append((call.lineno, "pin_memory="))
    return found


def unexplained_host_calls(paths: list[Path], *, root: Path = ROOT) -> list[str]:
    """Host calls on lines without a comment, other than the known ones."""
    bad = []
    for path in paths:
        source = path.read_text()
        lines = source.splitlines()
        relative = path.relative_to(root).as_posix()
        for lineno, what in _host_calls(source):
            line = lines[lineno - 1]
            if "#" in line or (relative, line.strip()) in KNOWN_HOST_CALLS:
                continue
            bad.append(f"{relative}:{lineno}: {what}: {line.strip()}")
    return bad


def runtime_files() -> list[Path]:
    return sorted((ROOT / "autopar" / "runtime").glob("*.py")) + sorted((ROOT / "autopar" / "core" / "ops").glob("*.py"))


def test_runtime_makes_no_unexplained_host_round_trip():
    bad = unexplained_host_calls(runtime_files())
    assert not bad, ("runtime code that moves data to or allocates on the host: allocate on the device of a "
                     "tensor at hand (device=x.device), or say why in a comment on the line\n" + "\n".join(bad))


@pytest.mark.parametrize("line, caught", [
    ("x.cpu()", True), ("x.tolist()", True), ("x.numpy()", True), ("x.pin_memory()", True),
    ("torch.zeros(3)", True), ("torch.full((2,), 1.0, dtype=torch.float32)", True),
    ("torch.empty(3, device='cpu')", True), ("y.new_zeros(3, device='cpu')", True),
    ("torch.zeros(3, device=x.device)", False), ("x.new_zeros(3)", False),
    ("torch.zeros(3)  # host scalar: a Python float follows", False),
])
def test_the_lint_catches_host_calls(tmp_path, line, caught):
    path = tmp_path / "probe.py"
    path.write_text(f"import torch\n\ndef f(x, y):\n    return {line}\n")
    assert bool(unexplained_host_calls([path], root=tmp_path)) is caught


# --- the rank's device ---------------------------------------------------------------------------

def test_rank_device_without_an_accelerator_is_the_cpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert rank_device() == torch.device("cpu")
    assert backend_for(rank_device()) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"


def test_rank_device_is_the_local_ranks_accelerator(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert rank_device() == torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="--nproc-per-node=2"):
        rank_device(local_rank=2)
