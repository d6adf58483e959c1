"""A graph node's arguments in its schema's order, defaults filled in: how the export frontend's
lowering and its pattern rules read an aten call."""

from __future__ import annotations

from ..errors import UnsupportedError


def schema_order(schema, args: list, kwargs: dict) -> list:
    """The node's arguments in schema order, defaults filled in."""
    out = []
    positional = list(args)
    for i, a in enumerate(schema.arguments):
        if not a.kwarg_only and i < len(positional):
            out.append(positional[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise UnsupportedError(f"{schema.name}: argument '{a.name}' is missing")
    return out
