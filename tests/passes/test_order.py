"""`order_canonically`: the op order after the rewrites follows from the data flow alone, so the same
model gets the same fusion, streams and waits from TorchScript and from torch.export."""

import dataclasses
import random

import pytest
import torch

from nimble import frontend, passes
from nimble.ir import renumber
from nimble.pipeline import compile_model, rewrite
from nimble.specs import input_specs
from sample_models.build import MODELS, TOKEN_MODELS, build_module, example_inputs

from ..conftest import SAMPLES
from ..models import ResNet18


def shuffled(graph, seed: int):
    """The same graph with its ops in another valid order (a random topological order) and its
    weights renumbered at random."""
    rng = random.Random(seed)
    waiting = {op.id: set(graph.deps(op)) for op in graph.ops}
    order, ready = [], [i for i, d in waiting.items() if not d]
    while ready:
        op = ready.pop(rng.randrange(len(ready)))
        order.append(op)
        for other, deps in waiting.items():
            if op in deps:
                deps.discard(op)
                if not deps:
                    ready.append(other)
    assert len(order) == len(graph.ops)
    ops = [graph.ops[i] for i in order]
    weights = [v for v in graph.values if v.producer is None and v.id not in graph.inputs]
    rng.shuffle(weights)
    values = [*(graph.values[i] for i in graph.inputs), *weights, *(graph.values[o] for op in ops for o in op.outputs)]
    moved = renumber(values, ops, graph.inputs, graph.outputs)
    moved = dataclasses.replace(moved, ops=tuple(dataclasses.replace(op, after=tuple(sorted(op.after)))
                                                 for op in moved.ops))
    moved.lint()
    return moved


@pytest.mark.parametrize("name", ["resnet", "inception", "nasnet", "transformer", "two_io"])
def test_any_emission_order_gives_the_one_canonical_order(name):
    specs = input_specs(["x".join(map(str, s)) for s in MODELS[name][1]])
    graph = rewrite(frontend.lower(frontend.load_module(SAMPLES / f"{name}.pt"), specs, name)).graph
    assert passes.order_canonically(graph) == graph  # already canonical after the rewrites
    for seed in range(3):
        other = shuffled(graph, seed)
        if seed == 0:
            assert [op.target for op in other.ops] != [op.target for op in graph.ops] or name == "two_io"
        assert passes.order_canonically(other) == graph


def schedules_from_both(tmp_path, module, example) -> dict:
    """{frontend: (ops, streams, stream per op, waits per op, op targets)} of `module` compiled from each."""
    script, program = tmp_path / "m.pt", tmp_path / "m.pt2"
    with torch.no_grad(), frontend.quiet_torchscript():
        torch.jit.save(torch.jit.trace(module, example, check_trace=False), str(script))
        torch.export.save(torch.export.export(module, example), str(program))
    specs = input_specs(["x".join(map(str, x.shape)) for x in example],
                        [str(x.dtype).removeprefix("torch.") for x in example])
    out = {}
    for kind, path, given in (("torchscript", script, specs), ("export", program, None)):
        c = compile_model(path, given, device="cpu", check=False)
        out[kind] = (len(c.graph.ops), c.schedule.num_streams, list(c.schedule.stream),
                     [tuple(w) for w in c.schedule.waits], [op.target for op in c.graph.ops])
    return out


def test_resnet18_gets_the_same_streams_and_waits_from_both_frontends(tmp_path):
    torch.manual_seed(0)
    both = schedules_from_both(tmp_path, ResNet18().eval(), (torch.randn(1, 3, 64, 64),))
    assert both["torchscript"] == both["export"]  # the same ops too: conv2d became convolution
    assert both["export"][1] > 1  # the shortcut convolutions run beside the blocks they skip


@pytest.mark.parametrize("name", sorted([*MODELS, *TOKEN_MODELS]))
def test_every_sample_gets_the_same_schedule_from_both_frontends(tmp_path, name):
    both = schedules_from_both(tmp_path, build_module(name), example_inputs(name))
    assert both["torchscript"][:4] == both["export"][:4]  # the ops themselves may differ (view or reshape)


def test_renumber_keeps_every_field_of_values_and_ops():
    """`renumber` builds values and ops with their constructors, positionally (faster than
    `replace` on a 12,000-op graph): a field added to either must be carried there too."""
    from nimble.ir import ACTIVATION, INPUT, Op, Ref, TensorSpec, Value

    assert [f.name for f in dataclasses.fields(Value)] == ["id", "kind", "spec", "name", "producer", "alias_of"]
    assert [f.name for f in dataclasses.fields(Op)] == ["id", "target", "args", "kwargs", "outputs", "mutates",
                                                          "after", "source"]
    spec = TensorSpec((2,), "float32")
    values = [Value(5, INPUT, spec, "x"), Value(7, ACTIVATION, spec, "y", producer=3),
              Value(9, ACTIVATION, spec, "z", producer=4, alias_of=7)]
    ops = [Op(3, "aten::relu.default", (Ref(5),), (), (7,), source="m.py:1"),
           Op(4, "aten::add_.Tensor", (Ref(7), (Ref(5), 2)), (("alpha", Ref(5)),), (9,), mutates=(7,), after=(3,),
              source="m.py:2")]
    g = renumber(values, ops, [5], [9])
    assert g.values == (Value(0, INPUT, spec, "x"), Value(1, ACTIVATION, spec, "y", producer=0),
                        Value(2, ACTIVATION, spec, "z", producer=1, alias_of=1))
    assert g.ops == (Op(0, "aten::relu.default", (Ref(0),), (), (1,), source="m.py:1"),
                     Op(1, "aten::add_.Tensor", (Ref(1), (Ref(0), 2)), (("alpha", Ref(0)),), (2,), mutates=(1,),
                        after=(0,), source="m.py:2"))
    assert g.inputs == (0,) and g.outputs == (2,)
