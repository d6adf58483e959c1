"""The graph editor the passes share (`passes/edit.py`): new values and ops numbered and placed
for the pass, uses replaced, and a graph that lints; no change, the same graph."""

from nimble.ir import ACTIVATION, INPUT, Graph, Op, Ref, TensorSpec, Value
from nimble.passes.edit import Edit

SPEC = TensorSpec((4,), "float32")


def _chain() -> Graph:
    """x -> relu -> y -> neg -> z"""
    values = (Value(0, INPUT, SPEC, "x"), Value(1, ACTIVATION, SPEC, "y", 0), Value(2, ACTIVATION, SPEC, "z", 1))
    ops = (Op(0, "aten::relu.default", (Ref(0),), (), (1,)), Op(1, "aten::neg.default", (Ref(1),), (), (2,)))
    return Graph(values, ops, (0,), (2,))


def test_no_change_is_the_same_graph():
    g = _chain()
    assert Edit(g).finish() is g


def test_an_op_inserted_before_a_reader_and_its_uses_replaced():
    g = _chain()
    edit = Edit(g)
    doubled = edit.value(ACTIVATION, SPEC, "y_doubled", before=2)
    edit.insert_before(1, edit.op("aten::mul.Tensor", (Ref(1), 2.0), (), (doubled,), "model.py:3"))
    reader = g.ops[1]
    out = edit.finish([g.ops[0], Op(reader.id, reader.target, (Ref(doubled.id),), (), reader.outputs)])
    out.lint()
    assert [op.target for op in out.ops] == ["aten::relu.default", "aten::mul.Tensor", "aten::neg.default"]
    assert [v.name for v in out.values] == ["x", "y", "y_doubled", "z"]  # placed before z
    mul = out.ops[1]
    assert out.values[mul.outputs[0]].producer == mul.id and out.ops[2].args == (Ref(mul.outputs[0]),)


def test_replaced_uses_reach_the_outputs_and_dropped_values_go():
    g = _chain()
    edit = Edit(g)
    edit.replace_uses(2, 1)  # z is y: the neg goes
    out = edit.finish([g.ops[0]])
    out.lint()
    assert [v.name for v in out.values] == ["x", "y"] and out.outputs == (1,)
