"""Building cuDNN plans with nvidia-cudnn-frontend (the `cudnn` extra): a fused body's epilogue as
cuDNN pointwise operations (`epilogue`), and the first plans cuDNN ranks for a convolution and
that epilogue, built (`ranked`). Which plan runs, if any, is `cudnn_graph.py`'s choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import settings

RESIDUAL = (("add", ()), ("relu", ()))  # the one chain runtime-compiled engines are tried for

_UNTRIED = object()
_module = _UNTRIED
_handles: dict[int, object] = {}
_kernel_cache = None  # the runtime-compiled kernels, shared by the process


def frontend():
    """The `cudnn` module of nvidia-cudnn-frontend, or None where it is missing or cannot load."""
    global _module
    if _module is _UNTRIED:
        try:
            import cudnn
            _module = cudnn if hasattr(cudnn, "pygraph") else None
        except Exception:  # not installed, or no cuDNN library it can open
            _module = None
    return _module


# fused-body node -> the cuDNN pointwise operation and its fixed arguments (see `epilogue`)
_UNARY = {
    "aten::relu.default": ("relu", {}),
    "aten::relu6.default": ("relu", {"lower_clip": 0.0, "upper_clip": 6.0}),
    "aten::silu.default": ("swish", {"swish_beta": 1.0}),
    "aten::sigmoid.default": ("sigmoid", {}),
    "aten::tanh.default": ("tanh", {}),
}
_BINARY = {"aten::add.Tensor": "add", "aten::mul.Tensor": "mul"}


def epilogue(body, out: torch.Tensor) -> tuple[tuple, list[torch.Tensor]] | None:
    """The nodes after a fused body's convolution as cuDNN pointwise steps, or None where one is
    not a chain cuDNN can take: each node reads the one before it (`Local(k - 1)`) and at most one
    tensor of the result's dtype that broadcasts to it. Steps are (operation, keyword arguments);
    "add" and "mul" read the next of the returned tensors, each viewed as 4-D."""
    from ...ir import Local

    steps, tensors = [], []
    for k, (target, args, kwargs) in enumerate(body[1:], start=1):
        kw = dict(kwargs)
        if target in _UNARY and args[0] == Local(k - 1) and not kw:
            name, params = _UNARY[target]
            steps.append((name, tuple(params.items())))
        elif target == "aten::hardtanh.default" and args[0] == Local(k - 1) and len(args) == 3 \
                and all(isinstance(a, (int, float)) for a in args[1:]):
            steps.append(("relu", (("lower_clip", float(args[1])), ("upper_clip", float(args[2])))))
        elif target == "aten::gelu.default" and args[0] == Local(k - 1) and kw.get("approximate", "none") \
                in ("none", "tanh"):
            steps.append(("gelu" if kw.get("approximate", "none") == "none" else "gelu_approx_tanh", ()))
        elif target in _BINARY and len(args) == 2 and Local(k - 1) in args and kw.get("alpha", 1) == 1:
            t = args[1] if args[0] == Local(k - 1) else args[0]
            if not isinstance(t, torch.Tensor) or t.dtype != out.dtype or t.dim() > 4 or t.device != out.device:
                return None
            t = t[(None,) * (4 - t.dim())]
            if any(a not in (1, b) for a, b in zip(t.shape, out.shape)):
                return None
            steps.append((_BINARY[target], ()))
            tensors.append(t)
        else:
            return None
    return tuple(steps), tensors


@dataclass
class Plan:
    """One built plan of one operation graph; the tensors are the graph's, in call order."""

    graph: object
    tensors: tuple  # x, w, bias or None, one per tensor the epilogue reads, y
    index: int
    workspace_bytes: int
    name: str

    def run(self, operands: tuple, out: torch.Tensor, workspace: torch.Tensor) -> None:
        cudnn = frontend()
        made = handle(out.device)
        cudnn.set_stream(handle=made, stream=torch.cuda.current_stream(out.device).cuda_stream)
        pack = {t: a for t, a in zip(self.tensors, (*operands, out)) if t is not None}
        self.graph.execute_plan_at_index(pack, workspace, self.index, handle=made)


def ranked(p: dict, steps: tuple, operands: tuple, out: torch.Tensor, name: str | None = None) -> list[Plan]:
    """The first plans cuDNN ranks among its precompiled engines, else (for RESIDUAL) among its
    runtime-compiled ones; only the one called `name`, where given."""
    return _plans(p, steps, operands, out, False, name) or \
        (_plans(p, steps, operands, out, True, name) if steps == RESIDUAL else [])


def _plans(p: dict, steps: tuple, operands: tuple, out: torch.Tensor, compiled: bool,
           name: str | None) -> list[Plan]:
    """The first plans cuDNN ranks for this graph, built: among its precompiled engines, or
    (`compiled`) its runtime-compiled ones through the process's kernel cache. Empty where cuDNN
    has none."""
    cudnn = frontend()
    global _kernel_cache
    if compiled and _kernel_cache is None:
        _kernel_cache = cudnn.create_kernel_cache()
    x, w, bias, *tensors = operands
    kind = _data_type(cudnn, x.dtype)
    try:
        g = cudnn.pygraph(io_data_type=kind, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle(x.device),
                          **({"kernel_cache": _kernel_cache} if compiled else {}))
        tx, tw = (g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=kind)
                  for n, t in (("x", x), ("w", w)))
        y = g.conv_fprop(image=tx, weight=tw, padding=list(p["padding"]), stride=list(p["stride"]),
                         dilation=list(p["dilation"]), compute_data_type=cudnn.data_type.FLOAT)
        tb = None
        if bias is not None:
            tb = g.tensor(name="b", dim=[1, bias.numel(), 1, 1], stride=[bias.numel(), 1, 1, 1], data_type=kind)
            y = g.bias(input=y, bias=tb)
        read = iter(tensors)
        graph_tensors = []
        for operation, params in steps:
            if operation in ("add", "mul"):
                t = next(read)
                graph_tensors.append(g.tensor(name=f"t{len(graph_tensors)}", dim=list(t.shape),
                                              stride=list(t.stride()), data_type=kind))
                y = getattr(g, operation)(a=y, b=graph_tensors[-1], compute_data_type=cudnn.data_type.FLOAT)
            else:
                y = getattr(g, operation)(input=y, compute_data_type=cudnn.data_type.FLOAT, **dict(params))
        y.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(kind)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if x.dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])  # TF32, which PyTorch is told not to use
        if not compiled:
            g.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
        g.check_support()
        count = g.get_execution_plan_count()
    except Exception:  # no engine supports this graph
        return []
    plans = []
    for i in range(min(count, settings.current().cudnn_compiled_plans if compiled else settings.current().cudnn_plans)):
        try:
            if name is not None and g.get_plan_name_at_index(i) != name:
                continue
            g.build_plan_at_index(i)
            size = g.get_workspace_size_plan_at_index(i)
        except Exception:
            continue
        if size <= settings.current().cudnn_max_workspace:
            plans.append(Plan(g, (tx, tw, tb, *graph_tensors, y), i, size, g.get_plan_name_at_index(i)))
    return plans


def handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = frontend().create_handle()
    return _handles[index]


def _data_type(cudnn, dtype: torch.dtype):
    return {torch.float32: cudnn.data_type.FLOAT, torch.float16: cudnn.data_type.HALF,
            torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]
