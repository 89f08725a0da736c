"""The systemd notify protocol against a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket

import pytest

from daemon.notify import SystemdNotifier, child_environment

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _receive_all(sock: socket.socket) -> list[str]:
    messages = []
    sock.setblocking(False)
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def test_messages_reach_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        notifier = SystemdNotifier(path)
        notifier.ready("up")
        notifier.watchdog()
        notifier.status("1 job")
        notifier.stopping()
        assert _receive_all(sock) == ["READY=1\nSTATUS=up", "WATCHDOG=1", "STATUS=1 job", "STOPPING=1"]


def test_abstract_socket_address():
    name = f"erl-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        SystemdNotifier("@" + name).watchdog()
        assert _receive_all(sock) == ["WATCHDOG=1"]


def test_silent_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = SystemdNotifier()
    assert notifier.address is None
    notifier.ready("up")  # nothing to send to, and no error


def test_children_do_not_inherit_the_socket(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    assert "NOTIFY_SOCKET" not in child_environment()


def test_a_full_or_missing_socket_never_raises(tmp_path):
    SystemdNotifier(str(tmp_path / "nobody-listens.sock")).ready("up")
    path = str(tmp_path / "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        notifier = SystemdNotifier(path)
        for _ in range(1000):  # far past the queue length; nobody reads
            notifier.watchdog()
