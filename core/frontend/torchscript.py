"""TorchScript archive + static input specs -> IR `Graph` plus its weights.

The module is loaded on the CPU, frozen, inlined and stripped of mutation; then its graph is
walked once in program order. Host-side work (sizes, ints, lists, tuples, `prim::If` on known
conditions, loops with known trip counts) is evaluated on the spot. Every remaining node is a
device task: it becomes an `Op`, and its outputs get shapes, dtypes and alias roots by running it
on the meta device.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelError, UnsupportedError, first_line
from ..ir import Graph, TensorSpec
from ..ops import shapes
from .finalize import finalize
from .walker import Walker, source_of  # noqa: F401  (source_of is part of the API)

@dataclass(frozen=True)
class Lowered:
    graph: Graph
    weights: dict[str, torch.Tensor]  # weight value name -> CPU tensor
    module: torch.jit.ScriptModule  # the frozen module, for reference outputs


@contextlib.contextmanager
def quiet_torchscript():
    """TorchScript is deprecated and warns on every call (a DeprecationWarning up to torch 2.13, a
    FutureWarning in 2.14); silence that, whatever its category, here and only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*")
        yield


def load_module(path: str | os.PathLike) -> torch.jit.ScriptModule:
    """Load a TorchScript archive on the CPU, in eval mode; one-line ModelError on any defect."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file; pass a TorchScript model saved with torch.jit.save")
    if not path.is_file():
        raise ModelError(f"{path} is not a file; pass a TorchScript model saved with torch.jit.save")
    hint = ("save it with torch.jit.save(torch.jit.script(model), path) "
            "or torch.jit.save(torch.jit.trace(model, example), path)")
    if not zipfile.is_zipfile(path):
        raise ModelError(f"{path} is not a TorchScript archive (not a zip file); {hint}")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    if not any("/code/" in n or n.startswith("code/") for n in names):
        raise ModelError(f"{path} is a torch.save checkpoint (state_dict or pickled module), "
                         f"not TorchScript; {hint}")
    try:
        with quiet_torchscript():
            module = torch.jit.load(str(path), map_location="cpu")
    except Exception as e:  # torch raises RuntimeError, ValueError, pickle errors...
        raise ModelError(f"{path} could not be loaded as TorchScript ({first_line(e)}); {hint}") from e
    return module.eval()


def lower(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str = "model") -> Lowered:
    """Freeze `module` and lower its forward for these static input specs."""
    with quiet_torchscript(), torch.no_grad():
        try:
            frozen = torch.jit.freeze(module.eval())
        except Exception as e:
            raise UnsupportedError(f"{name}: torch.jit.freeze failed ({first_line(e)})") from e
        return Lowered(*_walk(frozen, inputs, name, training=False), frozen)


def lower_training(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str = "model") -> Lowered:
    """Lower `module`'s training-mode forward without freezing it: its parameters and buffers
    become weights named by their qualified names, which the caller binds to the live tensors."""
    with quiet_torchscript(), torch.no_grad():
        graph, weights = _walk(module, inputs, name, training=True)
    return Lowered(graph, weights, module)


def _walk(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str, training: bool):
    graph = module.graph.copy()
    torch._C._jit_pass_inline(graph)
    torch._C._jit_pass_remove_mutation(graph)
    walker = Walker(name, training)
    if training:
        walker.bind_module(graph, module)
    walker.bind_inputs(graph, inputs)
    with shapes.without_dynamo_import():  # meta kernels without a shape rule, on their first call
        walker.block(graph.block())
    outputs = walker.graph_outputs(graph)
    return finalize(walker.values, walker.ops, walker.inputs, outputs, walker.weights)
