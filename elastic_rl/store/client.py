"""The one module that talks to etcd (through aetcd), so the client can be swapped.

The endpoint may list several members of one etcd cluster, comma-separated
(``http://127.0.0.1:2379,http://127.0.0.1:2381``): a call that finds its member
unreachable is retried on the next one. Every call has a timeout and is
retried (``elastic_rl.retry``); after the last attempt ``StoreUnavailable``
names the endpoints. Values are JSON (orjson, sorted keys). ``commit_if`` is
the one multi-key write: several puts and deletes, done together (in
transactions of at most etcd's 128 operations) only while a guard key is
still the one the caller saw (the controller's fencing).
``read_prefix`` and ``watch_prefix`` give a prefix at a revision and every
change after it, for a copy kept current by one watch (``store.mirror``).

A secured etcd (``https://`` members, etcd's auth) is reached with the credentials of
``store.credentials``, by default the ones the process's environment names. When etcd no longer
knows the client's token, the client signs in again once; a refusal of who the client is becomes
``StoreAccessDenied``, naming the options to give.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aetcd
import grpc
import orjson
from aetcd import exceptions as etcd_errors
from aetcd import rpc as aetcd_rpc

from elastic_rl.errors import ElasticRLError, InputError
from elastic_rl.retry import with_retries
from elastic_rl.store.credentials import EtcdCredentials

DEFAULT_ENDPOINT = "http://127.0.0.1:2379"
MAX_TXN_OPS = 128
"""etcd's default --max-txn-ops: a transaction with more operations is refused."""
_DELETED = object()
_TRANSIENT = (
    etcd_errors.ConnectionFailedError,
    etcd_errors.ConnectionTimeoutError,
    etcd_errors.InternalError,
    asyncio.TimeoutError,
)


class StoreUnavailable(ElasticRLError):
    """etcd did not answer."""


class WatchBroken(ElasticRLError):
    """A watch ended: its member went away, its revision was compacted, or its stream failed."""


@dataclass(frozen=True)
class Change:
    """One key's change, as a watch reports it."""

    key: str
    value: Any | None
    """The new value; None: the key was deleted."""
    revision: int
    """The revision of the change (a deletion's too)."""


class StoreAccessDenied(InputError):
    """etcd's auth refused the client: no user, a wrong password, or a user without the permission."""


def _refused_access(error: etcd_errors.ClientError) -> bool:
    """Whether etcd said no to who the client is (codes UNAUTHENTICATED, PERMISSION_DENIED, or
    etcd's INVALID_ARGUMENT for a missing user or a failed sign-in)."""
    if isinstance(error, etcd_errors.UnauthenticatedError):
        return True
    text = str(error).lower()
    return any(words in text for words in ("permission denied", "user name is empty", "authentication failed"))


class LeaseExpired(ElasticRLError):
    """etcd no longer knows the lease (it expired or etcd lost it)."""


def _encode(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


# aetcd 1.0 always opens a plain-text channel (``rpc.insecure_channel`` in ``Client.connect``). Its
# one call of that name is replaced here, once, by one that opens a TLS channel for the client
# connecting in the current task (``_TlsClient`` sets this variable around its connect).
_CONNECTING_TLS: contextvars.ContextVar[grpc.ChannelCredentials | None] = contextvars.ContextVar(
    "etcd_tls", default=None
)
_plain_channel = aetcd_rpc.insecure_channel


def _channel(target: str, options=None, **kwargs):
    tls = _CONNECTING_TLS.get()
    if tls is None:
        return _plain_channel(target, options=options, **kwargs)
    return grpc.aio.secure_channel(target, tls, options=options, **kwargs)


aetcd_rpc.insecure_channel = _channel


class _TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel."""

    def __init__(self, tls: grpc.ChannelCredentials, **options):
        super().__init__(**options)
        self._tls = tls

    async def connect(self) -> None:
        token = _CONNECTING_TLS.set(self._tls)
        try:
            await super().connect()
        finally:
            _CONNECTING_TLS.reset(token)


def _client_for(endpoint: str, timeout_s: float, credentials: EtcdCredentials) -> aetcd.Client:
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    options = {
        "host": parsed.hostname or "127.0.0.1",
        "port": parsed.port or 2379,
        "timeout": timeout_s,
        "username": credentials.user,
        "password": credentials.password(),
    }
    tls = credentials.tls()
    return aetcd.Client(**options) if tls is None else _TlsClient(tls, **options)


class Store:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout_s: float = 5.0,
        attempts: int = 4,
        credentials: EtcdCredentials | None = None,
    ):
        """``credentials``: by default the ones this process's environment names (``store.credentials``)."""
        self.endpoint = endpoint
        self.credentials = credentials if credentials is not None else EtcdCredentials.from_environ()
        self.credentials.check(endpoint)
        self.members = [member.strip() for member in endpoint.split(",") if member.strip()]
        self.timeout_s = timeout_s
        # With several members, enough attempts to try each at least once.
        self.attempts = attempts if len(self.members) == 1 else max(attempts, len(self.members) + 1)
        self._member = 0
        self._client = self._new_client()
        self._closing: set[asyncio.Task] = set()

    def _new_client(self) -> aetcd.Client:
        return _client_for(self.members[self._member], self.timeout_s, self.credentials)

    async def _next_member(self, failed: aetcd.Client) -> None:
        """Move on from the member behind ``failed``, unless a concurrent call already has."""
        if len(self.members) < 2 or failed is not self._client:
            return
        self._member = (self._member + 1) % len(self.members)
        self._replace_client(failed)

    def _replace_client(self, old: aetcd.Client) -> None:
        """A fresh client (a new channel, signed in anew) for the current member."""
        self._client = self._new_client()
        # Other calls may still be in flight on the old channel (the lease keep-alive beside the main
        # loop): closing it now would cancel them. They finish or time out first.
        closing = asyncio.create_task(self._close_later(old))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def _close_later(self, client: aetcd.Client) -> None:
        await asyncio.sleep(self.timeout_s)
        # Closing a channel to a dead member can hang: give it a moment, no more.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), self.timeout_s)

    async def _call(self, operation: Callable[[aetcd.Client], Any]):
        """``operation(client)`` with a timeout, retried (on the next member, if there are several)."""
        used = [self._client]

        async def attempt():
            used[0] = self._client
            try:
                return await asyncio.wait_for(operation(used[0]), self.timeout_s)
            except etcd_errors.UnauthenticatedError:
                if self.credentials.user is None:
                    raise
                # etcd's token is gone: it expired (--auth-token-ttl) or its member restarted and
                # forgot it (simple tokens live in memory). Sign in again, once, and repeat the call.
                if used[0] is self._client:
                    self._replace_client(used[0])
                used[0] = self._client
                return await asyncio.wait_for(operation(used[0]), self.timeout_s)

        try:
            return await with_retries(
                attempt, _TRANSIENT, self.attempts, first_backoff_s=0.2, before_retry=lambda: self._next_member(used[0])
            )
        except _TRANSIENT as exc:
            tls = " over TLS: check that --etcd-cacert signed etcd's certificate" if self.credentials.cacert else ""
            raise StoreUnavailable(f"etcd at {self.endpoint} is unreachable{tls} ({type(exc).__name__})") from exc
        except etcd_errors.ClientError as exc:
            if _refused_access(exc):
                raise StoreAccessDenied(self._access_hint(exc)) from exc
            raise

    def _access_hint(self, error: etcd_errors.ClientError) -> str:
        who = f"as etcd user {self.credentials.user!r}" if self.credentials.user else "without an etcd user"
        return (
            f"etcd at {self.endpoint} refused this client {who} ({error}): give a user with "
            f"--etcd-user and --etcd-password-file (or a client certificate etcd maps to a user, "
            f"--etcd-cert and --etcd-key) that etcd's auth allows"
        )

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # --- keys ---------------------------------------------------------------------

    async def get(self, key: str) -> Any | None:
        found = await self._call(lambda client: client.get(key.encode()))
        return None if found is None else orjson.loads(found.value)

    async def get_with_revision(self, key: str) -> tuple[Any | None, int]:
        """The value and its mod revision (0 when absent), for conditional updates."""
        found = await self._call(lambda client: client.get(key.encode()))
        return (None, 0) if found is None else (orjson.loads(found.value), found.mod_revision)

    async def get_prefix(self, prefix: str) -> dict[str, Any]:
        found = await self._call(lambda client: client.get_prefix(prefix.encode()))
        return {kv.key.decode(): orjson.loads(kv.value) for kv in found}

    async def read_prefix(self, prefix: str) -> tuple[dict[str, tuple[Any, int]], int]:
        """Every key under ``prefix`` with its value and mod revision, and the revision of the read."""
        found = await self._call(lambda client: client.get_prefix(prefix.encode()))
        return {kv.key.decode(): (orjson.loads(kv.value), kv.mod_revision) for kv in found}, found.header.revision

    async def watch_prefix(self, prefix: str, after_revision: int) -> AsyncIterator[Change]:
        """Every change under ``prefix`` after ``after_revision``, in order, until the watch breaks
        (``WatchBroken``). One watch for the whole prefix, on the client's one watch stream."""
        try:
            watch = await asyncio.wait_for(
                self._client.watch_prefix(prefix.encode(), start_revision=after_revision + 1), self.timeout_s
            )
        except (etcd_errors.ClientError, asyncio.TimeoutError) as exc:
            raise WatchBroken(f"watching {prefix} failed: {type(exc).__name__}: {exc}") from exc
        try:
            async for event in watch:
                deleted = event.kind == aetcd.EventKind.DELETE
                yield Change(
                    event.kv.key.decode(), None if deleted else orjson.loads(event.kv.value), event.kv.mod_revision
                )
        except etcd_errors.ClientError as exc:
            raise WatchBroken(f"the watch on {prefix} broke: {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), self.timeout_s)
        raise WatchBroken(f"the watch on {prefix} ended")

    async def put(self, key: str, value: Any, lease: aetcd.Lease | None = None) -> None:
        await self._call(lambda client: client.put(key.encode(), _encode(value), lease=lease))

    async def _transaction(self, compare, success) -> bool:
        return await self._transaction_at(compare, success) is not None

    async def _transaction_at(self, compare, success) -> int | None:
        """One etcd transaction, built against whichever member the call reaches: the revision it
        wrote at (0 for one with nothing to write), or None when its compare failed."""

        def run(client: aetcd.Client):
            tx = client.transactions
            return client.transaction(compare=compare(tx), success=success(tx), failure=[])

        succeeded, responses = await self._call(run)
        if not succeeded:
            return None
        if not responses:
            return 0
        first = responses[0]
        return getattr(first, first.WhichOneof("response")).header.revision

    async def create(self, key: str, value: Any, lease: aetcd.Lease | None = None) -> bool:
        """Put ``key`` only if it does not exist (create_revision == 0); True if this call created it."""
        return await self._transaction(
            lambda tx: [tx.create(key.encode()) == 0],
            lambda tx: [tx.put(key.encode(), _encode(value), lease=lease)],
        )

    async def update_if(self, key: str, value: Any, mod_revision: int, lease: aetcd.Lease | None = None) -> bool:
        """Put ``key`` only if nobody changed it since ``mod_revision``; True if it was written."""
        return await self._transaction(
            lambda tx: [tx.mod(key.encode()) == mod_revision],
            lambda tx: [tx.put(key.encode(), _encode(value), lease=lease)],
        )

    async def commit_if(
        self, guard: str, guard_revision: int, puts: dict[str, Any], deletes: tuple[str, ...] = ()
    ) -> int | None:
        """Every put and delete, only while ``guard`` still has ``guard_revision`` as its mod revision
        (never changed since the caller read it): the revision they were written at (split, the first
        transaction's: no write of theirs is older), None if they were not.

        One transaction holds at most ``MAX_TXN_OPS`` of them (etcd's default ``--max-txn-ops``): more
        go in several, in the order given (puts, then deletes), each under the same guard. A guard
        that changes between two of them leaves the first done and the rest not: a caller puts first
        what makes the others' absence repairable (the controller: a job's status before its
        assignments, so a new leader places what is missing)."""
        operations = list(puts.items()) + [(key, _DELETED) for key in deletes]
        first = None
        for start in range(0, max(len(operations), 1), MAX_TXN_OPS):
            chunk = operations[start : start + MAX_TXN_OPS]
            revision = await self._transaction_at(
                lambda tx: [tx.mod(guard.encode()) == guard_revision],
                lambda tx, chunk=chunk: [
                    tx.delete(key.encode()) if value is _DELETED else tx.put(key.encode(), _encode(value))
                    for key, value in chunk
                ],
            )
            if revision is None:
                return None
            first = revision if first is None else first
        return first

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
        await self._call(lambda client: client.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(lambda client: client.delete_prefix(prefix.encode()))

    # --- leases -------------------------------------------------------------------
    # By id, so a lease granted through one member is refreshed or revoked through another.

    async def lease(self, ttl_s: int) -> aetcd.Lease:
        return await self._call(lambda client: client.lease(ttl_s))

    async def refresh(self, lease: aetcd.Lease) -> None:
        try:
            response = await self._call(lambda client: client.refresh_lease(lease.id))
        except etcd_errors.ClientError as exc:
            if isinstance(exc, _TRANSIENT):
                raise
            raise LeaseExpired(f"lease {lease.id} is gone: {exc}") from exc
        if response is not None and getattr(response, "TTL", 1) <= 0:
            raise LeaseExpired(f"lease {lease.id} expired")

    async def revoke(self, lease: aetcd.Lease) -> None:
        await self.revoke_lease_id(lease.id)

    async def revoke_lease_id(self, lease_id: int) -> None:
        """Revoke a lease (one of a dead process's too); one already gone is fine."""
        try:
            await self._call(lambda client: client.revoke_lease(lease_id))
        except etcd_errors.ClientError as exc:
            if isinstance(exc, _TRANSIENT):
                raise


async def etcd_answers(endpoint: str, credentials: EtcdCredentials | None = None) -> bool:
    """Whether etcd at ``endpoint`` answers a read within 2 s, with one attempt (``credentials``: by
    default the environment's, as ``Store``'s)."""
    async with Store(endpoint, timeout_s=2.0, attempts=1, credentials=credentials) as store:
        try:
            await store.get("/erl/ping")
        except StoreUnavailable:
            return False
    return True
