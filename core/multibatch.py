"""A multi-batch artifact's compilation (`nimble compile --batch-sizes`): one compilation per
batch size, each checked against the model row by row, their weights made the same where they
differ only by constants shaped by the batch, and the graphs proved to be one program
(`ops/batches.py`). `pipeline.compile_model` calls `compile_batches` with a function that
compiles one batch size; a member is a `pipeline.Compiled`."""

from __future__ import annotations

import torch

from . import frontend
from .errors import MismatchError, UnsupportedError
from .ir import TensorSpec
from .ops import arguments, batches, rows, types
from .runtime.base.compare import compare, default_tolerance
from .runtime.placed.reference import one_thread
from .specs import with_batch
from .stages import Stages


def compile_batches(compile_one, inputs: list[TensorSpec], batch_sizes: list[int], model: str,
                    stages: Stages, reference):
    """One compilation per batch size (the first dimension of every input), smallest first, the
    larger ones in its `others`; `reference(*xs)` runs the model. The model must give each row's
    outputs from that row alone, because a call at a batch size between two compiled ones runs the
    larger, padded with zero rows, and a server packs clients' rows into one call: each larger
    batch size is checked on rows that differ (`batches.distinct_rows`), each row against the
    model run on that row alone, and on the smallest one's sample padded with zero rows; then
    `batches.check_batches` proves it of the graphs. They must read the same weights: where they
    differ only by constants shaped by the batch (one row repeated), it compiles them all again
    with those as one row expanded (`passes.batch_constants`); `compile_one(specs, samples,
    stages, batch_rows)` compiles one."""
    batch_rows: frozenset[str] = frozenset()
    while True:
        try:
            return _compile_members(compile_one, inputs, batch_sizes, model, stages, reference, batch_rows)
        except _BatchShaped as e:
            if e.names <= batch_rows:  # made rows already, and still shaped by the batch: a bug, said plainly
                raise UnsupportedError(f"{model}: weights {sorted(e.names)[:3]} stay shaped by the batch; compile "
                                       "one batch size per artifact") from None
            batch_rows |= e.names
            stages.passes.clear()  # the passes the artifact records are those of the compile that is kept
            stages.progress(f"constants shaped by the batch ({', '.join(sorted(e.names)[:3])}): compiling again "
                            "with each as one row")


class _BatchShaped(Exception):
    def __init__(self, names: frozenset[str]):
        super().__init__(", ".join(sorted(names)))
        self.names = names


def _compile_members(compile_one, inputs: list[TensorSpec], batch_sizes: list[int], model: str, stages: Stages,
                     reference, batch_rows: frozenset[str]):
    first, *rest = batch_sizes
    progress = stages.progress
    main = compile_one(with_batch(inputs, first, model), None, stages, batch_rows)
    for b in rest:
        st = Stages(lambda stage, b=b: progress(f"batch {b}: {stage}"))
        samples = [x.to(types.DTYPES[spec.dtype]) for x, spec in zip(batches.distinct_rows(main.sample_inputs, b), inputs)]
        other = compile_one(with_batch(inputs, b, model), samples, st, batch_rows)
        with frontend.quiet_torchscript(), torch.no_grad(), one_thread():
            alone = batches.each_row_alone(lambda *xs: [y.cpu() for y in arguments.flatten_result(reference(*xs))],
                                           samples, first)
            padded = [torch.cat([x, x.new_zeros((b - first, *x.shape[1:]))]) for x in main.sample_inputs]
            got_padded = [y.cpu()[:first] for y in arguments.flatten_result(reference(*padded))]
        for k, (got, got_pad, want) in enumerate(zip(other.sample_outputs, got_padded, main.sample_outputs)):
            # outputs stored in a reduced dtype are the model's rounded: one rounding step apart at most
            tolerance = default_tolerance("cpu") if want.dtype not in (torch.float16, torch.bfloat16) else (1e-2, 1e-2)
            result = compare([got.float(), got_pad.float()], [alone[k].float(), want.float()], *tolerance)
            if not result.passed:
                raise MismatchError(f"{model}: at batch {b}, output {k} is not each row's output computed alone "
                                    f"({result.describe()}): the model mixes the rows of a batch, so a padded call "
                                    "would change its results; compile one batch size per artifact")
        if shaped := _batch_shaped(main, other, first, b):
            raise _BatchShaped(shaped)
        if why := _other_weights(main, other):
            raise UnsupportedError(f"{model}: at batch {b} the compiled graph reads other weights than at batch "
                                   f"{first} ({why}); compile one batch size per artifact")
        for key, secs in st.seconds.items():
            main.seconds[key] = main.seconds.get(key, 0.0) + secs
        main.others.append(other)
    try:
        batches.check_batches({first: main.graph, **{b: o.graph for b, o in zip(rest, main.others)}})
    except rows.RowsError as e:
        raise UnsupportedError(f"{model}: {e}; compile one batch size per artifact") from None
    return main


def _batch_shaped(main, other, first: int, b: int) -> frozenset[str]:
    """The weights that differ between two batch sizes only as one row repeated to each (a
    constant shaped by the batch), where every weight that differs is one; else empty."""
    shaped, differ = set(), False
    for name in set(main.weights) | set(other.weights):
        x, y = main.weights.get(name), other.weights.get(name)
        if x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y):
            continue
        differ = True
        if x is None or y is None or x.dim() == 0 or x.dtype != y.dtype or x.shape[0] != first or y.shape[0] != b \
                or x.shape[1:] != y.shape[1:] or not torch.equal(x, x[:1].expand_as(x)) \
                or not torch.equal(y, x[:1].expand_as(y)):
            return frozenset()
        shaped.add(name)
    return frozenset(shaped) if differ else frozenset()


def _other_weights(main, other) -> str | None:
    """How `other`'s weights differ from `main`'s, naming the first weight and the op that reads
    it (with its source line); None where they are the same."""
    def reader(c, name: str) -> str:
        g = c.graph
        vid = next(v.id for v in g.values if v.name == name)
        op = next((o for o in g.ops if vid in set(o.refs())), None)
        return "" if op is None else f", read by {op.target} at {op.source}"

    for name in sorted(set(main.weights) | set(other.weights)):
        a, b = main.weights.get(name), other.weights.get(name)
        if a is None or b is None:
            c, where = (other, "only at the larger") if a is None else (main, "only at the smaller")
            t = c.weights[name]
            return f"weight '{name}' ({types.dtype_name(t.dtype)}{list(t.shape)}) is {where} batch size{reader(c, name)}"
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            return (f"weight '{name}' is {types.dtype_name(a.dtype)}{list(a.shape)} at one and "
                    f"{types.dtype_name(b.dtype)}{list(b.shape)} at the other, or holds other values"
                    f"{reader(other, name)}")
    return None
