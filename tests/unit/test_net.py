"""Ports for a job's servers: never from the kernel's ephemeral range, never one already listened on."""

from __future__ import annotations

import socket

import pytest

from elastic_rl import net

pytestmark = pytest.mark.timeout(30)


def test_ports_come_from_below_the_ephemeral_range_and_do_not_repeat():
    ports = [net.free_port() for _ in range(50)]
    assert all(net.LOWEST_PORT <= port < net.ephemeral_low() for port in ports)
    assert len(set(ports)) == len(ports)


def test_a_port_with_a_listener_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((net.LOOPBACK, net.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        assert not net.can_bind(taken)
        monkeypatch.setattr(net, "_next", taken)
        assert net.free_port() != taken
