"""How config.pbtxt tensors bind to a PyTorch model's forward() (Triton's "Special Conventions for PyTorch Backend").

Inputs, in Triton's order of precedence: when every input name is a forward() argument name, each binds to that
argument; when every name is ``<name>__<index>``, each binds to forward() position <index>; otherwise the config's
order is the positional order. Outputs: when every name is ``<name>__<index>``, each is element <index> of the
returned tuple; otherwise the config's order. A forward() taking one ``Dict[str, Tensor]`` gets the inputs by name.

Triton falls back to config order without a word when names mix the conventions, which silently swaps tensors.
Here a mix in which every name still says its position (``b`` and ``A__0`` for ``forward(a, b)``) binds by those
positions, and a name whose convention contradicts the config-order position it would get is a load error.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence


class BindingError(ValueError):
    """The config's tensor names cannot be bound to the model unambiguously (a load-time error)."""


@dataclass(frozen=True)
class ForwardSignature:
    names: tuple[str, ...]  # forward()'s parameters after self, in order
    required: int  # how many leading parameters have no default value
    dict_input: bool = False  # forward(self, d: Dict[str, Tensor]): the inputs go in one dict, keyed by name


def named_index(name: str) -> int | None:
    """<index> of a ``<name>__<index>`` tensor name (Triton splits at the first ``__``), else None."""
    _, sep, tail = name.partition("__")
    return int(tail) if sep and tail.isascii() and tail.isdigit() else None


def torchscript_signature(module: Any) -> ForwardSignature:
    """forward()'s parameters from a TorchScript module's schema (its first argument is ``self``)."""
    args = list(module.forward.schema.arguments)
    if args and args[0].type.kind() == "ClassType":
        args = args[1:]
    names = tuple(a.name for a in args)
    dict_input = len(args) == 1 and args[0].type.kind() == "DictType"
    return ForwardSignature(names, _leading_required([not a.has_default_value() for a in args]), dict_input)


def python_signature(fn: Any) -> ForwardSignature | None:
    """forward()'s parameters from a Python callable (a torch.export program's module); None when it takes
    ``*args`` (no names to bind to)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in positional for p in params):
        return None
    return ForwardSignature(tuple(p.name for p in params),
                            _leading_required([p.default is inspect.Parameter.empty for p in params]))


def _leading_required(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


def input_positions(names: Sequence[str], sig: ForwardSignature | None) -> list[int]:
    """forward() position of each config input (by config index). Raises BindingError."""
    if sig is not None and len(names) > len(sig.names):
        raise BindingError(f"the config declares {len(names)} inputs {list(names)} but the model's forward() "
                           f"takes {len(sig.names)} {list(sig.names)}")
    args = sig.names if sig is not None else ()
    implied = [args.index(n) if n in args else named_index(n) for n in names]
    positions = _resolve(names, implied, "input", "a forward() argument name or <name>__<index>")
    if sig is not None:
        for n, p in zip(names, positions):
            if p >= len(sig.names):
                raise BindingError(f"input '{n}' names forward() position {p}, but forward() takes "
                                   f"{len(sig.names)} arguments {list(sig.names)}")
        unbound = [a for i, a in enumerate(sig.names[:sig.required]) if i not in positions]
        if unbound:
            raise BindingError(f"no config input binds to forward() argument(s) {unbound}, which have no default "
                               f"(config inputs: {list(names)})")
    return positions


def output_positions(names: Sequence[str]) -> list[int]:
    """Index in the model's returned tuple of each config output (by config index). Raises BindingError."""
    return _resolve(names, [named_index(n) for n in names], "output", "<name>__<index>")


def _resolve(names: Sequence[str], implied: list[int | None], kind: str, conventions: str) -> list[int]:
    if all(p is not None for p in implied):
        seen: dict[int, str] = {}
        for n, p in zip(names, implied):
            if p in seen:
                raise BindingError(f"{kind}s '{seen[p]}' and '{n}' both name position {p}")
            seen[p] = n
        return [int(p) for p in implied]
    # Some name follows no convention: the config's order holds, as in Triton, unless a name says otherwise.
    for i, (n, p) in enumerate(zip(names, implied)):
        if p is not None and p != i:
            loose = [m for m, q in zip(names, implied) if q is None]
            raise BindingError(
                f"{kind} '{n}' names position {p} but is listed at position {i}: as {loose} follow no naming "
                f"convention ({conventions}), the config's order applies and would bind it to position {i}. Name "
                f"every {kind} by a convention, or list them in the model's order")
    return list(range(len(names)))
