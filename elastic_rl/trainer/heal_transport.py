"""How a healing trainer replica receives a peer's training state: HTTP on loopback, tensors only.

torchft's Manager calls ``send_checkpoint`` on a healthy replica when a peer
needs its state, and ``recv_checkpoint`` on the peer. torchft's own HTTP
transport listens on every interface and unpickles what it receives
(``weights_only=False``); this one binds 127.0.0.1 by default and loads with
``weights_only=True``, so a peer can hand over tensors and plain containers
and nothing else, the same rule as for snapshots on disk.

The state is serialised when it is offered, so the trainer may go on
changing its tensors while a slow peer is still reading. Under erld a peer
must carry the job's secret (``elastic_rl.job_secret``): a replica bound to
its node's advertise host hands its weights to its job's replicas only.
"""

from __future__ import annotations

import io
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torchft.checkpointing.transport import CheckpointTransport

from elastic_rl import job_secret
from elastic_rl.net import LOOPBACK


class LoopbackTransport(CheckpointTransport[dict]):
    def __init__(self, timeout: timedelta, host: str = LOOPBACK, secret: str | None = None):
        """``secret``: what a peer must carry; by default the one in this process's environment."""
        self._timeout = timeout
        self._secret = secret or job_secret.from_environment()
        self._offered = threading.Condition()
        self._step: int | None = None
        self._payload: bytes | None = None
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if transport._secret and not job_secret.carried(
                    self.headers.get(job_secret.AUTHORIZATION), transport._secret
                ):
                    self.send_error(401, "the job's secret is missing: Authorization: Bearer <secret>")
                    return
                try:
                    step = int(self.path.rstrip("/").rsplit("/", 1)[-1])
                except ValueError:
                    self.send_error(400, "expected /checkpoint/<step>")
                    return
                payload = transport._wait_for(step)
                if payload is None:
                    self.send_error(404, f"no state offered for step {step}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="heal-transport", daemon=True)
        self._thread.start()

    def _wait_for(self, step: int) -> bytes | None:
        # The peer may ask a moment before this replica's quorum thread has offered its state.
        with self._offered:
            self._offered.wait_for(lambda: self._step == step, timeout=self._timeout.total_seconds())
            return self._payload if self._step == step else None

    def metadata(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        with self._offered:
            self._step, self._payload = step, buffer.getvalue()
            self._offered.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._offered:
            self._step, self._payload = None, None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        request = urllib.request.Request(f"{metadata}{step}", headers=job_secret.headers(self._secret))
        with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
            payload = response.read()
        return torch.load(io.BytesIO(payload), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()
