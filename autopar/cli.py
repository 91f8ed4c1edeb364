"""The `autopar` command line.

    autopar plan  <module:function | file.py[:function]> --mesh dp=2,tp=2 [--strategy dp,sp] [--node 8]
                  [--symbolic b=0,s=1] [--params-only]
    autopar graph <...same target...> --mesh ... --rank R

The target function takes no arguments and returns `(model, example_inputs)` (a global batch);
`file.py` alone means its function `example`. `--strategy` lists strategy names: dp
(data_parallel on axis dp), tp (tensor_parallel on tp), sp (sequence_parallel on tp); by default
dp for a `dp` axis and tp for a `tp` axis. `plan` prints the passes, the placement table and the
communication ledger; `graph` prints the code of one rank's emitted graph.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

from autopar.errors import PlanError
from autopar.mesh import Mesh

STRATEGY_NAMES = ("dp", "tp", "sp")


def load_target(target: str) -> Callable[[], Any]:
    path, _, function = target.partition(":")
    if path.endswith(".py"):
        if not os.path.exists(path):
            raise PlanError(f"no such file: {path}")
        sys.path.insert(0, os.getcwd())
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(path)
    function = function or "example"
    if not hasattr(module, function):
        raise PlanError(f"{path} has no function {function!r}; it should return (model, example_inputs)")
    return getattr(module, function)


def strategies_for(names: str | None, mesh: Mesh) -> list[Any]:
    from autopar.strategies.data_parallel import data_parallel
    from autopar.strategies.tensor_parallel import sequence_parallel, tensor_parallel

    chosen = names.split(",") if names else [a for a in ("dp", "tp") if a in mesh.names]
    makers = {"dp": data_parallel, "tp": tensor_parallel, "sp": sequence_parallel}
    unknown = [n for n in chosen if n not in makers]
    if unknown:
        raise PlanError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGY_NAMES)}")
    return [makers[n]() for n in chosen]


def _symbolic(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    return {name: int(dim) for name, _, dim in (part.partition("=") for part in text.split(","))}


def _plan(args: argparse.Namespace):
    from autopar.plan import plan

    model, inputs = load_target(args.target)()
    mesh = Mesh.parse(args.mesh, ranks_per_node=args.node)
    return plan(model, mesh, strategies=strategies_for(args.strategy, mesh), example_inputs=inputs,
                dynamic_dims=_symbolic(args.symbolic))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description="plan and inspect distributed training programs")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("plan", "print the placement table and the communication ledger"),
                            ("graph", "print one rank's emitted graph")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("target", help="module:function or file.py[:function] returning (model, example_inputs)")
        command.add_argument("--mesh", required=True, help="axes, e.g. dp=2,tp=2")
        command.add_argument("--strategy", help="comma-separated: dp, tp, sp")
        command.add_argument("--node", type=int, help="ranks per node (axes spanning nodes are 'inter')")
        command.add_argument("--symbolic", help="symbolic input dims, e.g. b=0,s=1")
        if name == "plan":
            command.add_argument("--params-only", action="store_true", help="placement table of parameters only")
        else:
            command.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        the_plan = _plan(args)
        if args.command == "plan":
            print(the_plan.report(activations=not args.params_only))
        else:
            if not 0 <= args.rank < the_plan.mesh.world_size:
                raise PlanError(f"--rank {args.rank} is outside the mesh's {the_plan.mesh.world_size} ranks")
            print(the_plan.rank_graph(args.rank).code.strip())
    except PlanError as error:
        print(f"autopar: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
