"""The job's secret: the bearer token every job endpoint that changes state asks for.

``erl submit`` makes one per job and keeps it in etcd under the job
(``elastic_rl.jobs.secret_of``); each agent reads it there and gives it to
the job's processes in their environment (``ERL_JOB_SECRET``), never on a
command line and never in a log or ``erl status``. It travels as SGLang's
``--api-key`` does, in ``Authorization: Bearer <secret>``:

- the engines ask it on every path but ``/health*`` and ``/metrics`` (SGLang
  by its ``--api-key``, the cpu engine by this module);
- the router asks it on its worker list and its generation API, and sends it
  to the engines it forwards to (``engines.keyed_launch``);
- a healing trainer sends it to the peer it takes its state from.

A process with no secret in its environment (a cpu engine or router started
by hand, a test's) runs open, as SGLang does without ``--api-key``.
"""

from __future__ import annotations

import hmac
import os
import secrets

from elastic_rl import jobenv

AUTHORIZATION = "Authorization"
OPEN_PATHS = ("/health", "/metrics")
"""What an engine answers without the secret (``/health_generate`` too), as SGLang's --api-key leaves open:
erld, the router and Prometheus probe them."""


def make() -> str:
    return secrets.token_hex(32)


def from_environment() -> str | None:
    """The secret a job process was given; None outside a job."""
    return os.environ.get(jobenv.SECRET) or None


def headers(secret: str | None) -> dict[str, str]:
    """The header that carries ``secret``; none without one."""
    return {AUTHORIZATION: f"Bearer {secret}"} if secret else {}


def carried(authorization: str | None, secret: str) -> bool:
    """Whether an ``Authorization`` header carries ``secret`` (compared in constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {secret}".encode())


def is_open(path: str) -> bool:
    return path.startswith(OPEN_PATHS)
