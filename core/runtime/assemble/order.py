"""The issue order a choice runs with: the ops in the schedule's order (or program order for the
single-stream baseline), each on a CUDA stream (the planned streams folded onto as few as keep
them parallel, the artifact's capped candidate, or one), the waits between them, and the pairs
(`runtime/pairs/`) that this order allows. A pair that would move a read past the memory plan's
proof is dropped (`holds`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir import Graph
from ...plan import capped
from ...plan.memory import MemoryPlan
from ...plan.schedule import Schedule
from ...plan.verify import check_plan
from .. import pairs
from ..base.settings import Settings
from .choice import PROLOGUES, Choice, stream_cap


@dataclass
class IssueOrder:
    order: list[int]  # op ids, in issue order
    stream_of: list[int]  # op id -> CUDA stream
    waits: list  # op id -> the ops it waits for on other streams
    planned_stream_of: list[int]  # op id -> the stream the schedule planned (a trace's tracks)
    pairs: pairs.Pairs = field(default_factory=pairs.Pairs)


def issue_order(graph: Graph, schedule: Schedule, memory: MemoryPlan, placed, choice: Choice, *,
                single_stream: bool, paired: bool, settings: Settings) -> IssueOrder:
    """The order `choice` issues the ops in, with the pairs of `placed` it allows where `paired`
    (on CUDA, with an arena: kernels that write two ops' buffers)."""
    n = len(graph.ops)
    if single_stream:
        order, stream_of, waits = list(range(n)), [0] * n, [()] * n
    elif choice.streams == "serial":
        order, stream_of, waits = list(schedule.order), [0] * n, [()] * n
    else:  # the planned streams, folded onto as few CUDA streams as keep every one of them parallel,
        order = list(schedule.order)  # or the artifact's candidate capped as `choice` says
        stream_of = capped.streams_under(schedule, stream_cap(choice.streams))
        waits = list(capped.as_schedule(schedule, stream_of).waits)  # the rest: in order
    planned = not single_stream and choice.streams != "serial"
    found = IssueOrder(order, stream_of, waits, list(schedule.stream) if planned else [0] * n)
    if paired:
        prologues = choice.prologues == PROLOGUES[1] and choice.layout == "channels_last"
        found.pairs = pairs.find(graph, placed, order, stream_of, waits, prologues, settings)
        if found.pairs.inputs and not holds(graph, memory, found, pairs.held_by(graph, found.pairs.inputs)):
            found.pairs.inputs = {}  # a plan from before `memory.held_inputs` held them may free them sooner
    return found


def holds(graph: Graph, memory: MemoryPlan, issue: IssueOrder, held: dict[int, list[int]]) -> bool:
    """Whether the memory plan stays safe, under this issue order and streams, where each op in
    `held` also uses the values listed for it (`verify.check_plan`)."""
    position = [0] * len(issue.order)
    for k, op in enumerate(issue.order):
        position[op] = k
    order = Schedule(tuple(issue.stream_of), tuple(issue.order), tuple(position),
                     tuple(tuple(w) for w in issue.waits), 0, 0, 0, 0, "")
    try:
        check_plan(graph, order, memory, held)
    except ValueError:
        return False
    return True
