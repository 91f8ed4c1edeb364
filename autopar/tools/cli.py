"""The `autopar` command line.

    autopar plan    TARGET --cluster h100x8 --auto [--top N] [--axes dp,tp] [--save search.json]
    autopar plan    TARGET --mesh dp=2,tp=2 [--strategy dp,sp] [--node 8] [--symbolic b=0,s=1]
                    [--params-only] [--save plan.json] [--compare-stages] [--compare-cp] [--timeline out.svg]
                    [--schedule 1f1b --microbatches 8 --virtual-stages 1 --stages layers.4]
                    [--cp-method ring --no-load-balance] [--recompute selective|full|GLOBS]
                    [--no-overlap | --chunks K]
    autopar graph   TARGET --mesh ... --rank R [--diff] [--html out.html]
    autopar check   TARGET --mesh ... --baseline comm.json [--tolerance PCT] [--update [--accept]]
    autopar diff    a.json b.json
    autopar explain plan.json NODE_OR_MODULE
    autopar explain search.json [NODE_OR_MODULE] [--top N]
    autopar explain TARGET --cluster h100x8 [--axes dp,tp] [--top N]

TARGET is `module:function` or `file.py[:function]` (default `example`): a function with no
arguments returning `(model, example_inputs)` (a global batch). `--strategy` lists strategy
names: dp (data_parallel on axis dp), zero1 / zero2 / zero3 / fsdp (ZeRO on dp), hsdp (FSDP on
dp_shard, replicated on dp_rep), tp (tensor_parallel on tp), sp (sequence_parallel on tp), pp
(pipeline_parallel on pp, with --schedule, --microbatches, --virtual-stages, --stages), cp
(context_parallel on cp, with --cp-method ring|allgather|alltoall and --no-load-balance), ep
(expert_parallel on ep: experts split by expert, tokens exchanged by all-to-all); by default dp
for a `dp` axis, tp for a `tp` axis, pp for a `pp` axis, cp for a `cp` axis and ep for an `ep` axis.
`--recompute` adds `autopar.recompute` (selective, full, or comma-separated module globs);
`--no-overlap` adds `autopar.schedule(overlap=False)`, `--chunks K` `autopar.schedule(chunks=K)`
(async TP: each TP/SP linear and its forward collective in K pieces of rows).
`--auto` lets the planner choose mesh and strategies for `--cluster` (a preset: h100x8, a100x64,
cpu2x4, ...; `autopar/planner/search.py`) and prints its answer — the chosen layout, its peak memory
and predicted step, the binding constraint and why — then its ranking: each candidate's peak memory,
bytes, predicted step time and its parts, and why it lost (`autopar/planner/search_report.py`);
`--save search.json` keeps all of it, with the winner's plan, in a search file
(`autopar/planner/search_file.py`). `explain search.json` prints it again without tracing or
searching, `explain search.json NODE` explains a node of the winner's plan, and `explain TARGET
--cluster NAME` searches and prints the same. `explain` and `diff` tell a search file from a plan
file by its content (its "schema"), not its name.
`--compare-stages` prints DDP and ZeRO-1/2/3 side by side on the dp axis (memory per category per
rank, bytes per step); `--compare-cp` the ring, all-gather and all-to-all lowerings of attention
on the cp axis. Exit codes: 0 fine, 1 communication grew
(check, diff), 2 bad input (a plan-time error, printed with its fix).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from autopar.compiler.explain import explain
from autopar.compiler.ledger.bubble import build_bubble_ledger
from autopar.compiler.plan import plan
from autopar.compiler.plan_file import load_plan, save_plan
from autopar.compiler.strategies.context import context_parallel
from autopar.compiler.strategies.data_parallel import data_parallel, replicated
from autopar.compiler.strategies.expert import expert_parallel
from autopar.compiler.strategies.mixed_precision import float8, mixed_precision
from autopar.compiler.strategies.pipeline import pipeline_parallel
from autopar.compiler.strategies.recompute import recompute
from autopar.compiler.strategies.schedule import schedule
from autopar.compiler.strategies.tensor_parallel import sequence_parallel, tensor_parallel
from autopar.compiler.strategies.zero import fsdp, hsdp, zero
from autopar.core.errors import PlanError
from autopar.core.mesh import Mesh
from autopar.cost.cluster import Cluster
from autopar.planner.search import search, winner_plan
from autopar.planner.search_file import file_kind, load_search, save_search, search_document
from autopar.planner.search_space import SearchSpace
from autopar.tools.comm_gate import baseline_change, comm_summary, compare, load_baseline, update_baseline
from autopar.tools.context_compare import compare_context_methods, context_table
from autopar.tools.plan_diff import diff_plans
from autopar.tools.stage_compare import compare_stages, stage_table
from autopar.tools.views.code import annotated_code, traced_vs_rank
from autopar.tools.views.html import render_html
from autopar.tools.views.timeline import render_timeline

STRATEGY_NAMES = ("dp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "sp", "pp", "cp", "ep")


def load_target(target: str) -> Callable[[], Any]:
    path, _, function = target.partition(":")
    sys.path.insert(0, os.getcwd())
    if path.endswith(".py"):
        if not os.path.exists(path):
            raise PlanError(f"no such file: {path}")
        spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    function = function or "example"
    if not hasattr(module, function):
        raise PlanError(f"{path} has no function {function!r}; it should return (model, example_inputs)")
    return getattr(module, function)


def strategies_for(names: str | None, mesh: Mesh, pipeline: dict[str, Any] | None = None,
                   context: dict[str, Any] | None = None) -> list[Any]:
    """Strategies by CLI name; `pipeline` holds pp's options (schedule, microbatches, virtual_stages,
    stages), `context` cp's (method, load_balance)."""
    chosen = names.split(",") if names else [a for a in ("dp", "tp", "pp", "cp", "ep") if a in mesh.names]
    makers = {"dp": data_parallel, "ep": expert_parallel, "tp": tensor_parallel, "sp": sequence_parallel, "fsdp": fsdp, "hsdp": hsdp,
              "cp": lambda: context_parallel(**{k: v for k, v in (context or {}).items() if v is not None}),
              "pp": lambda: pipeline_parallel(**{k: v for k, v in (pipeline or {}).items() if v is not None}),
              **{f"zero{k}": (lambda k=k: zero(stage=k)) for k in (1, 2, 3)}}
    unknown = [n for n in chosen if n not in makers]
    if unknown:
        raise PlanError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGY_NAMES)}")
    return [makers[n]() for n in chosen]


def _symbolic(text: str | None) -> dict[str, int] | None:
    if not text:
        return None
    return {name: int(dim) for name, _, dim in (part.partition("=") for part in text.split(","))}


def _plan(args: argparse.Namespace, *, explain: bool = False):
    _require_mesh(args)
    model, inputs = load_target(args.target)()
    mesh = Mesh.parse(args.mesh, ranks_per_node=args.node)
    return plan(model, mesh, strategies=declared_strategies(args, mesh),
                example_inputs=inputs,
                dynamic_dims=_symbolic(args.symbolic), explain=explain, backend=args.backend)


def declared_strategies(args: argparse.Namespace, mesh: Mesh) -> list[Any]:
    """`--strategy` with its axes' options, plus `--recompute` and `--no-overlap` / `--chunks`."""
    return (strategies_for(args.strategy, mesh, _pipeline_options(args), _context_options(args))
            + [replicated(axis) for axis in (getattr(args, "replicated", None) or "").split(",") if axis]
            + _recompute_option(args) + _schedule_option(args) + _precision_option(args))


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _precision_option(args: argparse.Namespace) -> list[Any]:
    """`--mixed-precision bf16[:fp32]`: autopar.mixed_precision(compute dtype[, reduce dtype])."""
    text = getattr(args, "mixed_precision", None)
    if not text:
        return _float8_option(args)
    names = text.split(":")
    if len(names) > 2 or any(name not in _DTYPES for name in names):
        raise PlanError(f"--mixed-precision {text}: expected COMPUTE[:REDUCE] with each of {', '.join(_DTYPES)}, "
                        f"e.g. bf16 or bf16:fp32")
    dtypes = [getattr(torch, _DTYPES[name]) for name in names]
    return [mixed_precision(*dtypes)] + _float8_option(args)


def _float8_option(args: argparse.Namespace) -> list[Any]:
    """`--float8 rowwise|tensorwise[:local]`: autopar.float8(recipe[, data_scales="local"])."""
    text = getattr(args, "float8", None)
    if not text:
        return []
    recipe, _, scales = text.partition(":")
    if scales not in ("", "local"):
        raise PlanError(f"--float8 {text}: expected RECIPE or RECIPE:local, e.g. rowwise or tensorwise:local")
    return [float8(recipe, data_scales=scales or "global")]


def _recompute_option(args: argparse.Namespace) -> list[Any]:
    """`--recompute selective|full|GLOB,GLOB`: autopar.recompute(policy) beside the strategies."""
    if not args.recompute:
        return []
    return [recompute(args.recompute if args.recompute in ("selective", "full") else args.recompute.split(","))]


def _schedule_option(args: argparse.Namespace) -> list[Any]:
    """`--no-overlap` / `--chunks K`: autopar.schedule(...) beside the strategies."""
    if not args.no_overlap and args.chunks is None:
        return []
    try:
        return [schedule(overlap=not args.no_overlap, chunks=1 if args.chunks is None else args.chunks)]
    except ValueError as error:
        raise PlanError(f"--no-overlap / --chunks: {error}") from None


def _pipeline_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"schedule": args.schedule, "microbatches": args.microbatches, "virtual_stages": args.virtual_stages,
            "stages": args.stages.split(",") if args.stages else None}


def _context_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"method": args.cp_method, "load_balance": False if args.no_load_balance else None}


def _search(args: argparse.Namespace):
    if not args.cluster:
        raise PlanError("--auto (and explain TARGET) need --cluster NAME, a preset such as h100x8 or cpu2x4")

    model, inputs = load_target(args.target)()
    space = SearchSpace(axes=tuple(args.axes.split(","))) if args.axes else None
    return search(model, Cluster.preset(args.cluster), example_inputs=inputs, space=space), model, inputs


def _require_mesh(args: argparse.Namespace) -> None:
    if not args.mesh:
        raise PlanError("give --mesh (e.g. --mesh dp=2,tp=2), or --cluster NAME --auto to let the planner choose")


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.auto:
        if args.chunks is not None or args.no_overlap:
            raise PlanError("--auto lets the planner choose the strategies; it does not take --chunks or "
                            "--no-overlap (plan the chosen mesh with --mesh and --strategy to add them)")
        result, model, inputs = _search(args)
        winner = winner_plan(result, model, example_inputs=inputs) if args.save else None
        document = search_document(result, target=args.target, winner=winner)
        print(document.report(top=args.top))
        if args.save:
            save_search(document, args.save)
            print(f"\nthe search saved to {args.save}, with the chosen plan: `autopar explain {args.save}` prints "
                  f"this again, `autopar explain {args.save} NODE` explains a node of the chosen plan")
        return 0
    _require_mesh(args)
    if args.compare_stages:

        model, inputs = load_target(args.target)()
        mesh = Mesh.parse(args.mesh, ranks_per_node=args.node)
        mesh.require_axis("dp", wanted_by="--compare-stages")
        strategies = declared_strategies(args, mesh)
        rows = compare_stages(model, mesh, strategies=strategies, example_inputs=inputs,
                              dynamic_dims=_symbolic(args.symbolic), backend=args.backend)
        print(f"ZeRO stages on dp, mesh {mesh}: bytes per rank (memory after a step; communication per step)\n")
        print(stage_table(rows))
        return 0
    if args.compare_cp:

        model, inputs = load_target(args.target)()
        mesh = Mesh.parse(args.mesh, ranks_per_node=args.node)
        strategies = declared_strategies(args, mesh)
        rows = compare_context_methods(model, mesh, strategies=strategies, example_inputs=inputs,
                                       dynamic_dims=_symbolic(args.symbolic), backend=args.backend)
        print(f"Attention on sequence shards, mesh {mesh}: bytes per rank (communication on the context "
              f"axis per step; memory of rank 0)\n")
        print(context_table(rows))
        return 0
    the_plan = _plan(args, explain=bool(args.save))
    print(the_plan.report(activations=not args.params_only))
    if args.timeline:
        if the_plan.pipeline is None:
            raise PlanError("--timeline draws a pipeline's schedule; the plan has no pipeline stages "
                            "(add --strategy pp on a pp axis)")

        Path(args.timeline).write_text(render_timeline(predicted=build_bubble_ledger(the_plan).timeline,
                                                       title=f"{the_plan.pipeline.schedule}"))
        print(f"\ntimeline written to {args.timeline}")
    if args.save:

        save_plan(the_plan, args.save)
        print(f"\nplan saved to {args.save}")
    return 0


def _cmd_graph(args: argparse.Namespace) -> int:
    the_plan = _plan(args)
    if not 0 <= args.rank < the_plan.mesh.world_size:
        raise PlanError(f"--rank {args.rank} is outside the mesh's {the_plan.mesh.world_size} ranks")
    rank_graph = the_plan.rank_graph(args.rank)
    if args.html:

        Path(args.html).write_text(render_html(the_plan.document().data, title=f"autopar plan: {args.target}"))
        print(f"wrote {args.html}")
    elif args.diff:
        print(traced_vs_rank(the_plan.traced.original_code, rank_graph.code, rank=args.rank))
    else:
        print(annotated_code(rank_graph))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    current = comm_summary(_plan(args))
    if args.update:  # written only with --accept, after the change is printed: never silently
        change = baseline_change(current, args.baseline)
        if change and not args.accept:
            print(f"baseline {args.baseline} would change (not rewritten; add --accept to rewrite it):\n{change}")
            return 1
        if change:
            update_baseline(current, args.baseline)
        print(f"baseline {args.baseline} " + (f"rewritten; what changed:\n{change}" if change else "unchanged")
              + f"\n{current['total_bytes']} bytes per rank per step")
        return 0
    result = compare(load_baseline(args.baseline), current, tolerance_pct=args.tolerance)
    print(result.table())
    if result.passed:
        print(f"\ncommunication within {args.baseline} (tolerance {args.tolerance}%)")
        return 0
    print(f"\nFAILED: communication changed against {args.baseline}: {result.failures()}\n"
          f"(rerun with --update to see what a rewrite changes, --update --accept to accept it)")
    return 1


def _plan_file(path: str):
    """A plan file, or the chosen plan a search file holds (told apart by content, `file_kind`)."""
    return load_search(path).winner_plan(path=path) if file_kind(path) == "search" else load_plan(path)


def _cmd_diff(args: argparse.Namespace) -> int:
    result = diff_plans(_plan_file(args.before), _plan_file(args.after))
    print(result.report())
    return 1 if result.grew else 0


def _cmd_explain(args: argparse.Namespace) -> int:
    """A search file (its answer and ranking, or a node of its chosen plan), a plan file (a node), or
    a TARGET with --cluster (searched now): a file is told apart by its content (`file_kind`)."""
    kind = file_kind(args.plan) if os.path.isfile(args.plan) else None
    if kind is None:
        return _explain_search(args)
    if args.cluster or args.axes:
        raise PlanError(f"{args.plan} is a file, read as it is; --cluster and --axes are for a TARGET to search")
    if kind == "plan":
        if not args.name:
            raise PlanError("explain plan.json needs a node name, parameter FQN or module path")
        document = load_plan(args.plan)
    else:
        search_file = load_search(args.plan)  # refuses another version and JSON that is not a search file
        if not args.name:
            print(search_file.report(top=args.top))
            return 0
        document = search_file.winner_plan(path=args.plan)
    try:
        print(explain(document, args.name))
    except KeyError as error:
        raise PlanError(str(error.args[0])) from None
    return 0


def _explain_search(args: argparse.Namespace) -> int:
    """`explain TARGET --cluster NAME`: search now, print what `plan --auto` prints."""
    if not os.path.exists(args.plan) and args.plan.endswith(".json"):  # the name only words the error: no file
        raise PlanError(f"no such file: {args.plan} (explain takes a plan file, a search file, or a TARGET "
                        f"with --cluster NAME)")
    if args.name:
        raise PlanError(f"explain TARGET --cluster NAME takes no node name; save the search (`autopar plan "
                        f"{args.plan} --cluster NAME --auto --save search.json`) and run "
                        f"`autopar explain search.json {args.name}`")
    args.target = args.plan
    result, _, _ = _search(args)
    print(search_document(result, target=args.target).report(top=args.top))
    return 0


def _planning_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument("target", help="module:function or file.py[:function] returning (model, example_inputs)")
    command.add_argument("--mesh", help="axes, e.g. dp=2,tp=2 (plan --auto chooses them)")
    command.add_argument("--strategy", help="comma-separated: " + ", ".join(STRATEGY_NAMES))
    command.add_argument("--replicated", help="axes left replicated on purpose, comma-separated (every rank of "
                         "such an axis computes the same: a mesh axis no strategy uses is refused otherwise)")
    command.add_argument("--node", type=int, help="ranks per node (axes spanning nodes are 'inter')")
    command.add_argument("--backend", choices=("gloo", "nccl"),
                         help="plan as a job on this process-group backend: ZeRO's reduce/gather 'auto' resolve as "
                              "there (gloo: all-to-all and broadcasts); default: the initialised group's, else "
                              "reduce-scatter and all-gather")
    command.add_argument("--symbolic", help="symbolic input dims, e.g. b=0,s=1")
    command.add_argument("--schedule", help="pp: gpipe, 1f1b, interleaved_1f1b, zb_h1 or dualpipev (default 1f1b)")
    command.add_argument("--microbatches", type=int, help="pp: micro-batches per step (default 4)")
    command.add_argument("--virtual-stages", type=int, help="pp: stages per rank (interleaved; default 1)")
    command.add_argument("--stages", help="pp: module paths where stages start, e.g. layers.2,layers.4 "
                                          "(default: balanced)")
    command.add_argument("--cp-method", help="cp: ring, allgather or alltoall (default ring)")
    command.add_argument("--recompute", help="activation recomputation: selective (attention cores), full (every "
                                             "block) or module globs, e.g. layers.*.mlp")
    command.add_argument("--no-overlap", action="store_true",
                         help="every collective waits where it is issued (the scheduling pass off)")
    command.add_argument("--mixed-precision", help="compute dtype over fp32 masters, and optionally the reduction's: "
                                                   "bf16, bf16:fp32 (the default reduction), fp16")
    command.add_argument("--float8", help="linears in FP8 with torchao's recipe: rowwise or tensorwise, with :local "
                                          "for each rank's rows scaled alone, e.g. rowwise:local")
    command.add_argument("--chunks", type=int,
                         help="async TP: each TP/SP linear and its forward collective in this many pieces of rows")
    command.add_argument("--no-load-balance", action="store_true",
                         help="cp: rank i holds chunk i of N (default: chunks i and 2N-1-i of 2N)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="plan, inspect and gate distributed training programs")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_cmd = commands.add_parser("plan", help="print the placement table and the communication ledger")
    _planning_arguments(plan_cmd)
    plan_cmd.add_argument("--cluster", help="a cluster preset (h100x8, a100x64, cpu2x4, ...) for --auto")
    plan_cmd.add_argument("--auto", action="store_true", help="let the planner choose mesh and strategies")
    plan_cmd.add_argument("--top", type=int, default=10, help="--auto: candidates printed (default 10; 0: all)")
    plan_cmd.add_argument("--axes", help="--auto: the axes to search, e.g. dp,tp (default dp,tp,pp,cp,ep)")
    plan_cmd.add_argument("--params-only", action="store_true", help="placement table of parameters only")
    plan_cmd.add_argument("--save", help="also write the plan file (JSON) here; with --auto the search file (the "
                                         "answer, the ranking and the chosen plan)")
    plan_cmd.add_argument("--timeline", help="pipeline: write the predicted timeline of one step as SVG here")
    plan_cmd.add_argument("--compare-stages", action="store_true",
                          help="DDP and ZeRO-1/2/3 on the dp axis side by side: memory and communication")
    plan_cmd.add_argument("--compare-cp", action="store_true",
                          help="ring, allgather and alltoall attention on the cp axis side by side")
    graph_cmd = commands.add_parser("graph", help="print one rank's emitted graph")
    _planning_arguments(graph_cmd)
    graph_cmd.add_argument("--rank", type=int, default=0)
    graph_cmd.add_argument("--diff", action="store_true", help="diff the traced graph against the rank's graph")
    graph_cmd.add_argument("--html", help="write a self-contained HTML view of the plan here")
    check_cmd = commands.add_parser("check", help="fail when communication exceeds a baseline")
    _planning_arguments(check_cmd)
    check_cmd.add_argument("--baseline", required=True)
    check_cmd.add_argument("--tolerance", type=float, default=0.0, help="allowed growth in percent")
    check_cmd.add_argument("--update", action="store_true",
                           help="print what rewriting the baseline would change (exit 1 if anything)")
    check_cmd.add_argument("--accept", action="store_true", help="with --update: rewrite the baseline")
    diff_cmd = commands.add_parser("diff", help="compare two plan files")
    diff_cmd.add_argument("before")
    diff_cmd.add_argument("after")
    explain_cmd = commands.add_parser("explain", help="why a node or module got its placement; why the planner "
                                                      "chose its layout")
    explain_cmd.add_argument("plan", help="a plan file from `autopar plan --save`, a search file from "
                                          "`autopar plan --auto --save`, or a TARGET with --cluster")
    explain_cmd.add_argument("name", nargs="?", help="node name, parameter FQN or module path (of a plan file, or "
                                                     "of a search file's chosen plan)")
    explain_cmd.add_argument("--cluster", help="with a TARGET: the cluster preset the planner chooses for")
    explain_cmd.add_argument("--axes", help="with a TARGET: the axes to search, e.g. dp,tp")
    explain_cmd.add_argument("--top", type=int, default=10, help="a search's candidates printed (default 10; 0: all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"plan": _cmd_plan, "graph": _cmd_graph, "check": _cmd_check, "diff": _cmd_diff,
                "explain": _cmd_explain}
    try:
        return handlers[args.command](args)
    except PlanError as error:
        print(f"autopar: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
