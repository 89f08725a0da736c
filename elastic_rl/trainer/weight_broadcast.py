"""The fast path of a weight sync: the trainer broadcasts a new weight version into every SGLang engine over NCCL.

With ``engines.weight_sync: distributed``, the rank that exports a version
(rank 0 of the step's participant 0) first pushes it into the engines behind
the router, each time through a group formed for that version:

1. every engine joins (SGLang's ``/init_weights_update_group``): the trainer
   is rank 0, engine i's tensor-parallel ranks follow from ``1 + i * tp_size``;
2. bucket by bucket, each engine is told the names, dtypes and shapes
   (``/update_weights_from_distributed``, the version with the last bucket)
   while the trainer broadcasts the HF tensors, in that order, from its GPU;
3. the group is dissolved on both sides.

Nothing depends on it succeeding: the version is then written to disk as
always, and the orchestrator loads it from there into any engine that does
not already serve it. A sync not done within ``engines.weight_sync_timeout_s``
is aborted by a watchdog (``trainer.watchdog``), which aborts the trainer's communicator; an engine
left waiting in its own is found by its health checks and replaced. An abort
cannot free a hang while NCCL is still making the communicator (it is made
lazily, in the first broadcast): a sync still not over ``ABORT_GRACE_S`` after
the abort ends the trainer (``EXIT_SYNC_HUNG``), and erld restarts it. The
trainer's side of the group is made by SGLang's own ``init_custom_process_group``,
so both sides name the group's store keys alike.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import torch

from elastic_rl.engines.client import EngineClient
from elastic_rl.engines.router import RouterClient
from elastic_rl.net import free_port
from elastic_rl.spec.job import JobSpec
from elastic_rl.trainer.watchdog import Watchdog
from policies.exits import EXIT_SYNC_HUNG

log = logging.getLogger("elastic_rl.trainer")

BUCKET_BYTES = 1 << 30
"""Most bytes broadcast per request: an engine holds one bucket at a time besides its weights."""
DISSOLVE_TIMEOUT_S = 10.0
ABORT_GRACE_S = 60.0
"""How long an aborted sync may take to end (the group's dissolving included) before the trainer exits."""


@dataclass(frozen=True)
class GroupLayout:
    world_size: int
    rank_offsets: tuple[int, ...]
    """Engine i's first rank; rank 0 is the trainer."""


def group_layout(engines: int, tp_size: int) -> GroupLayout:
    return GroupLayout(1 + engines * tp_size, tuple(1 + i * tp_size for i in range(engines)))


def buckets(state: dict[str, torch.Tensor], max_bytes: int = BUCKET_BYTES) -> Iterator[dict[str, torch.Tensor]]:
    """``state`` in order, cut into runs of at most ``max_bytes`` (a larger tensor goes alone)."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as SGLang reads it back (``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


class SyncFailed(RuntimeError):
    """An engine refused or missed the broadcast; it loads the version from disk."""


class WeightBroadcaster:
    """Pushes weight versions from this rank's GPU into the job's SGLang engines."""

    def __init__(self, spec: JobSpec, router_url: str, host: str, device: torch.device):
        self.tp_size = spec.engines.tp_size
        self.timeout_s = spec.engines.weight_sync_timeout_s
        self.router_url, self.host, self.device = router_url, host, device
        self.group = None
        # The engines' HTTP calls run on a loop of their own while this thread broadcasts.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="weight-sync-http", daemon=True).start()

    def _http(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def push(self, version: int, hf_state: dict[str, torch.Tensor]) -> tuple[list[str], str | None]:
        """Broadcast ``hf_state`` as ``version``; returns (the engines that took it, why not all did)."""
        engines = sorted(self._http(RouterClient(self.router_url).worker_urls()).result(self.timeout_s))
        if not engines:
            return [], "no engine behind the router"
        name = f"erl-weights-{version}"
        with Watchdog(self.timeout_s, "the weight sync", EXIT_SYNC_HUNG, self._abort, ABORT_GRACE_S) as watchdog:
            try:
                self._join(engines, name, watchdog)
                for bucket, last in _marked_last(buckets(hf_state)):
                    self._send(engines, name, bucket, str(version) if last else None, watchdog)
                return engines, None
            except Exception as exc:  # any failure leaves the engines to the disk path
                why = "timed out" if watchdog.expired.is_set() else f"{type(exc).__name__}: {exc}"
                log.warning("broadcasting weights %d failed (%s); the engines load them from disk", version, why)
                return [], why
            finally:
                self._dissolve(engines, name)

    def _join(self, engines: list[str], name: str, watchdog: Watchdog) -> None:
        from sglang.srt.utils import init_custom_process_group  # GPU nodes only: engines.kind sglang

        layout = group_layout(len(engines), self.tp_size)
        port = free_port(self.host)
        joined = self._http(
            asyncio.gather(
                *(
                    _client(url).init_weights_update_group(
                        self.host, port, offset, layout.world_size, name, self.timeout_s
                    )
                    for url, offset in zip(engines, layout.rank_offsets)
                )
            )
        )
        self.group = init_custom_process_group(
            backend="nccl",
            init_method=f"tcp://{self.host}:{port}",
            world_size=layout.world_size,
            rank=0,
            group_name=name,
            timeout=timedelta(seconds=self.timeout_s),
        )
        _check(engines, joined.result(watchdog.remaining()))

    def _send(
        self, engines: list[str], name: str, bucket: dict[str, torch.Tensor], version: str | None, watchdog: Watchdog
    ) -> None:
        names = list(bucket)
        dtypes = [dtype_name(t.dtype) for t in bucket.values()]
        shapes = [list(t.shape) for t in bucket.values()]
        loaded = self._http(
            asyncio.gather(
                *(
                    _client(url).update_weights_from_distributed(
                        names, dtypes, shapes, name, self.timeout_s, version, flush_cache=version is not None
                    )
                    for url in engines
                )
            )
        )
        for tensor in bucket.values():
            torch.distributed.broadcast(tensor.to(self.device), group=self.group, group_src=0)
        torch.cuda.synchronize(self.device)
        _check(engines, loaded.result(watchdog.remaining()))

    def _abort(self) -> None:
        if self.group is not None:
            self.group.abort()

    def _dissolve(self, engines: list[str], name: str) -> None:
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None
        dissolved = self._http(
            asyncio.gather(
                *(_client(url).destroy_weights_update_group(name, DISSOLVE_TIMEOUT_S) for url in engines),
                return_exceptions=True,
            )
        )
        try:
            answers = dissolved.result(DISSOLVE_TIMEOUT_S + 1)
        except TimeoutError:
            answers = [TimeoutError("no answer")] * len(engines)
        for url, answer in zip(engines, answers):
            if isinstance(answer, BaseException):
                # An engine that cannot dissolve it keeps an idle group; a hung one is replaced anyway.
                log.warning("engine %s did not dissolve weight group %s: %s", url, name, answer)


def _client(url: str) -> EngineClient:
    # One attempt: a retried join or load would be a second, unmatched collective.
    return EngineClient(url, attempts=1)


def _check(engines: list[str], answers: list[dict]) -> None:
    refused = [f"{url}: {answer.get('message')}" for url, answer in zip(engines, answers) if not answer.get("success")]
    if refused:
        raise SyncFailed("; ".join(refused))


def _marked_last(items: Iterator) -> Iterator[tuple]:
    """Each item with whether it is the last."""
    previous = next(items, None)
    for item in items:
        yield previous, False
        previous = item
    if previous is not None:
        yield previous, True
