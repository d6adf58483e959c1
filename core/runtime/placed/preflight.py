"""Every value checked against its plan before any op touches real memory.

An artifact declares, for every value, its shape, dtype, strides, storage offset and the buffer
whose storage it shares; the memory plan gives each buffer its bytes. `preflight` runs the whole
op list on the meta device (shapes and strides only, no data) over stand-ins laid out exactly as
the runtime lays out the real tensors, and refuses, with one line naming the op:

- any op whose result differs from its declared spec in shape, dtype, strides or storage
  offset, or that returns a different number of results;
- any result declared as a view or in-place result of a buffer that is not a view of that
  buffer's storage, and any fresh result declared as a view;
- any value whose extent (storage offset plus the bytes its strides span) exceeds its root
  buffer: the planned buffer of an activation, the tensor itself for an input or a weight.

An op that the runtime would then run can only compute its declared result, inside its declared
buffers. Common ops are typed by their shape rules (`ops/shapes.py`), since most meta kernels are
Python and slow. The others run their meta kernels; some of those would import torch._dynamo on
their first call, only to mark themselves as not to be traced (seconds on a GPU machine):
`shapes.without_dynamo_import` spares that for the length of the check and leaves no trace afterwards.
"""

from __future__ import annotations

import torch

from ...errors import ArtifactError, first_line
from ...ir import ACTIVATION, Graph, TensorSpec, contiguous_strides
from ...ops import arguments, interpret, shapes, types
from ...ops.execute import Executor, run_ops
from ...plan.memory import MemoryPlan

_META = torch.device("meta")


def preflight(graph: Graph, memory: MemoryPlan, name: str = "artifact") -> None:
    """Raise ArtifactError on the first value that breaks its plan; see the module docstring."""
    from nimble.formats.artifact import paused_gc

    with shapes.without_dynamo_import(), paused_gc():
        _check(graph, memory, name)


def _check(graph: Graph, memory: MemoryPlan, name: str) -> None:
    capacity: dict[int, int] = {}  # root value -> bytes of its storage at run time
    env: dict[int, torch.Tensor] = {}
    for v in graph.values:
        if v.kind != ACTIVATION:  # the runtime binds these as contiguous tensors of their shape
            env[v.id] = torch.empty(v.spec.shape, dtype=types.DTYPES[v.spec.dtype], device=_META)
            capacity[v.id] = v.spec.numel * env[v.id].element_size()
        elif v.alias_of is None:
            capacity[v.id] = memory.size[v.id]
    for v in graph.values:
        root = graph.root(v.id)
        if v.spec.storage_nbytes > capacity[root]:
            raise ArtifactError(f"{name}: value {v.id} ('{v.name}') spans {v.spec.storage_nbytes} bytes of a "
                                f"{capacity[root]}-byte buffer")
    run_ops(graph.ops, _Preflight(graph, env, capacity, name))


class _Preflight(Executor):
    """Each op on the meta device over stand-ins laid out as the runtime lays out real tensors;
    each result checked against its declared spec and buffer before it is bound."""

    def __init__(self, graph: Graph, env: dict[int, torch.Tensor], capacity: dict[int, int], name: str):
        self.graph, self.env, self.capacity, self.name = graph, env, capacity, name
        self.buffers: dict[int, torch.Tensor] = {}  # root activation -> meta storage of its planned size

    def arguments(self, op):
        return arguments.op_arguments(op, self.env, _META)

    def call(self, op, args, kwargs):
        return arguments.flatten_result(_run(op.target, args, kwargs))

    def failed(self, op, error):
        return ArtifactError(f"{self.name}: op {op.id} ({op.target}) rejects its declared inputs: {first_line(error)}")

    def bind(self, op, results):
        graph, env, where = self.graph, self.env, f"{self.name}: op {op.id} ({op.target})"
        if len(results) != len(op.outputs) or not all(isinstance(t, torch.Tensor) for t in results):
            raise ArtifactError(f"{where} returns {len(results)} results, the graph declares {len(op.outputs)}")
        for vid, t in zip(op.outputs, results):
            v = graph.values[vid]
            got = TensorSpec(tuple(t.shape), types.dtype_name(t.dtype), tuple(t.stride()), t.storage_offset())
            if (got.shape, got.dtype, got.offset) != (v.spec.shape, v.spec.dtype, v.spec.offset) \
                    or _strides(got) != _strides(v.spec):
                raise ArtifactError(f"{where} computes {got.dtype}{list(got.shape)} (strides {list(got.strides)}, "
                                    f"offset {got.offset}) but value {vid} is declared "
                                    f"{v.spec.dtype}{list(v.spec.shape)} (strides {list(_strides(v.spec))}, "
                                    f"offset {v.spec.offset})")
            if v.alias_of is None:
                if any(t.untyped_storage()._cdata == env[r].untyped_storage()._cdata for r in op.refs()):
                    raise ArtifactError(f"{where}: value {vid} is a view of an input but is declared as a buffer "
                                        "of its own")
                storage = torch.empty(self.capacity[vid], dtype=torch.uint8, device=_META)
                self.buffers[vid] = storage
                env[vid] = storage.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset()) \
                    if self.capacity[vid] % t.element_size() == 0 else t
            else:
                base = self.buffers.get(v.alias_of, env.get(v.alias_of))
                if base is None or t.untyped_storage()._cdata != base.untyped_storage()._cdata:
                    raise ArtifactError(f"{where}: value {vid} is declared a view of value {v.alias_of}, "
                                        "but the op does not return one")
                env[vid] = t


def _strides(spec: TensorSpec) -> tuple[int | None, ...]:
    """Strides where they matter: a dimension of size 0 or 1 never steps."""
    return tuple(s if n > 1 else None for n, s in zip(spec.shape, spec.strides or contiguous_strides(spec.shape)))


def _run(target: str, args: list, kwargs: dict):
    inferred = shapes.infer(target, args, kwargs)
    return inferred if inferred is not None else interpret.function_of(target)(*args, **kwargs)
