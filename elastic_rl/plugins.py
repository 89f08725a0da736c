"""Users' own functions, named in a spec as ``module:function`` (a reward, a filter): imported once,
in the process that calls them, with an error that names the spec field."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from elastic_rl.errors import SpecError


def load_function(field: str, name: str) -> Callable:
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise SpecError([f"{field}: cannot load {name!r}: {exc}"]) from None
    if not callable(function):
        raise SpecError([f"{field}: {name!r} is not callable"])
    return function
