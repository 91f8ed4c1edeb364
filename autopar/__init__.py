"""autopar: a declarative compiler from a single-device PyTorch model to a distributed training program.

`autopar.plan(model, "dp=2,tp=2", strategies=[...], example_inputs=...)` plans in one process;
`autopar.parallelize(...)` does the same under an initialised process group and returns the
rank's trainable module. Strategies live in `autopar.compiler.strategies`, passes in `autopar.compiler.passes`.
"""
import warnings

# torch.export's own pytree use triggers this deprecation inside torch 2.13; it is not ours to fix
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)

from autopar.api import ParallelModule, Plan, calibrate, parallelize, plan, save_runnable_plan
from autopar.compiler.rules.expert_rules import register_grouped_matmul
from autopar.compiler.strategies.context import context_parallel
from autopar.compiler.strategies.data_parallel import data_parallel, replicated
from autopar.compiler.strategies.expert import expert_parallel
from autopar.compiler.strategies.mixed_precision import float8
from autopar.compiler.strategies.mixed_precision import mixed_precision
from autopar.compiler.strategies.pipeline import pipeline_parallel
from autopar.compiler.strategies.recompute import recompute
from autopar.compiler.strategies.schedule import schedule
from autopar.compiler.strategies.tensor_parallel import sequence_parallel, tensor_parallel
from autopar.compiler.strategies.zero import fsdp, hsdp, zero
from autopar.core.document_balance import balance_documents
from autopar.core.errors import CheckpointError, PlanError
from autopar.core.mesh import Mesh
from autopar.cost.cluster import Cluster
from autopar.cost.comm_cost import comm_time
from autopar.cost.step_cost import estimate
from autopar.planner.search import search
from autopar.planner.search_space import SearchSpace

__all__ = ["Cluster", "Mesh", "balance_documents", "calibrate", "comm_time", "estimate", "search", "SearchSpace", "ParallelModule", "Plan", "PlanError", "CheckpointError", "context_parallel", "data_parallel", "expert_parallel", "float8", "fsdp", "hsdp", "mixed_precision", "parallelize",
           "pipeline_parallel", "plan", "recompute", "register_grouped_matmul", "replicated", "save_runnable_plan", "schedule", "sequence_parallel", "tensor_parallel", "zero"]
