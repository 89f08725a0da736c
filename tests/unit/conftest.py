"""Test doubles shared by the unit tests."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture
def sglang_installed(monkeypatch):
    """This machine has no SGLang; the spec's check for it is told otherwise."""
    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "sglang" else installed(name))
