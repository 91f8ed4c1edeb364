"""Pipeline schedules as data: the order of forward and backward actions on each pipeline rank,
and a simulator that times them.

An `Action` is F (forward of a stage on a micro-batch), B (its backward: input and weight
gradients, or with a split backward the input gradient only) or W (the weight gradient, split
schedules only). `actions(schedule, degree=p, virtual=v, microbatches=m)` gives every rank's list:

- `gpipe`: all forwards, then all backwards (with v > 1 breadth-first: a stage's forwards for all
  micro-batches before the next stage's, PyTorch's LoopedBFS);
- `1f1b`: p - c - 1 warm-up forwards on rank c, then one forward and one backward alternately,
  then the remaining backwards (PipeDream-flush, Megatron's non-interleaved schedule);
- `interleaved_1f1b`: Megatron's interleaved schedule over v stages per rank (stages dealt
  round-robin, m a multiple of p), warm-up (p - c - 1)·2 + (v - 1)·p forwards;
- `dualpipev`: DeepSeek-V3's DualPipe folded into a V (`_dual_pipe_v`): two stages per rank,
  rank c holding stages c and 2p-1-c (`v_stages`), a forward of one micro-batch beside a
  backward of another in the steady state, split backwards (B, W) where they fill bubbles;
- `zb_h1`: zero bubble H1 (Qi et al. 2023): backward split into B (input gradient, on the
  critical path) and W (weight gradient, deferrable); the later ranks defer their Ws into what
  would be their cool-down bubble, at 1F1B's peak memory (p micro-batches on any rank).

`simulate(actions, cost)` runs every rank's list in order, each action starting when its rank is
free and its inputs exist (the previous stage's forward, the next stage's backward, this
micro-batch's B before its W), and returns each action's (start, end) — or raises if the lists
deadlock. The bubble ledger (`autopar.compiler.ledger.bubble`) prices actions with the compute ledger;
the runtime (`autopar.runtime.pipeline`) executes the same lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

SPLIT_BACKWARD = {"zb_h1", "dualpipev"}


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@lru_cache(maxsize=1 << 16)
def _action(kind: str, stage: int, microbatch: int) -> Action:
    """Actions are values: the generators hand out one object per distinct action (a composed
    search builds the lists of a few hundred schedule shapes — ~250K actions, a few thousand
    distinct — and allocating each one took most of that time, 0.74 s for the 8B exercise)."""
    return Action(kind, stage, microbatch)


def _gpipe(p: int, v: int, m: int) -> list[list[Action]]:
    orders = []
    for c in range(p):
        stages = [c + chunk * p for chunk in range(v)]
        forward = [_action("F", s, k) for s in stages for k in range(m)]
        backward = [_action("B", s, k) for s in reversed(stages) for k in range(m)]
        orders.append(forward + backward)
    return orders


def _one_f_one_b(p: int, v: int, m: int) -> list[list[Action]]:
    orders = []
    for c in range(p):
        warmup = min(p - c - 1, m)
        order = [_action("F", c, k) for k in range(warmup)]
        for i in range(m - warmup):
            order += [_action("F", c, warmup + i), _action("B", c, i)]
        order += [_action("B", c, k) for k in range(m - warmup, m)]
        orders.append(order)
    return orders


def _interleaved(p: int, v: int, m: int) -> list[list[Action]]:
    """Megatron's `forward_backward_pipelining_with_interleaving`, per rank."""
    total = m * v

    def forward(c: int, k: int) -> Action:
        chunk = (k // p) % v
        return _action("F", chunk * p + c, (k // (p * v)) * p + k % p)

    def backward(c: int, k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return _action("B", chunk * p + c, (k // (p * v)) * p + k % p)

    orders = []
    for c in range(p):
        warmup = min((p - c - 1) * 2 + (v - 1) * p, total)
        order = [forward(c, k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [forward(c, warmup + i), backward(c, i)]
        order += [backward(c, k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _zero_bubble_h1(p: int, v: int, m: int) -> list[list[Action]]:
    """ZB-H1 (the paper's Figure 3): rank c runs p - c warm-up forwards, then a B for each forward
    it can add, a W whenever p micro-batches are held (a micro-batch is held until its W) or no
    forward is left, and the remaining Ws last: the last rank defers its first Ws into what would
    be its cool-down bubble, the first rank runs B W F, with 1F1B's peak of p micro-batches."""
    orders = []
    for c in range(p):
        forwards = min(p - c, m)
        order = [_action("F", c, k) for k in range(forwards)]
        backwards = weights = 0
        while backwards < m:
            order.append(_action("B", c, backwards))
            backwards += 1
            if (forwards - weights >= p or forwards == m) and weights < backwards:
                order.append(_action("W", c, weights))
                weights += 1
            if forwards < m:
                order.append(_action("F", c, forwards))
                forwards += 1
        order += [_action("W", c, k) for k in range(weights, m)]
        orders.append(order)
    return orders


def v_stages(p: int, c: int) -> tuple[int, int]:
    """The two stages rank c holds in a V (DualPipeV): c on the way down, 2p-1-c on the way back
    up, so the last rank holds the middle two and hands over between them in memory, and the
    first rank holds the first stage and the last (the embedding and the loss)."""
    return c, 2 * p - 1 - c


def stage_coordinate(schedule: str, degree: int, stage: int) -> int:
    """The pipeline rank that holds `stage`: dealt round-robin (stage mod p: Megatron's
    interleaving), or in a V under a V-shaped schedule (`v_stages`)."""
    if schedule in V_SHAPED:
        return stage if stage < degree else 2 * degree - 1 - stage
    return stage % degree


def _dual_pipe_v(p: int, v: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V over p ranks; PyTorch's
    `ScheduleDualPipeV` follows the same published phases), per rank c with stages (a, b) =
    `v_stages(p, c)`; B is the input gradient, W the weight gradient, and a full backward is B then
    its W at once:

    1. 2(p-c-1) forwards of a;          2. c+1 times F(a) F(b);
    3. p-c-1 times B(b) W(b) F(b);      4. m-2p+c+1 times F(a) B+W(b) then F(b) B+W(a): the
       steady state, where each forward runs beside another micro-batch's backward (`overlapped`:
       one's compute hides the other's all-to-alls), except the last rank's first F(a) B(b),
       which run one after the other so that the first backward reaches the others sooner;
    5. p-c-1 times B+W(b) then F(b) beside B+W(a);
    6. c+1 times B(b) B(a), full backwards for the first half and input gradients only for the
       second (on odd ranks one step earlier for b);
    7. p-c-1 times W then B(a);         8. the Ws still pending, oldest first.

    Needs m >= 2p (every stage's micro-batches in flight through the V)."""
    return [list(order) for order in _dual_pipe_v_with_pairs(p, m)[0]]


@lru_cache(maxsize=256)
def _dual_pipe_v_with_pairs(p: int, m: int) -> tuple[tuple[tuple[Action, ...], ...], tuple[frozenset[int], ...]]:
    """DualPipeV's lists (`_dual_pipe_v`) and, per rank, the positions of its forwards that run
    beside the full backward after them (phases 4 and 5)."""
    orders, pairs = [], []
    for c in range(p):
        a, b = v_stages(p, c)
        order: list[Action] = []
        beside: set[int] = set()
        done = {("F", a): 0, ("F", b): 0, ("B", a): 0, ("B", b): 0}
        weights: list[Action] = []  # Ws of input-only backwards, oldest first

        def forward(stage: int) -> None:
            order.append(_action("F", stage, done[("F", stage)]))
            done[("F", stage)] += 1

        def backward(stage: int, *, full: bool) -> None:
            k = done[("B", stage)]
            done[("B", stage)] += 1
            order.append(_action("B", stage, k))
            (order if full else weights).append(_action("W", stage, k))

        def pending_weight() -> None:
            if weights:
                order.append(weights.pop(0))

        for _ in range(2 * (p - c - 1)):
            forward(a)
        for _ in range(c + 1):
            forward(a)
            forward(b)
        for _ in range(p - c - 1):
            backward(b, full=False)
            pending_weight()
            forward(b)
        for i in range(m - 2 * p + c + 1):
            if not (i == 0 and c == p - 1):
                beside.add(len(order))
            forward(a)
            backward(b, full=True)
            beside.add(len(order))
            forward(b)
            backward(a, full=True)
        for _ in range(p - c - 1):
            backward(b, full=True)
            beside.add(len(order))
            forward(b)
            backward(a, full=True)
        split = False
        for i in range(c + 1):
            split = split or (i == (c + 1) // 2 and c % 2 == 1)
            backward(b, full=not split)
            split = split or (i == (c + 1) // 2 and c % 2 == 0)
            backward(a, full=not split)
        for _ in range(p - c - 1):
            pending_weight()
            backward(a, full=not split)
        while weights:
            pending_weight()
        orders.append(tuple(order))
        pairs.append(frozenset(beside))
    return tuple(orders), tuple(pairs)


GENERATORS: dict[str, Callable[[int, int, int], list[list[Action]]]] = {
    "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved_1f1b": _interleaved, "zb_h1": _zero_bubble_h1,
    "dualpipev": _dual_pipe_v}
# schedules whose ranks hold their stages in a V (`v_stages`), not dealt round-robin
V_SHAPED = {"dualpipev"}


def actions(schedule: str, *, degree: int, virtual: int, microbatches: int) -> list[list[Action]]:
    """Every pipeline rank's actions, in order (see the module docstring)."""
    if schedule == "interleaved_1f1b" and microbatches % degree:
        raise ValueError(f"interleaved_1f1b needs micro-batches ({microbatches}) to be a multiple of the pipeline "
                         f"degree ({degree})")
    if schedule in V_SHAPED and (virtual != 2 or microbatches < 2 * degree):
        raise ValueError(f"{schedule} runs 2 stages per rank (got {virtual}) and at least 2 × {degree} micro-batches "
                         f"(got {microbatches})")
    return GENERATORS[schedule](degree, virtual, microbatches)


# schedules whose lists pair a forward with the full backward after it, to run side by side
OVERLAPPING = {"dualpipev"}
# where the pairs run side by side (`runtime/overlap.py`): ranks on the CPU, gloo's. On an
# accelerator each half would need a stream of its own, with the streams of the tensors one half
# frees while the other's kernels read them recorded (not written yet); on one shared stream the
# two threads' collectives can queue in different orders on two ranks and deadlock them. There
# the pairs run one after the other, and are priced so.
SIDE_BY_SIDE_DEVICES = {"cpu"}
SIDE_BY_SIDE_BACKENDS = {"gloo"}


def overlapped(schedule: str, *, degree: int, virtual: int, microbatches: int) -> list[frozenset[int]]:
    """Per pipeline rank, the positions i in its list (`actions`) whose forward runs beside the
    full backward at i + 1 (another stage, another micro-batch): DualPipeV's steady state. Empty
    for schedules that run one action at a time."""
    if schedule not in OVERLAPPING:
        return [frozenset()] * degree
    actions(schedule, degree=degree, virtual=virtual, microbatches=microbatches)  # the same checks
    return list(_dual_pipe_v_with_pairs(degree, microbatches)[1])


@dataclass(frozen=True)
class Timed:
    action: Action
    rank: int
    start: float
    end: float


def _inputs(action: Action, stages: int, latency: float, rank_of: Callable[[int], int] | None
            ) -> list[tuple[Action, float]]:
    s, k = action.stage, action.microbatch

    def lag(other: int) -> float:  # a hand-over between two stages of one rank moves nothing
        return 0.0 if rank_of is not None and rank_of(other) == rank_of(s) else latency

    if action.kind == "F":
        return [(Action("F", s - 1, k), lag(s - 1))] if s > 0 else []
    if action.kind == "B":
        return [(Action("F", s, k), 0.0)] + ([(Action("B", s + 1, k), lag(s + 1))] if s < stages - 1 else [])
    return [(Action("B", s, k), 0.0)]


def simulate(orders: list[list[Action]], cost: Callable[[Action], float], *, stages: int,
             split_backward: bool = False, latency: float = 0.0, cores: int | None = None,
             rank_of: Callable[[int], int] | None = None, pairs: list[frozenset[int]] | None = None,
             pair_cost: Callable[[Action, Action], float] | None = None) -> list[Timed]:
    """Every action's start and end when each rank runs its list in order (see module docstring).

    `cores`: ranks share that many processors (processor sharing: r running ranks each progress
    at min(1, cores / r)), as on a machine with fewer cores than pipeline ranks; None: one each.
    `rank_of`: the rank of each stage (`PipelineLayout.coordinate`), so that a hand-over between
    two stages of one rank waits no `latency`; None: every hand-over waits it.
    `pairs`: per rank, positions of a forward that runs beside the full backward after it
    (`overlapped`): the two start once both have their inputs and end together, after
    `pair_cost(forward, backward)`, which includes the backward's W (that W then takes nothing;
    default: the three costs' sum, compute that shares one processor)."""
    pairs = pairs or [frozenset()] * len(orders)
    in_pairs = _done_in_pairs(orders, pairs)
    if pair_cost is None:
        def pair_cost(first: Action, second: Action) -> float:
            return cost(first) + cost(second) + cost(_action("W", second.stage, second.microbatch))

    def alone(action: Action) -> float:  # a W done in its pair takes nothing
        return 0.0 if action in in_pairs else cost(action)
    end: dict[Action, float] = {}
    started: dict[int, tuple[float, float, int]] = {}  # rank -> (start, work left, actions) of what it runs
    timed: list[Timed] = []
    position = [0] * len(orders)
    now = 0.0
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        waiting_until = []
        for rank, order in enumerate(orders):
            if position[rank] >= len(order) or rank in started:
                continue
            count = 2 if position[rank] in pairs[rank] else 1
            running = order[position[rank]:position[rank] + count]
            needed = [need for action in running for need in _inputs(action, stages, latency, rank_of)]
            if all(a in end for a, _ in needed):
                ready = max([now] + [end[a] + lag for a, lag in needed])
                if ready <= now + 1e-12:
                    work = alone(running[0]) if count == 1 else pair_cost(*running)
                    started[rank] = (now, work, count)
                else:
                    waiting_until.append(ready)
        if not started:
            if not waiting_until:
                stuck = [(r, str(o[position[r]])) for r, o in enumerate(orders) if position[r] < len(o)]
                raise RuntimeError(f"pipeline schedule deadlocks: ranks wait at {stuck}")
            now = min(waiting_until)
            continue
        rate = 1.0 if cores is None else min(1.0, cores / len(started))
        step = min([left / rate for _, left, _ in started.values()] + [t - now for t in waiting_until])
        now += step
        for rank in list(started):
            start, left, count = started[rank]
            left -= step * rate
            if left > 1e-9:
                started[rank] = (start, left, count)
                continue
            for action in orders[rank][position[rank]:position[rank] + count]:
                end[action] = now
                timed.append(Timed(action, rank, start, now))
            position[rank] += count
            del started[rank]
    return timed


def busy_seconds(timed: list[Timed], ranks: int) -> list[float]:
    """Per rank: the time it runs something, time when two of its actions overlap (`overlapped`) counted once."""
    busy = [0.0] * ranks
    reached = [min((t.start for t in timed), default=0.0)] * ranks  # the end of what is already counted
    for t in sorted(timed, key=lambda t: t.start):
        busy[t.rank] += max(0.0, t.end - max(t.start, reached[t.rank]))
        reached[t.rank] = max(reached[t.rank], t.end)
    return busy


def bubble_fractions(timed: list[Timed], ranks: int) -> list[float]:
    """Per rank: the fraction of the step (first start to last end, over all ranks) it is idle."""
    span = max(t.end for t in timed) - min(t.start for t in timed)
    return [1 - b / span for b in busy_seconds(timed, ranks)]


def _done_in_pairs(orders: list[list[Action]], pairs: list[frozenset[int]]) -> frozenset[Action]:
    """The Ws of the full backwards that run in a pair (`overlapped`): their work is done in the pair."""
    done = set()
    for order, positions in zip(orders, pairs):
        for i in positions:
            b, w = order[i + 1], order[i + 2]
            if not (b.kind == "B" and w.kind == "W" and (b.stage, b.microbatch) == (w.stage, w.microbatch)):
                raise ValueError(f"position {i} pairs {order[i]} with {b}, which is no full backward (next: {w})")
            done.add(w)
    return frozenset(done)


def whole_backwards(order: "list[Action] | tuple[Action, ...]") -> frozenset[int]:
    """Positions of the Bs whose W is the very next action (DualPipeV's full backwards): the
    runtime runs each as one whole backward (`runtime/pipeline.py`), so its micro-batch lets go
    of everything at B and the W that follows holds and frees nothing."""
    return frozenset(i for i, (b, w) in enumerate(zip(order, order[1:]))
                     if b.kind == "B" and w.kind == "W" and (b.stage, b.microbatch) == (w.stage, w.microbatch))


def in_flight(order: list[Action], *, split_backward: bool) -> dict[int, int]:
    """Per stage of one rank: the most micro-batches whose activations are held at once (a
    forward done, its backward — its W with a split backward, unless that B runs whole — not yet)."""
    releases = "W" if split_backward else "B"
    whole = whole_backwards(order) if split_backward else frozenset()
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for index, action in enumerate(order):
        if action.kind == "F":
            held[action.stage] = held.get(action.stage, 0) + 1
            peak[action.stage] = max(peak.get(action.stage, 0), held[action.stage])
        elif action.kind == releases and index - 1 not in whole or index in whole:
            held[action.stage] -= 1
    return peak


def peak_held(order: list[Action], *, releases: dict[int, str], forward_bytes: dict[int, float],
              after_input_bytes: dict[int, float] | None = None) -> dict[int, tuple[int, int]]:
    """Per stage of one rank, at the moment the rank holds the most bytes: (micro-batches past their
    forward and before their backward, micro-batches past their B and before their W). A stage's
    micro-batch holds `forward_bytes[s]` from F to B, and with a split backward (`releases[s]` "W")
    `after_input_bytes[s]` from B to W."""
    after = after_input_bytes or {}
    whole = whole_backwards(order)
    forward = {stage: 0 for stage in forward_bytes}
    waiting = {stage: 0 for stage in forward_bytes}
    best, best_total = {s: (0, 0) for s in forward_bytes}, -1.0
    for index, action in enumerate(order):
        s = action.stage
        if action.kind == "F":
            forward[s] += 1
        elif action.kind == "B":
            forward[s] -= 1
            waiting[s] += 1 if releases[s] == "W" and index not in whole else 0
        elif action.kind == "W" and index - 1 not in whole:
            waiting[s] -= 1
        total = sum(forward[t] * forward_bytes[t] + waiting[t] * after.get(t, 0) for t in forward)
        if total > best_total:
            best, best_total = {t: (forward[t], waiting[t]) for t in forward}, total
    return best


def peak_live(order: list[Action], *, releases: dict[int, str], forward_bytes: dict[int, float],
              after_input_bytes: dict[int, float] | None = None, working: dict[int, float] | None = None,
              sent_forward: dict[int, float] | None = None, sent_backward: dict[int, float] | None = None,
              gradients: float = 0.0) -> float:
    """The most bytes one rank's schedule keeps alive at once beyond what it always holds: the
    micro-batches held as in `peak_held`, a stage's backward working memory while its B runs
    (`working[s]`), the sends the runtime holds (`sent_forward[s]`: a micro-batch's forward send
    from its F until its B receives the gradient; `sent_backward[s]`: each B's gradient send,
    until the step ends), and the step's gradients once the rank's first backward has made them."""
    after, working = after_input_bytes or {}, working or {}
    sent_forward, sent_backward = sent_forward or {}, sent_backward or {}
    # what each action adds to the running total (held micro-batches, sends), per stage: the planner
    # at scale walks every rank's list for each candidate it composes
    on_f = {s: forward_bytes[s] + sent_forward.get(s, 0) for s in forward_bytes}
    on_b = {s: sent_backward.get(s, 0) - sent_forward.get(s, 0) + (after.get(s, 0) if releases[s] == "W" else 0)
            - forward_bytes[s] for s in forward_bytes}
    during_b = {s: working.get(s, 0) for s in forward_bytes}  # its working memory beside what it releases
    whole = whole_backwards(order)  # Bs run whole: nothing held on to their W
    total, most, grads_counted = 0.0, 0.0, False
    for index, action in enumerate(order):
        kind, s = action.kind, action.stage
        if kind == "F":
            total += on_f[s]
        elif kind == "B":
            most = max(most, total + during_b[s])
            total += on_b[s] - (after.get(s, 0) if releases[s] == "W" and index in whole else 0)
            if not grads_counted:  # the step's gradients, once the rank's first backward made them
                total, grads_counted = total + gradients, True
        elif kind == "W" and index - 1 not in whole:
            total -= after.get(s, 0)
        if total > most:
            most = total
    return most
