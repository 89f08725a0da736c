"""A copy of a few etcd prefixes, kept current by one watch per prefix: what erld reads on every pass.

Each prefix is read once (``Store.read_prefix``) and then followed by a watch
that starts at the revision after that read, so no change falls between them,
and etcd sends a watch's changes in revision order. A pass then reads memory,
not etcd: a thousand erlds cost etcd their changes, not a read of the
keyspace each every half second.

A watch that breaks (its member gone, its revision compacted, its stream
failed) is replaced by a fresh read and a new watch. What this process
writes itself can be applied at once with the revision it was written at
(``applied``), so its next pass sees it even before the watch brings it; a
change older than what a key already holds, or than its deletion applied
so, is then ignored when the watch delivers it. A ``listener`` hears of every
prefix read and every change applied, so it can keep its own view (erld's
parsed cluster, ``daemon.cluster.ClusterRecords``) current change by change.

What is followed can change as the process's needs do (``follow``,
``unfollow``): erld follows one job's prefixes while it runs a process of it,
and the whole cluster while it leads.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from elastic_rl.store.client import Store, StoreUnavailable, WatchBroken

log = logging.getLogger("elastic_rl.store.mirror")

RESYNC_PAUSE_S = 0.5
STOP_WAIT_S = 5.0
"""How long ``stop`` waits for the followers to end (one waiting on a watch ends when its stream does)."""


class Listener(Protocol):
    def reset(self, prefix: str, entries: dict[str, Any]) -> None:
        """``prefix`` was read afresh: these are all its keys now."""

    def changed(self, prefix: str, key: str, value: Any | None) -> None:
        """``key`` under ``prefix`` changed (None: deleted)."""


class Mirror:
    def __init__(self, store: Store, prefixes: tuple[str, ...], listener: Listener | None = None):
        self.store = store
        self.listener = listener
        self._entries: dict[str, dict[str, tuple[Any, int]]] = {prefix: {} for prefix in prefixes}
        """Followed prefix -> key -> (value, mod revision)."""
        self._deleted: dict[str, int] = {}
        """Keys this process deleted, at the revision of the deletion, until their watch catches up."""
        self._followers: dict[str, asyncio.Task] = {}
        self.resyncs = 0
        """How many times a broken watch was replaced by a fresh read."""

    @property
    def prefixes(self) -> tuple[str, ...]:
        """The prefixes followed now."""
        return tuple(self._entries)

    async def start(self) -> None:
        """Read every prefix (``StoreUnavailable`` if etcd does not answer) and start following them."""
        revisions = {prefix: await self._load(prefix) for prefix in self._entries}
        for prefix, revision in revisions.items():
            self._start_following(prefix, revision)

    async def follow(self, prefix: str) -> None:
        """Read ``prefix`` and follow it from now on (``StoreUnavailable`` if etcd does not answer). A
        prefix under one followed already is left to that one; a narrower one followed so far is
        dropped in favour of ``prefix``, whose read brings its keys again."""
        if any(prefix.startswith(followed) for followed in self._entries):
            return
        self._entries[prefix] = {}
        try:
            revision = await self._load(prefix)
        except BaseException:
            del self._entries[prefix]
            raise
        self._start_following(prefix, revision)
        for narrower in [followed for followed in self._entries if followed != prefix and followed.startswith(prefix)]:
            self._drop(narrower)

    def unfollow(self, prefix: str) -> None:
        """Stop following ``prefix``; the listener hears that nothing is left under it."""
        if prefix in self._entries:
            self._drop(prefix)
            if self.listener is not None:
                self.listener.reset(prefix, {})

    def _drop(self, prefix: str) -> None:
        follower = self._followers.pop(prefix, None)
        if follower is not None:
            follower.cancel()
        del self._entries[prefix]

    def _start_following(self, prefix: str, revision: int) -> None:
        self._followers[prefix] = asyncio.create_task(self._follow(prefix, revision), name=f"mirror {prefix}")

    def cancel(self) -> None:
        """Stop following, at once."""
        for follower in self._followers.values():
            follower.cancel()
        self._followers.clear()

    async def stop(self) -> None:
        followers = list(self._followers.values())
        self.cancel()
        if followers:
            await asyncio.wait(followers, timeout=STOP_WAIT_S)

    async def _load(self, prefix: str) -> int:
        found, revision = await self.store.read_prefix(prefix)
        self._install(prefix, found, revision)
        return revision

    def _install(self, prefix: str, found: dict[str, tuple[Any, int]], revision: int) -> None:
        self._entries[prefix] = found
        if self.listener is not None:
            self.listener.reset(prefix, {key: value for key, (value, _) in found.items()})
        for key in [key for key, deleted in self._deleted.items() if key.startswith(prefix) and deleted <= revision]:
            del self._deleted[key]

    async def _follow(self, prefix: str, revision: int) -> None:
        # A follower ends when it is no longer the prefix's, not only when cancelled: Python 3.11's
        # asyncio.wait_for (under every etcd call) can swallow a cancellation that comes as its call
        # completes, and a follower left over would re-read a prefix no longer followed.
        me = asyncio.current_task()

        def current() -> bool:
            return self._followers.get(prefix) is me

        while current():
            try:
                async for change in self.store.watch_prefix(prefix, revision):
                    if not current():
                        return
                    self._apply(prefix, change.key, change.value, change.revision)
            except WatchBroken as exc:
                log.info("%s; reading %s afresh", exc, prefix)
            except Exception:  # whatever else ended it, the copy must not go stale: read afresh
                log.exception("following %s failed; reading it afresh", prefix)
            while current():
                await asyncio.sleep(RESYNC_PAUSE_S)
                try:
                    found, revision = await self.store.read_prefix(prefix)
                except StoreUnavailable as exc:
                    log.warning("re-reading %s failed (%s); trying again", prefix, exc)
                    continue
                if current():
                    self._install(prefix, found, revision)
                    self.resyncs += 1
                break

    def _apply(self, prefix: str, key: str, value: Any | None, revision: int) -> None:
        entries = self._entries.get(prefix)
        if entries is None:
            return  # no longer followed
        held = entries.get(key)
        if held is not None and held[1] > revision:
            return  # a newer value this process wrote is already here
        if self._deleted.get(key, 0) > revision:
            return  # this process deleted it after this change
        self._deleted.pop(key, None)
        if value is None:
            entries.pop(key, None)
        else:
            entries[key] = (value, revision)
        if self.listener is not None:
            self.listener.changed(prefix, key, value)

    def applied(self, puts: dict[str, Any], deletes: tuple[str, ...] | set[str], revision: int) -> None:
        """Writes this process made at ``revision`` (or later: a revision too low only lets a change that
        is in fact older through, and the watch then brings these writes again), applied before their
        watch brings them."""
        for key, value in puts.items():
            prefix = self._prefix_of(key)
            if prefix is not None:
                self._apply(prefix, key, value, revision)
        for key in deletes:
            prefix = self._prefix_of(key)
            if prefix is not None:
                self._apply(prefix, key, None, revision)
                self._deleted[key] = revision

    def _prefix_of(self, key: str) -> str | None:
        return next((prefix for prefix in self._entries if key.startswith(prefix)), None)

    def get_with_revision(self, key: str) -> tuple[Any | None, int]:
        """A key's value and mod revision (None, 0 when absent), as ``Store.get_with_revision``; the key
        is under a followed prefix."""
        held = self._entries[self._prefix_of(key)].get(key)
        return (None, 0) if held is None else held
