"""A training step as one graph: forward, loss and backward, from torch's own export for training
(`torch.export.export`, then its joint forward-backward decomposition), lowered through the same
builder as inference (`export._Lowering`).

The joint program's inputs are the module's parameters and buffers, then the step's inputs and
targets; its outputs are the buffers' new values (batch norm's running statistics), the loss, and
one gradient per parameter that needs one. Here the parameters and buffers become graph inputs,
not weights: they change every step, so nothing that reads them may fold on the host. Lifted
constants (a tensor the model builds in its forward) stay weights.

Batch norm comes in functional form (it returns its new running statistics), and the backward
ops stay whole as autograd records them (`convolution_backward`, `native_batch_norm_backward`,
`threshold_backward`...): no decomposition table is applied. The pointwise ops between them fuse
as at inference.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from ..errors import UnsupportedError, UsageError, first_line
from ..ir import TensorSpec
from ..ops import types
from .export import _Lowering
from .quiet import buffers_kept, quiet_torch
from .torchscript import Lowered

PARAMETER, BUFFER, DATA = "parameter", "buffer", "data"  # what a joint graph input is
BUFFER_UPDATE, LOSS, GRADIENT, OUTPUT = "buffer", "loss", "gradient", "output"  # what a joint graph output is


@dataclass(frozen=True)
class Role:
    """What one input or output of the joint graph stands for: its kind and, for a parameter or
    buffer (or its update or gradient), the module's qualified name of it."""

    kind: str
    target: str = ""


@dataclass
class Joint:
    lowered: Lowered
    inputs: list[Role]
    outputs: list[Role]


class _WithLoss(torch.nn.Module):
    """The module and its loss as one module that returns the loss, then (with `outputs`) the
    module's own outputs, detached: torch's joint trace takes no other output that needs a
    gradient."""

    def __init__(self, module: torch.nn.Module, loss, inputs: int, autocast: tuple[str, torch.dtype] | None,
                 outputs: bool = False):
        super().__init__()
        self.module, self.loss, self.inputs, self.autocast, self.outputs = module, loss, inputs, autocast, outputs

    def forward(self, *args):
        with torch.autocast(*self.autocast) if self.autocast else contextlib.nullcontext():
            # as a torch.autocast training loop runs it: the forward and the loss under autocast
            out = self.module(*args[:self.inputs])
            loss = self.loss(out, *args[self.inputs:])
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise UsageError(f"the loss function returned {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}; "
                             "it must return one scalar tensor")
        if not self.outputs:
            return (loss,)
        leaves = torch.utils._pytree.tree_leaves(out)
        if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
            raise UsageError("outputs=True needs a module that returns tensors (a tensor, or a tuple, list or dict "
                             "of them)")
        return (loss, *(t.detach() for t in leaves))


def export_joint(module: torch.nn.Module, loss, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                 name: str, autocast: torch.dtype | None = None, outputs: bool = False) -> torch.export.ExportedProgram:
    """The joint forward-backward program of `loss(module(*inputs), *targets)`, traced on these
    tensors (their values are not kept), under `torch.autocast` to `autocast` where given: the
    ops autocast lowers take their inputs cast from the float32 parameters, its float32 list stays
    float32, and the gradients come back float32. The module's buffers and the RNG are left as
    they were. `outputs`: the module's outputs come after the loss, as the step's outputs."""
    from torch.export.exported_program import _decompose_exported_program

    wrapped = _WithLoss(module, loss, len(inputs), None if autocast is None else (inputs[0].device.type, autocast),
                        outputs)
    try:
        with warnings.catch_warnings(), quiet_torch(), torch.random.fork_rng(devices=[]), buffers_kept(module):
            warnings.simplefilter("ignore")
            program = torch.export.export(wrapped, (*inputs, *targets))
            # torch.export.experimental._export_forward_backward, without its decompositions: batch norm's
            # backward, the activations' and the loss's stay whole ops (a faster prepare: mobilenet_v2's
            # joint trace took 3.3 s instead of 5.1 on a 2-core CPU, with half the nodes)
            try:
                return _decompose_exported_program(program, cia_to_decomp={}, python_decomp_table={},
                                                   joint_loss_index=0, decompose_custom_triton_ops=False)
            except TypeError:  # a torch whose private signature differs: its public experimental call
                from torch.export.experimental import _export_forward_backward

                return _export_forward_backward(program, joint_loss_index=0)
    except UsageError:
        raise
    except Exception as e:
        if "did not receive a gradient" in str(e):  # torch's joint trace takes no trainable parameter the loss misses
            raise UsageError(f"{name}: a parameter that requires grad gets no gradient from the loss; set "
                             "requires_grad=False on the parameters the loss does not reach (frozen or unused "
                             "layers)") from e
        raise UnsupportedError(f"{name}: torch.export could not trace its training step ({first_line(e)}); "
                               "prepare it with Nimble(module).prepare(x, training=True) instead") from e


class _JointLowering(_Lowering):
    def __init__(self, program: torch.export.ExportedProgram, name: str):
        super().__init__(program, name)
        self.builder.training = True  # random ops (dropout) stay ops of the step

    def _placeholder(self, node, spec, user, state):
        kind = spec.kind.name
        if kind not in ("PARAMETER", "BUFFER"):
            return super()._placeholder(node, spec, user, state)
        tensor = state.get(spec.target)
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedError(f"{self.name}: {kind.lower()} '{spec.target}' is not a tensor of the module")
        if not tensor.is_contiguous():
            raise UnsupportedError(f"{self.name}: {kind.lower()} '{spec.target}' is not contiguous; make the module's "
                                   "tensors contiguous before preparing its training step")
        return self.builder.add_input(node.name, TensorSpec(tuple(tensor.shape), types.dtype_name(tensor.dtype)))

    def _outputs(self, node) -> list[int]:
        return self._output_ids(node)  # every kind the joint program returns: `lower_joint` names them


_INPUT_ROLES = {"PARAMETER": PARAMETER, "BUFFER": BUFFER, "USER_INPUT": DATA}
_OUTPUT_ROLES = {"BUFFER_MUTATION": BUFFER_UPDATE, "LOSS_OUTPUT": LOSS, "GRADIENT_TO_PARAMETER": GRADIENT,
                 "USER_OUTPUT": OUTPUT}


def lower_joint(program: torch.export.ExportedProgram, specs: list[TensorSpec], name: str) -> Joint:
    """The joint program as an IR graph, with the role of each of its inputs and outputs."""
    sig = program.graph_signature
    inputs, outputs = [], []
    for s in sig.input_specs:
        if s.kind.name in _INPUT_ROLES:
            inputs.append(Role(_INPUT_ROLES[s.kind.name], s.target or ""))
        elif s.kind.name != "CONSTANT_TENSOR":
            raise UnsupportedError(f"{name}: its training step takes a {s.kind.name.lower()} input, which nimble "
                                   "does not take")
    for s in sig.output_specs:
        if s.kind.name not in _OUTPUT_ROLES:
            raise UnsupportedError(f"{name}: its training step returns a {s.kind.name.lower()} ({s.target or s.arg}), "
                                   "which nimble does not take; return the loss alone")
        outputs.append(Role(_OUTPUT_ROLES[s.kind.name], s.target or ""))
    with torch.no_grad():
        graph, weights = _JointLowering(program, name).run(specs)
    return Joint(Lowered(graph, weights, None), inputs, outputs)
