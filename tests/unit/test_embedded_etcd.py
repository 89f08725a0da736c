"""The embedded etcd's command line, and its error when the binary is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_rl.store.embedded import EtcdMissing, etcd_command

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_missing_binary_says_how_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EtcdMissing, match="apt-get install etcd-server"):
        etcd_command(Path("/tmp/d"), 2379, 2380)


def test_listens_on_loopback_only():
    command = etcd_command(Path("/tmp/d"), 23790, 23800)
    urls = [command[i + 1] for i, arg in enumerate(command) if arg.startswith("--listen")]
    assert urls == ["http://127.0.0.1:23790", "http://127.0.0.1:23800"]
