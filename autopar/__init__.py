"""autopar: a declarative compiler from a single-device PyTorch model to a distributed training program.

`autopar.plan(model, "dp=2,tp=2", strategies=[...], example_inputs=...)` plans in one process;
`autopar.parallelize(...)` does the same under an initialised process group and returns the
rank's trainable module. Strategies live in `autopar.strategies`, passes in `autopar.passes`.
"""
import warnings
from pathlib import Path

# A source checkout keeps `passes/` and `strategies/` beside `autopar/` (pyproject's package-dir maps
# them to autopar.passes / autopar.strategies). Resolve them in this checkout: an editable install's
# finder would otherwise import them from whichever checkout it was installed from (another git
# worktree's passes running under this one's autopar). An installed wheel has them inside autopar/.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "passes" / "__init__.py").is_file() and (_CHECKOUT / "strategies" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))

# torch.export's own pytree use triggers this deprecation inside torch 2.13; it is not ours to fix
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*", category=FutureWarning)

from autopar.api import ParallelModule, Plan, parallelize, plan, save_runnable_plan
from autopar.calibration import calibrate
from autopar.cluster import Cluster
from autopar.cost import comm_time
from autopar.planner import search
from autopar.search_space import SearchSpace
from autopar.step_cost import estimate
from autopar.errors import PlanError
from autopar.expert_rules import register_grouped_matmul
from autopar.mesh import Mesh
from autopar.strategies.context import context_parallel
from autopar.strategies.data_parallel import data_parallel
from autopar.strategies.expert import expert_parallel
from autopar.strategies.pipeline import pipeline_parallel
from autopar.strategies.recompute import recompute
from autopar.strategies.schedule import schedule
from autopar.strategies.tensor_parallel import sequence_parallel, tensor_parallel
from autopar.strategies.zero import fsdp, hsdp, zero

__all__ = ["Cluster", "Mesh", "calibrate", "comm_time", "estimate", "search", "SearchSpace", "ParallelModule", "Plan", "PlanError", "context_parallel", "data_parallel", "expert_parallel", "fsdp", "hsdp", "parallelize",
           "pipeline_parallel", "plan", "recompute", "register_grouped_matmul", "save_runnable_plan", "schedule", "sequence_parallel", "tensor_parallel", "zero"]
