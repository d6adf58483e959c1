"""The one loop that issues an op list, for every executor nimble has: the reference run, the
preflight, the placed run on the CPU and in a CUDA graph, the training forward, and a fused body.

What differs between them is an `Executor`'s hooks:
- `arguments(item)`: the torch arguments of one op (its IR arguments looked up in its tensors);
- `call(item, args, kwargs)`: what runs (the aten overload, a shape rule, a placed kernel) and the
  tensors that hold its results;
- `bind(item, results)`: where those go;
- `failed(item, error)`: the one-line error that names the op, or None to let the error through.

`run_ops` calls them in order, and `place(order, step)`, where given, issues each step on its
planned stream (`runtime/streams.issue`); without it the steps run one after another.
"""

from __future__ import annotations

from typing import Callable, Sequence


class Executor:
    def arguments(self, item) -> tuple[list, dict]:
        raise NotImplementedError

    def call(self, item, args: list, kwargs: dict) -> list:
        raise NotImplementedError

    def bind(self, item, results: list) -> None:
        raise NotImplementedError

    def failed(self, item, error: Exception) -> Exception | None:
        return None


def run_ops(items: Sequence, executor: Executor, order: Sequence[int] | None = None,
            place: Callable[[Sequence[int], Callable[[int], None]], None] | None = None) -> None:
    """Issue `items[i]` for each i in `order` (default: all, in order) through `executor`."""
    def step(i: int) -> None:
        item = items[i]
        args, kwargs = executor.arguments(item)
        try:
            results = executor.call(item, args, kwargs)
        except Exception as e:
            error = executor.failed(item, e)
            if error is None:
                raise
            raise error from e
        executor.bind(item, results)

    order = range(len(items)) if order is None else order
    if place is None:
        for i in order:
            step(i)
    else:
        place(order, step)
