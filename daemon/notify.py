"""systemd's notify protocol: READY, WATCHDOG, STATUS and STOPPING datagrams to $NOTIFY_SOCKET.

A few lines of our own: one AF_UNIX datagram per message; an address starting
with "@" is an abstract socket. Without NOTIFY_SOCKET (not run by systemd),
every call does nothing. Sending never blocks and never raises: a message
systemd cannot take is logged and dropped, and erld goes on (a missed
WATCHDOG=1 is what the watchdog exists to notice).
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("erld.notify")

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def child_environment() -> dict[str, str]:
    """This process's environment minus NOTIFY_SOCKET.

    Children must not inherit it: etcd, for one, speaks the protocol itself and
    would tell systemd READY=1 before erld is.
    """
    return {name: value for name, value in os.environ.items() if name != NOTIFY_SOCKET}


class SystemdNotifier:
    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get(NOTIFY_SOCKET)
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None

    def send(self, message: str) -> None:
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), socket.MSG_DONTWAIT, self.address)
        except OSError as exc:
            log.warning("systemd notify %r not delivered: %s", message.split("\n", 1)[0], exc)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1")
