"""The one module that talks to etcd (through aetcd), so the client can be swapped.

Every call has a timeout and is retried (``elastic_rl.retry``) when etcd is
unreachable; after the last attempt ``StoreUnavailable`` names the endpoint. Values are JSON (orjson, sorted keys).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import aetcd
import orjson
from aetcd import exceptions as etcd_errors
from elastic_rl.errors import ElasticRLError
from elastic_rl.retry import with_retries

DEFAULT_ENDPOINT = "http://127.0.0.1:2379"
_TRANSIENT = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.InternalError,
    asyncio.TimeoutError,
)


class StoreUnavailable(ElasticRLError):
    """etcd did not answer."""


class LeaseExpired(ElasticRLError):
    """etcd no longer knows the lease (it expired or etcd lost it)."""


def _encode(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


class Store:
    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 5.0, attempts: int = 4):
        parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._client = aetcd.Client(host=parsed.hostname or "127.0.0.1", port=parsed.port or 2379, timeout=timeout_s)

    async def _call(self, operation, *args, **kwargs):
        try:
            return await with_retries(
                lambda: asyncio.wait_for(operation(*args, **kwargs), self.timeout_s),
                _TRANSIENT,
                self.attempts,
                first_backoff_s=0.2,
            )
        except _TRANSIENT as exc:
            raise StoreUnavailable(f"etcd at {self.endpoint} is unreachable ({type(exc).__name__})") from exc

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # --- keys ---------------------------------------------------------------------

    async def get(self, key: str) -> Any | None:
        found = await self._call(self._client.get, key.encode())
        return None if found is None else orjson.loads(found.value)

    async def get_with_revision(self, key: str) -> tuple[Any | None, int]:
        """The value and its mod revision (0 when absent), for conditional updates."""
        found = await self._call(self._client.get, key.encode())
        return (None, 0) if found is None else (orjson.loads(found.value), found.mod_revision)

    async def get_prefix(self, prefix: str) -> dict[str, Any]:
        found = await self._call(self._client.get_prefix, prefix.encode())
        return {kv.key.decode(): orjson.loads(kv.value) for kv in found}

    async def put(self, key: str, value: Any, lease: aetcd.Lease | None = None) -> None:
        await self._call(self._client.put, key.encode(), _encode(value), lease=lease)

    async def create(self, key: str, value: Any, lease: aetcd.Lease | None = None) -> bool:
        """Put ``key`` only if it does not exist (create_revision == 0); True if this call created it."""
        tx = self._client.transactions
        succeeded, _ = await self._call(
            self._client.transaction,
            compare=[tx.create(key.encode()) == 0],
            success=[tx.put(key.encode(), _encode(value), lease=lease)],
            failure=[],
        )
        return succeeded

    async def update_if(self, key: str, value: Any, mod_revision: int) -> bool:
        """Put ``key`` only if nobody changed it since ``mod_revision``; True if it was written."""
        tx = self._client.transactions
        succeeded, _ = await self._call(
            self._client.transaction,
            compare=[tx.mod(key.encode()) == mod_revision],
            success=[tx.put(key.encode(), _encode(value))],
            failure=[],
        )
        return succeeded

    async def modify(self, key: str, change: Callable[[Any], Any], attempts: int = 20) -> Any:
        """Read-modify-write ``key`` conditional on its mod revision; returns the value written.

        A conflict (someone wrote ``key`` in between) retries after a jittered, growing pause.
        """
        for attempt in range(attempts):
            value, revision = await self.get_with_revision(key)
            updated = change(value)
            written = await self.update_if(key, updated, revision) if revision else await self.create(key, updated)
            if written:
                return updated
            await asyncio.sleep(random.uniform(0, 0.01 * (attempt + 1)))
        raise StoreUnavailable(f"{key} kept changing under {attempts} attempts to update it")

    async def delete(self, key: str) -> None:
        await self._call(self._client.delete, key.encode())

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(self._client.delete_prefix, prefix.encode())

    # --- leases -------------------------------------------------------------------

    async def lease(self, ttl_s: int) -> aetcd.Lease:
        return await self._call(self._client.lease, ttl_s)

    async def refresh(self, lease: aetcd.Lease) -> None:
        try:
            await self._call(lease.refresh)
        except etcd_errors.ClientError as exc:
            if isinstance(exc, _TRANSIENT):
                raise
            raise LeaseExpired(f"lease {lease.id} is gone: {exc}") from exc

    async def revoke(self, lease: aetcd.Lease) -> None:
        await self._call(lease.revoke)
