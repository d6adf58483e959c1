"""TorchScript archive + static input specs -> IR `Graph` plus its weights.

The module is loaded on the CPU; its forward is inlined, its attributes become constants (see
`frozen_graph`), and it is stripped of mutation; then its graph is walked once in program order.
Host-side work (sizes, ints, lists, tuples, `prim::If` on known
conditions, loops with known trip counts) is evaluated on the spot. Every remaining node is a
device task: it becomes an `Op`, and its outputs get shapes, dtypes and alias roots by running it
on the meta device.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelError, UnsupportedError, first_line
from ..ir import Graph, TensorSpec
from ..ops import shapes
from .finalize import finalize
from ..model_files import SAVE_HINT, check_model_file
from .walker import Walker, source_of  # noqa: F401  (source_of is part of the API)

@dataclass(frozen=True)
class Lowered:
    graph: Graph
    weights: dict[str, torch.Tensor]  # weight value name -> CPU tensor
    module: torch.jit.ScriptModule  # the module in eval mode, for reference outputs


@contextlib.contextmanager
def quiet_torchscript():
    """TorchScript is deprecated and warns on every call (a DeprecationWarning up to torch 2.13, a
    FutureWarning in 2.14); silence that, whatever its category, here and only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r".*(TorchScript|torch\.jit).*")
        yield


def load_module(path: str | os.PathLike, names: frozenset[str] | None = None) -> torch.jit.ScriptModule:
    """Load a TorchScript archive on the CPU, in eval mode; one-line ModelError on any defect.
    `names`: its members, where `check_model_file` read them already."""
    path = Path(path)
    if names is None:
        names = check_model_file(path)
    hint = SAVE_HINT
    if names is None:
        raise ModelError(f"{path} is neither a torch.export program nor a TorchScript archive (not a zip file); "
                         f"{hint}")
    if not any("/code/" in n or n.startswith("code/") for n in names):
        raise ModelError(f"{path} is a torch.save checkpoint (a state_dict or a pickled module), not a saved "
                         f"program; {hint}")
    for attempt in range(2):
        try:
            with quiet_torchscript():
                module = torch.jit.load(str(path), map_location="cpu")
            return module.eval()
        except Exception as e:  # torch raises RuntimeError, ValueError, pickle errors...
            op = _UNKNOWN_OP.search(str(e))
            if op is None or attempt:
                raise ModelError(f"{path} could not be loaded as TorchScript ({first_line(e)}); {hint}") from e
            _import_operator_library(path, op.group(1), op.group(0).split(": ")[-1])


_UNKNOWN_OP = re.compile(r"Unknown builtin op: (\w+)::\w+")
_OPERATOR_LIBRARIES = {"torchvision": "torchvision", "torchaudio": "torchaudio"}  # op namespace -> package


def _import_operator_library(path: Path, namespace: str, op: str) -> None:
    """A model that calls a library's operators (torchvision::nms in a traced detection model)
    loads once that library is imported, as it is in the process that saved the model."""
    package = _OPERATOR_LIBRARIES.get(namespace)
    if package is None:
        raise ModelError(f"{path} calls {op}, an operator that no library nimble knows defines; nimble "
                         "supports aten operators (and loads torchvision's and torchaudio's)")
    try:
        importlib.import_module(package)
    except Exception as e:
        raise ModelError(f"{path} calls {op}, which {package} defines, but {package} could not be imported "
                         f"({first_line(e)}); install the {package} that pairs with torch "
                         f"{torch.__version__.split('+')[0]}") from None


def lower(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str = "model") -> Lowered:
    """Lower `module`'s inference forward, its attributes read as constants, for these static
    input specs."""
    with quiet_torchscript(), torch.no_grad():
        module = module.eval()
        try:
            graph = frozen_graph(module)
        except Exception as e:
            raise UnsupportedError(f"{name}: its forward could not be inlined and frozen ({first_line(e)})") from e
        return Lowered(*_walk(module, graph, inputs, name, training=False), module)


def frozen_graph(module: torch.jit.ScriptModule) -> torch._C.Graph:
    """`module`'s forward as torch.jit.freeze would leave it, without `torch.jit.freeze`, whose
    attribute propagation grows faster than n^2 in the number of submodules (41 s at 12,000 ops).

    The forward is inlined, and every `prim::GetAttr` chain from `self` that ends in a plain
    value (an int, a bool: `self.training`) becomes a constant; then the clean-ups freezing runs
    (dead code, common subexpressions, peephole, constant propagation and pooling) resolve the
    branches on them. Only then do tensor attributes become constants, since those clean-ups
    compare tensor constants pairwise. Last come torch's own frozen-graph optimizations: dropout
    removal, concatenation of linears that share an input, and folding of batch norm, add, sub,
    mul and div into the convolution or linear before them. Attributes of other kinds (objects,
    say) stay `prim::GetAttr`, which the walker reads from the module."""
    graph = module.graph.copy()
    torch._C._jit_pass_inline(graph)
    _attributes_to_constants(graph, module, tensors=False)
    for cleanup in (torch._C._jit_pass_dce, torch._C._jit_pass_cse, torch._C._jit_pass_peephole,
                    torch._C._jit_pass_constant_propagation, torch._C._jit_pass_constant_pooling,
                    torch._C._jit_pass_dce):
        cleanup(graph)
    _attributes_to_constants(graph, module, tensors=True)
    torch._C._jit_pass_constant_propagation(graph)
    torch._C._jit_pass_dce(graph)
    if any(graph.findNode(kind) is not None for kind in _FOLDS_INTO):  # else nothing to fold
        torch._C._jit_pass_optimize_frozen_graph(graph, True)
        _name_folded_biases(graph)
    return graph


def _attributes_to_constants(graph: torch._C.Graph, module: torch.jit.ScriptModule, tensors: bool) -> None:
    """Replace each attribute read of `module` (tensors, or else plain values) with one constant
    per attribute at the top of the graph; a tensor constant is named after its attribute."""
    owners = {next(graph.inputs()).unique(): module._c}
    constants: dict[str, torch._C.Value] = {}
    top = next(iter(graph.nodes()), None)
    if top is None:
        return
    with graph.insert_point_guard(top):  # once: entering the guard costs time that grows with the graph
        for node in graph.findAllNodes("prim::GetAttr", True):  # in program order, blocks included
            if node.input().unique() not in owners:
                continue
            value = owners[node.input().unique()].getattr(node.s("name"))
            if isinstance(value, torch._C.ScriptModule):
                owners[node.output().unique()] = value
                continue
            if isinstance(value, torch.Tensor) != tensors:
                continue
            name = _attribute_name(node)
            if name not in constants:
                try:
                    constants[name] = graph.insertConstant(value.detach() if tensors else value)
                except RuntimeError:  # not a constant kind: the walker reads it
                    continue
                if tensors:
                    constants[name].setDebugName(name)
            node.output().replaceAllUsesWith(constants[name])


# The layers that torch's frozen-graph optimizations fold batch norm and arithmetic into.
_FOLDS_INTO = ("aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::_convolution", "aten::linear")


def _name_folded_biases(graph: torch._C.Graph) -> None:
    """A bias that folding created where the layer had none takes its name from the layer's
    weight ('conv1.bias_fused_bn' beside 'conv1.weight_fused_bn'), as under torch.jit.freeze."""
    for node in graph.nodes():
        if node.kind() not in _FOLDS_INTO:
            continue
        inputs = list(node.inputs())
        weight, bias = inputs[1], inputs[2]
        if bias.node().kind() == "prim::Constant" and bias.debugName()[:1].isdigit() and "weight" in weight.debugName():
            bias.setDebugName(weight.debugName().replace("weight", "bias", 1))


def _attribute_name(node) -> str:
    """'layer1.0.conv1.weight' for the chain of `prim::GetAttr` reads that ends at `node`."""
    names = []
    while node.kind() == "prim::GetAttr":
        names.append(node.s("name"))
        node = node.input().node()
    return ".".join(reversed(names))


def lower_training(module: torch.jit.ScriptModule, inputs: list[TensorSpec], name: str = "model") -> Lowered:
    """Lower `module`'s training-mode forward without freezing it: its parameters and buffers
    become weights named by their qualified names, which the caller binds to the live tensors."""
    with quiet_torchscript(), torch.no_grad():
        graph = module.graph.copy()
        torch._C._jit_pass_inline(graph)
        graph, weights = _walk(module, graph, inputs, name, training=True)
    return Lowered(graph, weights, module)


def _walk(module: torch.jit.ScriptModule, graph: torch._C.Graph, inputs: list[TensorSpec], name: str,
          training: bool):
    torch._C._jit_pass_remove_mutation(graph)
    walker = Walker(name, training)
    walker.bind_module(graph, module)
    walker.bind_inputs(graph, inputs)
    with shapes.without_dynamo_import():  # meta kernels without a shape rule, on their first call
        walker.block(graph.block())
    outputs = walker.graph_outputs(graph)
    built = walker.builder
    return finalize(built.values, built.ops, built.inputs, outputs, built.weights)
