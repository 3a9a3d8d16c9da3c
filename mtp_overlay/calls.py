"""Reading and replacing one argument of a wrapped call, and reaching the stock function.

A wrapt wrapper gets the call as ``(args, kwargs)``, the instance already split off for a method.
Every fix reads an argument with `argument` and hands a changed one on with `with_argument`, which
keep the call's own shape (a positional argument stays positional, a keyword one keyword), so the
upstream function sees what the caller meant; `positions` reads where each parameter sits from the
stock signature once, at wrap time. `original` is the function upstream defined, seen through every
wrapper: this overlay's, another fix's, a user's decorator.
"""

import inspect

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any


class _Required:
    """The default of `argument` for an argument the call must carry."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()


def argument(args: "tuple[Any, ...]", kwargs: "Mapping[str, Any]", position: "int | None", name: str,
             default: "Any" = REQUIRED) -> "Any":
    """The value of parameter ``name`` (at ``position`` in ``args``; None: keyword-only) in a call.

    The keyword wins, as Python's binding would have it; a call that carries neither gets
    ``default``, or a TypeError naming the argument when there is none.
    """
    if name in kwargs:
        return kwargs[name]
    if position is not None and len(args) > position:
        return args[position]
    if default is REQUIRED:
        where = "keyword-only" if position is None else f"position {position}"
        raise TypeError(f"the call carries no argument {name!r} ({where})")
    return default


def with_argument(args: "tuple[Any, ...]", kwargs: "Mapping[str, Any]", position: "int | None", name: str,
                  value: "Any") -> "tuple[tuple[Any, ...], dict[str, Any]]":
    """``(args, kwargs)`` of the same call with parameter ``name`` set to ``value``: where the call
    passed it, else as a keyword. The caller's tuple and dict are left as they were."""
    if name not in kwargs and position is not None and len(args) > position:
        return args[:position] + (value,) + args[position + 1 :], dict(kwargs)
    return tuple(args), {**kwargs, name: value}


def positions(function: "Callable[..., Any]", *, method: bool = False) -> "dict[str, int]":
    """Parameter name -> its index in a call's ``args``, for the parameters that can be passed by
    position. ``method``: the function is wrapped on its class, where wrapt hands ``args`` without
    ``self``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(original(function)).parameters.values() if p.kind in kinds]
    return {name: index for index, name in enumerate(names[1:] if method else names)}


def original(function: "Callable[..., Any]") -> "Callable[..., Any]":
    """``function`` as upstream defined it: every wrapper that names what it wraps (``__wrapped__``:
    wrapt's, functools.wraps') looked through."""
    unwrapped: "Callable[..., Any]" = inspect.unwrap(function)
    return unwrapped
