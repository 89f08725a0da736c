"""Async HTTP clients for an engine (SGLang's API) and for the path through the router.

Every call goes through ``_call``, which retries connection failures and 5xx
answers (``elastic_rl.retry``) and re-raises the last error as ``EngineError``
with the URL in its message. A 4xx answer is not retried: it raises
``EngineRejected`` at once.

A client used as ``async with`` keeps one HTTP session, and so its
connections, for its whole life: the orchestrator sends every generation
request through one, where a connection per request cost it more CPU than the
tiny model's generation did. Outside ``async with`` each call opens its own.

Every call carries the job's secret (``elastic_rl.job_secret``): the one
given, or in a job's process, the one in its environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from elastic_rl import job_secret
from elastic_rl.engines import load_metrics
from elastic_rl.errors import EngineError, EngineRejected
from elastic_rl.retry import with_retries
from policies.engine_health import EngineLoad

if TYPE_CHECKING:
    from elastic_rl.engines.streaming import Received

DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
JSON_HEADERS = {"Content-Type": "application/json"}


class _Retryable(Exception):
    """A failure worth another attempt: no connection, or a 5xx answer."""


def open_session() -> aiohttp.ClientSession:
    """A session kept open across calls, with no cap on connections: the caller bounds the requests in
    flight (rollout.max_concurrency)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


class EngineClient:
    """Talks to one engine, or to the router, which answers the same generation API."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        attempts: int = 3,
        session: aiohttp.ClientSession | None = None,
        secret: str | None = None,
    ):
        """``session``: one its owner keeps open across clients; without it (and outside ``async with``)
        each call opens its own. ``secret``: the job's, by default the one in this process's environment."""
        self.base_url = base_url.rstrip("/")
        self.secret = secret or job_secret.from_environment()
        self._auth = job_secret.headers(self.secret)
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._session = session

    def client_for(self, base_url: str) -> EngineClient:
        """A client of the engine at ``base_url`` that shares this one's session and secret, one attempt a call."""
        return EngineClient(base_url, self.timeout_s, attempts=1, session=self._session, secret=self.secret)

    async def __aenter__(self) -> EngineClient:
        self._session = open_session()
        return self

    async def __aexit__(self, *exc_info) -> None:
        session, self._session = self._session, None
        await session.close()

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            return await with_retries(
                lambda: self._once(method, url, body, timeout), (_Retryable,), self.attempts, first_backoff_s=0.1
            )
        except _Retryable as exc:
            raise EngineError(f"{method} {url} failed after {self.attempts} attempts: {exc}") from exc

    async def _once(self, method: str, url: str, body: dict[str, Any] | None, timeout: aiohttp.ClientTimeout) -> Any:
        data = orjson.dumps(body) if body is not None else None
        headers = {**self._auth, **(JSON_HEADERS if body is not None else {})}
        try:
            if self._session is not None:
                raw, response = await self._send(self._session, method, url, data, headers, timeout)
            else:
                async with aiohttp.ClientSession() as session:
                    raw, response = await self._send(session, method, url, data, headers, timeout)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if response.status >= 500:
            raise _Retryable(f"HTTP {response.status}: {raw[:300]!r}")
        if response.status >= 400:
            raise EngineRejected(f"{method} {url}: HTTP {response.status}: {raw[:500].decode(errors='replace')}")
        if not raw:
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw.decode(errors="replace")

    @staticmethod
    async def _send(
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        data: bytes | None,
        headers: dict | None,
        timeout: aiohttp.ClientTimeout,
    ) -> tuple[bytes, aiohttp.ClientResponse]:
        async with session.request(method, url, data=data, headers=headers, timeout=timeout) as response:
            return await response.read(), response

    # --- the generation API -----------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        return await self._call("POST", "/generate", body)

    async def input_logprobs(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """The engine's log prob of each token of each sequence from its start (at least 1) on, scored in one
        request without generating (SGLang's input_token_logprobs with logprob_start_len). ``start - 1`` is
        asked for, and the tail kept: SGLang gives the first position it scores no log prob."""
        body = {
            "input_ids": sequences,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": [start - 1 for start in starts],
        }
        answers = await self._call("POST", "/generate", body)
        if not isinstance(answers, list) or len(answers) != len(sequences):
            raise TypeError(f"{len(sequences)} sequences scored, and the answer is not a list of as many")
        scored = []
        for answer, ids, start in zip(answers, sequences, starts):
            entries = answer["meta_info"]["input_token_logprobs"][1:]
            scored.append([float(logprob) for logprob, *_ in entries[len(entries) - (len(ids) - start) :]])
        return scored

    async def generate_stream(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        received: Received,
        silence_s: float | None = None,
        rid: str | None = None,
    ) -> dict[str, Any]:
        """``/generate`` streamed, with log probs (and the routing record when ``received`` reads one): each
        token goes into ``received`` as it arrives, and what arrived stays there if the stream breaks
        (EngineError) or is refused (EngineRejected). Returns the answer ``generate`` would have. One
        attempt: a retry would start the request over. A stream silent for ``silence_s`` (default: the
        client's timeout) counts as broken."""
        # Imported here: the streamed answer's routing record needs torch, which erld (health checks and
        # loads alone) starts without.
        from elastic_rl.engines.streaming import event_data
        from elastic_rl.routing_record import REQUEST_FLAG

        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "stream": True,
        }
        if received.routing_shape is not None:
            body[REQUEST_FLAG] = True
            received.input_tokens = len(input_ids)
        if rid is not None:
            body["rid"] = rid
        url = f"{self.base_url}/generate"
        # However long a request runs, a chunk comes with each token: a silence this long is a failure.
        silence = silence_s or self.timeout_s
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=silence)
        try:
            async with contextlib.AsyncExitStack() as stack:
                session = self._session or await stack.enter_async_context(aiohttp.ClientSession())
                response = await stack.enter_async_context(
                    session.post(url, data=orjson.dumps(body), headers={**self._auth, **JSON_HEADERS}, timeout=timeout)
                )
                if response.status >= 400:
                    raw = (await response.read())[:500].decode(errors="replace")
                    error = EngineRejected if response.status < 500 else EngineError
                    raise error(f"POST {url}: HTTP {response.status}: {raw}")
                async for line in response.content:
                    chunk = event_data(line)
                    if chunk is not None:
                        received.add(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineError(f"POST {url}: the stream broke after {len(received.output_ids)} tokens: {exc!r}") from exc
        if not received.finished:
            raise EngineError(f"POST {url}: the stream ended after {len(received.output_ids)} tokens, unfinished")
        return received.answer()

    async def health(self, timeout_s: float = 5.0) -> bool:
        return await self._probe("/health", timeout_s)

    async def health_generate(self, timeout_s: float = 5.0) -> bool:
        return await self._probe("/health_generate", timeout_s)

    async def load(self, timeout_s: float = 5.0) -> EngineLoad | None:
        """The engine's progress counter and whether it holds work, from its ``/metrics``; None when it
        does not answer within ``timeout_s``."""
        try:
            page = await self._once("GET", f"{self.base_url}/metrics", None, aiohttp.ClientTimeout(total=timeout_s))
        except (_Retryable, EngineError):
            return None
        return load_metrics.parse(page if isinstance(page, str) else "")

    async def _probe(self, path: str, timeout_s: float) -> bool:
        try:
            await self._once("GET", f"{self.base_url}{path}", None, aiohttp.ClientTimeout(total=timeout_s))
        except (_Retryable, EngineError):
            return False
        return True

    async def wait_healthy(self, timeout_s: float, process: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise EngineError(
                    f"{self.base_url}: the server process exited with code {process.returncode} while starting"
                )
            if await self.health(timeout_s=2.0):
                return
            await asyncio.sleep(0.2)
        raise EngineError(f"{self.base_url}: the server did not become healthy within {timeout_s:.0f}s")

    # --- control ------------------------------------------------------------------

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        return await self._call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version, "abort_all_requests": abort_all_requests},
        )

    # --- weights over NCCL (SGLang only): the trainer is rank 0 of a group the engines join ---

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
        backend: str = "nccl",
    ) -> dict[str, Any]:
        """Join the group at ``master_address:master_port`` as ranks ``rank_offset`` onwards (one per
        tensor-parallel rank of the engine); answers once the engine is in it."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call("POST", "/init_weights_update_group", body, timeout_s)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        timeout_s: float,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive the named tensors, in order, by broadcast from rank 0 of ``group_name`` and load
        them; answers once they are loaded. ``weight_version`` is the version the engine reports after."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._call("POST", "/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str, timeout_s: float) -> dict[str, Any]:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        await self._call("POST", "/abort_request", body)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give back the engine's weights and KV cache memory (tags ``weights``, ``kv_cache``; none: both)
        while it is idle: colocated mode's handover to the trainer."""
        await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._call("GET", "/get_server_info")
