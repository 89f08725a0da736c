"""Users' own functions, named in a spec as ``module:function`` (a reward, a filter): imported once,
in the process that calls them, with an error that names the spec field."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from elastic_rl.errors import SpecError


def load_function(field: str, name: str) -> Callable:
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user's module: a syntax error or any other import-time error is theirs
        why = f"importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        raise SpecError([f"{field}: cannot load {name!r}: {why}"]) from None
    try:
        function = getattr(module, function_name)
    except AttributeError as exc:
        raise SpecError([f"{field}: cannot load {name!r}: {exc}"]) from None
    if not callable(function):
        raise SpecError([f"{field}: {name!r} is not callable"])
    return function
