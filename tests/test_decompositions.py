"""autopar's decomposition table (`autopar/compiler/decompositions.py`) against torch.export's own:
the Python `linear` must record the nodes ATen's C++ kernel records, in the same order and with the
same shapes, for every input the kernel handles differently."""
from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from autopar.compiler.decompositions import decomposition_table

aten = torch.ops.aten


class _Linear(torch.nn.Module):
    def __init__(self, bias: bool, transposed: bool) -> None:
        super().__init__()
        self.linear, self.transposed = torch.nn.Linear(8, 6, bias=bias), transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.transpose(0, 1) if self.transposed else x).sum()


def _nodes(program: torch.export.ExportedProgram) -> list[tuple[str, tuple | None]]:
    def shape(node: torch.fx.Node) -> tuple | None:
        value = node.meta.get("val")
        return tuple(str(size) for size in value.shape) if isinstance(value, torch.Tensor) else None

    return [(str(node.target), shape(node)) for node in program.graph.nodes if node.op == "call_function"]


# a transposed input (non-contiguous: ATen goes through matmul) needs two leading dimensions
INPUTS = [(shape, False) for shape in [(8,), (4, 8), (2, 3, 8), (2, 3, 5, 8)]] + [((2, 3, 8), True), ((2, 3, 5, 8), True)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape,transposed", INPUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_our_linear_records_the_nodes_of_atens_own(shape, transposed, bias, dynamic):
    dynamic_shapes = {"x": {0: Dim.AUTO}} if dynamic and len(shape) > 1 else None
    program = torch.export.export(_Linear(bias, transposed), (torch.randn(*shape),), dynamic_shapes=dynamic_shapes,
                                  strict=False)
    theirs = torch.export.default_decompositions()
    ours = _nodes(program.run_decompositions(decomposition_table()))
    assert ours == _nodes(program.run_decompositions(theirs))
    assert "aten.linear.default" not in {target for target, _ in ours}


@pytest.mark.timeout(60)
def test_the_ops_autopar_shards_whole_stay_whole():
    table = decomposition_table()
    for op in (aten.scaled_dot_product_attention.default, aten.nll_loss_forward.default, aten.silu.default):
        assert op not in table
