"""The event kinds and metric names the code writes are the registered ones (the docs are generated from
the registries), found by reading the source: a path no test runs is checked too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from elastic_rl.event_kinds import EventKind
from elastic_rl.metric_names import METRICS, registered
from elastic_rl.plot import MARKED_EVENTS
from policies.fault_time import FAULT_SIGNS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic_rl", "daemon", "policies", "checkpoints", "chaos")
EMITTERS = ("emit", "emit_event", "event", "report", "_report")
METRIC_PREFIXES = ("rollout/", "train/", "perf/", "eval/", "memory/", "handover/")


@functools.cache
def source_trees() -> tuple[tuple[Path, ast.Module], ...]:
    """Every module of the packages, parsed once for all the tests here."""
    return tuple(
        (path, ast.parse(path.read_text())) for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
    )


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_every_event_kind_named_in_the_code_exists():
    unknown = [
        f"{where(path, node)}: EventKind.{node.attr}"
        for path, tree in source_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "EventKind"
        and node.attr not in EventKind.__members__
    ]
    assert not unknown


def test_no_event_is_emitted_under_a_bare_string():
    bare = [
        f"{where(path, node)}: {node.args[0].value!r}"
        for path, tree in source_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) in EMITTERS
        and node.args
        and isinstance(node.args[0], ast.Constant | ast.JoinedStr)
    ]
    assert not bare


def test_no_event_is_queued_under_a_bare_string():
    """The controller's passes queue their events as (kind, message, fields) on ``changes.events``."""
    bare = [
        f"{where(path, node)}: {ast.unparse(node.args[0].elts[0])}"
        for path, tree in source_trees()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "append"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "events"
        and node.args
        and isinstance(node.args[0], ast.Tuple)
        and isinstance(node.args[0].elts[0], ast.Constant | ast.JoinedStr)
    ]
    assert not bare


def test_the_kinds_readers_match_on_are_registered():
    assert set(FAULT_SIGNS) <= set(EventKind)
    assert set(MARKED_EVENTS) <= set(EventKind)
    assert all(kind.meaning for kind in EventKind)


def metric_like_names(tree: ast.Module) -> list[tuple[ast.AST, str]]:
    """String constants that name a metric, and f-strings as a sample name (each placeholder an "x");
    a bare prefix (``f"train/{name}"``, ``f"eval/{dataset}/"``) is left to the run's check
    (``tests/integration/test_erld.py``)."""
    names, parts = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts.update(id(part) for part in node.values)
            text = "".join(part.value if isinstance(part, ast.Constant) else "x" for part in node.values)
            fixed = "".join(part.value for part in node.values if isinstance(part, ast.Constant))
            if text.startswith(METRIC_PREFIXES) and fixed not in METRIC_PREFIXES and not text.endswith("/"):
                names.append((node, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(METRIC_PREFIXES) and " " not in node.value and not node.value.endswith("/"):
                names.append((node, node.value))
    return [(node, name) for node, name in names if id(node) not in parts]


def test_every_metric_named_in_the_code_is_registered():
    unregistered = [
        f"{where(path, node)}: {name}"
        for path, tree in source_trees()
        for node, name in metric_like_names(tree)
        if not registered(name)
    ]
    assert not unregistered


def test_metric_names_are_unique_and_described():
    names = [metric.name for metric in METRICS]
    assert len(names) == len(set(names))
    assert all(metric.meaning for metric in METRICS)
    assert registered("eval/gsm8k/reward_mean") and registered("memory/node-1:0/training_peak_bytes")
    assert not registered("train/made_up") and not registered("eval/gsm8k/made_up")
