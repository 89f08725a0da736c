"""Loopback addresses for the servers a job starts, and the ports they listen on.

A port is chosen before the server that listens on it starts (the controller
writes it into an assignment; the process binds it later, maybe after a
restart). Ports from the kernel's ephemeral range would be unsafe for that:
any outgoing connection on the machine may take one as its source port in
between, and the server could never bind it. So ports come from below that
range, handed out in turn from a random start (two processes rarely overlap),
each checked free at the time.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOOPBACK = "127.0.0.1"
LOWEST_PORT = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768

_lock = threading.Lock()
_next: int | None = None


def ephemeral_low() -> int:
    """The first port the kernel may hand out as a connection's source port."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def can_bind(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``port`` now (with SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on now, outside the ephemeral range."""
    global _next
    low, high = LOWEST_PORT, ephemeral_low()
    if high - low < 100:  # a machine whose ephemeral range starts low: let the OS choose
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    with _lock:
        if _next is None:
            _next = random.SystemRandom().randrange(low, high)
        for _ in range(high - low):
            port = _next if low <= _next < high else low
            _next = port + 1
            if can_bind(port, host):
                return port
    raise OSError(f"no free TCP port in {low}..{high - 1}")


def url(port: int, host: str = LOOPBACK) -> str:
    return f"http://{host}:{port}"
