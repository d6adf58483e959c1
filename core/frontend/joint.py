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


@dataclass
class JointProgram:
    """A joint program traced in one pass (`_traced_once`): what `lower_joint` reads of an
    ExportedProgram (its graph, signature and tensors), nothing else."""

    graph: torch.fx.Graph
    graph_signature: torch.export.graph_signature.ExportGraphSignature
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]


def export_joint(module: torch.nn.Module, loss, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                 name: str, autocast: torch.dtype | None = None,
                 outputs: bool = False) -> torch.export.ExportedProgram | JointProgram:
    """The joint forward-backward program of `loss(module(*inputs), *targets)`, traced on these
    tensors (their values are not kept), under `torch.autocast` to `autocast` where given: the
    ops autocast lowers take their inputs cast from the float32 parameters, its float32 list stays
    float32, and the gradients come back float32. The module's buffers and the RNG are left as
    they were. `outputs`: the module's outputs come after the loss, as the step's outputs.

    Traced once by AOTAutograd on fake tensors where it can be (`_traced_once`): torch.export's
    own way traces the module, then traces the joint graph, then traces that again to drop its
    tangents (resnet50 at batch 32 on the 2-core builder: 1.7 + 4.3 s against 2.6 s), and
    AOTAutograd's export retraces its joint graph too, which nimble does not let it do
    (`_joint_not_retraced`: TrainStep's prepare of resnet50 3.2 to 4.8 s against 4.8 to 8.0 s,
    alternated, a noisy day on that builder). A module it cannot take so (a buffer under two
    names, a constant the graph reads that is not a plain tensor, or any failure) goes
    torch.export's way (`_exported`), which also names what fails. Tied parameters are refused:
    each name would get a gradient of its own (or, torch.export's way, none)."""
    wrapped = _WithLoss(module, loss, len(inputs), None if autocast is None else (inputs[0].device.type, autocast),
                        outputs)
    seen: dict[int, str] = {}
    for key, p in wrapped.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # torch's joint trace gives each name a gradient of its own, or none
            raise UnsupportedError(f"{name}: parameter '{key.removeprefix('module.')}' is the same tensor as "
                                   f"'{seen[id(p)].removeprefix('module.')}' (tied weights), which nimble's training "
                                   "step does not take; give each its own parameter, or train with torch.compile")
        seen[id(p)] = key
    try:
        with warnings.catch_warnings(), quiet_torch(), torch.random.fork_rng(devices=[]), buffers_kept(module), \
                attention_kernels(inputs[0].device):
            warnings.simplefilter("ignore")
            return _traced_once(wrapped, [*inputs, *targets]) or _exported(wrapped, [*inputs, *targets])
    except UsageError:
        raise
    except Exception as e:
        if "did not receive a gradient" in str(e):  # torch's joint trace takes no trainable parameter the loss misses
            raise UsageError(f"{name}: a parameter that requires grad gets no gradient from the loss; set "
                             "requires_grad=False on the parameters the loss does not reach (frozen or unused "
                             "layers)") from e
        raise UnsupportedError(f"{name}: torch.export could not trace its training step ({first_line(e)}); "
                               "prepare it with Nimble(module).prepare(x, training=True) instead") from e


def attention_kernels(device: torch.device):
    """Where a step on `device` traces `scaled_dot_product_attention`: on CUDA, as its memory-efficient
    kernel (`_scaled_dot_product_efficient_attention` and its backward, every result a tensor, for
    float32 and bfloat16 alike), or as plain ops where that kernel does not take the shapes, not as
    the flash or cuDNN kernels, whose results include sizes as numbers. Elsewhere as torch chooses
    (the CPU's flash kernel)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _exported(wrapped: _WithLoss, args: list[torch.Tensor]) -> torch.export.ExportedProgram:
    """The joint program torch.export's way: the module exported, then its joint graph traced (and
    traced again to drop its tangents)."""
    from torch.export.exported_program import _decompose_exported_program

    program = torch.export.export(wrapped, tuple(args))
    # torch.export.experimental._export_forward_backward, without its decompositions: batch norm's
    # backward, the activations' and the loss's stay whole ops (a faster prepare: mobilenet_v2's
    # joint trace took 3.3 s instead of 5.1 on a 2-core CPU, with half the nodes)
    try:
        return _decompose_exported_program(program, cia_to_decomp={}, python_decomp_table={},
                                           joint_loss_index=0, decompose_custom_triton_ops=False)
    except TypeError:  # a torch whose private signature differs: its public experimental call
        from torch.export.experimental import _export_forward_backward

        return _export_forward_backward(program, joint_loss_index=0)


def _traced_once(wrapped: _WithLoss, args: list[torch.Tensor]) -> JointProgram | None:
    """The joint program from one trace (`aot_export_module` on fake copies of the module's tensors
    and of `args`), or None where it cannot be had so: a tensor of the module under two names (the
    trace would give each name a gradient of its own), a constant the graph reads that is not a
    plain tensor (`_lifted_constants`), or any failure of the trace."""
    from torch._functorch.aot_autograd import aot_export_module
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export import graph_signature as gs
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.nn.utils.stateless import _reparametrize_module

    state = {**dict(wrapped.named_parameters(remove_duplicate=False)),
             **dict(wrapped.named_buffers(remove_duplicate=False))}
    if len({id(t) for t in state.values()}) != len(state):
        return None
    try:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        fake = {k: mode.from_tensor(t, static_shapes=True) for k, t in state.items()}
        fake_args = [mode.from_tensor(t, static_shapes=True) for t in args]
        with _reparametrize_module(wrapped, fake), mode, _joint_not_retraced():
            gm, sig = aot_export_module(wrapped, fake_args, trace_joint=True, output_loss_index=0, decompositions={})
    except UsageError:
        raise
    except Exception:
        return None
    constants = _lifted_constants(gm)
    if constants is None:
        return None
    gm.graph.eliminate_dead_code()  # as torch.export's way does (detaches nothing reads)
    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        arg = gs.TensorArgument(name=node.name)
        if node.name in constants:
            inputs.append(gs.InputSpec(gs.InputKind.CONSTANT_TENSOR, arg, node.name))
        elif node.name in sig.inputs_to_parameters:
            inputs.append(gs.InputSpec(gs.InputKind.PARAMETER, arg, sig.inputs_to_parameters[node.name]))
        elif node.name in sig.inputs_to_buffers:
            inputs.append(gs.InputSpec(gs.InputKind.BUFFER, arg, sig.inputs_to_buffers[node.name], persistent=True))
        else:
            inputs.append(gs.InputSpec(gs.InputKind.USER_INPUT, arg, None))
    # by position: the buffers' new values, the user outputs (the loss first: `_WithLoss`), the
    # gradients (the signature's loss_output names the first output of all, not the loss, in torch 2.13)
    leaves = torch.utils._pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    mutated, user, grads = len(sig.buffers_to_mutate), len(sig.user_outputs), sig.backward_signature.gradients_to_parameters
    if len(leaves) != mutated + user + len(grads) or not user:
        return None
    outputs = []
    for k, out in enumerate(leaves):
        arg = gs.TensorArgument(name=out.name)
        if k < mutated:
            outputs.append(gs.OutputSpec(gs.OutputKind.BUFFER_MUTATION, arg, sig.buffers_to_mutate[out.name]))
        elif k < mutated + user:
            outputs.append(gs.OutputSpec(gs.OutputKind.LOSS_OUTPUT if k == mutated else gs.OutputKind.USER_OUTPUT,
                                         arg, None))
        else:
            outputs.append(gs.OutputSpec(gs.OutputKind.GRADIENT_TO_PARAMETER, arg, grads[out.name]))
    return JointProgram(gm.graph, gs.ExportGraphSignature(inputs, outputs),
                        {k: t.detach() for k, t in state.items()}, constants)


def _lifted_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor] | None:
    """The tensors the traced graph reads as attributes (constants its forward made: the 0-d
    tensors that `mask[...] = k` lifts, 45 of them in swin_t's shifted windows), each made a
    placeholder ahead of the graph's own inputs, as torch.export lifts them, by the placeholder's
    name; None where one is not a plain tensor (so torch.export's way, which lifts them itself, runs:
    for swin_t a second trace of 12 s on the 2-core builder after this one's 6)."""
    from torch._subclasses.fake_tensor import FakeTensor

    reads = [n for n in gm.graph.nodes if n.op == "get_attr"]
    first = next((n for n in gm.graph.nodes if n.op != "get_attr"), None)
    constants: dict[str, torch.Tensor] = {}
    for node in reads:
        tensor = getattr(gm, str(node.target), None)
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, FakeTensor):
            return None
        with gm.graph.inserting_before(first):
            lifted = gm.graph.placeholder(f"lifted_{node.name}")
        node.replace_all_uses_with(lifted)
        gm.graph.erase_node(node)
        constants[lifted.name] = tensor.detach()
    return constants


@contextlib.contextmanager
def _joint_not_retraced():
    """Within: `aot_export_module(..., trace_joint=True)` takes its joint graph as traced, instead of
    tracing it a second time (with `make_fx`) only to drop the tangents and flatten the outputs:
    that retrace was 3.7 of resnet50's 10.7 s under cProfile (batch 32, 2-core builder). The same
    surgery is done on the FX graph (`_flattened`). Where torch's code is not as expected (the
    function it retraces holds no `fx_g` and `metadata`, or the graph's inputs and outputs do not
    add up), torch's own retrace runs. Patched for the call only: torch's `aot_autograd` module
    reads `make_fx` as a global."""
    import inspect

    import torch._functorch.aot_autograd as aot

    real = getattr(aot, "make_fx", None)
    if real is None:
        yield
        return

    def make_fx(fn, *args, **kwargs):
        try:
            held = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            held = {}
        fx_g, metadata = held.get("fx_g"), held.get("metadata")
        if not isinstance(fx_g, torch.fx.GraphModule) or metadata is None:
            return real(fn, *args, **kwargs)

        def build(*full_args):
            flat = _flattened(fx_g, metadata, full_args)
            return flat if flat is not None else real(fn, *args, **kwargs)(*full_args)
        return build

    aot.make_fx = make_fx
    try:
        yield
    finally:
        aot.make_fx = real


def _flattened(fx_g: torch.fx.GraphModule, metadata, full_args) -> torch.fx.GraphModule | None:
    """The joint graph `fx_g` (inputs: the primals, then tangents; outputs: the forward's, then a
    gradient per primal) as `aot_export_module`'s retrace leaves it: the primals alone as inputs
    (a tangent must be unused: the loss's is implicit), the forward's outputs, then the gradient
    of each primal that requires grad. None where the graph is not so (torch's retrace then runs,
    and raises its own errors: a parameter with no gradient, say)."""
    try:
        n_fw = metadata.num_outputs + metadata.num_mutated_inp_runtime_indices
    except AttributeError:
        return None
    nodes = list(fx_g.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1] if nodes and nodes[-1].op == "output" else None
    if output is None or len(placeholders) < len(full_args) or any(t.users for t in placeholders[len(full_args):]):
        return None
    leaves = torch.utils._pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
    fw, grads = leaves[:n_fw], leaves[n_fw:]
    if len(fw) != n_fw or len(grads) != len(full_args) or any(o is None for o in fw):
        return None
    kept = []
    for a, g in zip(full_args, grads):
        wants = isinstance(a, torch.Tensor) and a.requires_grad
        if wants != (g is not None):
            return None
        if wants:
            kept.append(g)
    graph = torch.fx.Graph()
    env = {}
    for n in nodes:
        if n.op == "placeholder":
            if len(env) < len(full_args):
                env[n] = graph.node_copy(n)
        elif n.op != "output":
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in fw + kept))
    return torch.fx.GraphModule(fx_g, graph)


class _JointLowering(_Lowering):
    def __init__(self, program: torch.export.ExportedProgram | JointProgram, name: str):
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


def lower_joint(program: torch.export.ExportedProgram | JointProgram, specs: list[TensorSpec], name: str) -> Joint:
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
