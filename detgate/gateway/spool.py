"""The record spool: where records wait while Redis is unreachable, until they are drained.

An append-only file, one JSON line `{"tenant", "record"}` per record, each append written and
fsynced before the client is told success, bounded by `max_bytes`. Entries are drained into
Redis in the order they were appended; the file is emptied only once every entry in it is in
Redis, so a crash at any point loses nothing that was acknowledged: the entries found at start
are drained first. A failed append is cut off again (never a torn line before the next one);
a torn last line after a crash was never acknowledged and is skipped.

An exclusive lock on the file keeps a second gateway with the same key prefix off it.

`has_room` says whether a next record would fit, so that a request is refused before any
work rather than after (readiness says the same): it keeps room for the largest record line
seen so far (at least a sixteenth of the spool, at most 64 KiB), and is false after a write
failed (a full disk, a read-only file system) until a probe write beside the file succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger("detgate.gateway")

MIN_HEADROOM = 64 << 10


class SpoolFull(Exception):
    """No room (or no writable file) for another record."""


@dataclass
class Entry:
    tenant: str
    record: dict


class Spool:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.entries: deque[Entry] = deque()
        self.by_id: dict[tuple[str, str], dict] = {}  # what GET /v1/requests/{id} may read
        self.bytes = 0
        self.broken: str | None = None
        self.failing: str | None = None  # the last write's error, until a probe succeeds
        self.largest = min(MIN_HEADROOM, max_bytes // 16)  # of the record lines tried
        self._fd: int | None = None
        self._append_lock = asyncio.Lock()
        self._drain_lock = asyncio.Lock()

    def open(self) -> None:
        """Open (or create) the file and load what a previous process left in it."""
        if self.max_bytes <= 0:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise OSError(f"{self.path} is in use by another gateway") from None
            self._fd = fd
            self._load()
        except OSError as exc:
            self.broken = str(exc)
            log.warning("record spool unusable (%s): a Redis outage will answer 503", exc)
            return
        if self.entries:
            log.warning("record spool holds %d record(s) from before; draining them into Redis",
                        len(self.entries))

    def _load(self) -> None:
        with open(self._fd, "rb", closefd=False) as f:
            data = f.read()
        good = 0
        for line in data.split(b"\n")[:-1]:  # a last piece without newline is a torn append
            try:
                item = orjson.loads(line)
                entry = Entry(item["tenant"], item["record"])
            except (orjson.JSONDecodeError, KeyError, TypeError):
                break
            self._add(entry)
            good += len(line) + 1
        if good != len(data):
            os.ftruncate(self._fd, good)
        self.bytes = good

    def _add(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.by_id[(entry.tenant, entry.record["id"])] = entry.record

    @property
    def depth(self) -> int:
        return len(self.entries)

    def has_room(self) -> bool:
        return self._fd is not None and self.broken is None and self.failing is None \
            and self.bytes + self.largest <= self.max_bytes

    async def append(self, tenant: str, record: dict) -> None:
        """Durable once this returns: written and fsynced. SpoolFull when it cannot be."""
        line = orjson.dumps({"tenant": tenant, "record": record}) + b"\n"
        async with self._append_lock:
            self.largest = max(self.largest, len(line))
            if self._fd is None or self.broken is not None:
                raise SpoolFull("the record spool is not writable")
            if self.bytes + len(line) > self.max_bytes:
                raise SpoolFull("the record spool is full")
            try:
                await asyncio.to_thread(self._write, line, self.bytes)
            except OSError as exc:
                log.warning("record spool append failed: %s", exc)
                self.failing = str(exc)
                raise SpoolFull(f"the record spool is not writable: {exc}") from exc
            self.bytes += len(line)
            self._add(Entry(tenant, record))

    async def probe(self) -> None:
        """After a failed write: try a write as large as the largest record beside the file;
        `failing` is cleared when it succeeds."""
        if self.failing is None:
            return
        try:
            await asyncio.to_thread(self._probe)
        except OSError as exc:
            self.failing = str(exc)
            return
        log.warning("record spool writable again")
        self.failing = None

    def _probe(self) -> None:
        probe = self.path.with_suffix(".probe")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(bytes(self.largest))
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)

    def _write(self, line: bytes, size: int) -> None:
        assert self._fd is not None
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            os.ftruncate(self._fd, size)  # no torn line in front of the next append
            raise

    async def drain(self, write: Callable[[str, dict], Awaitable[None]]) -> int:
        """Write entries into Redis oldest first; stops at the first failure (raised)."""
        done = 0
        async with self._drain_lock:
            while self.entries:
                head = self.entries[0]
                await write(head.tenant, head.record)
                self.entries.popleft()
                self.by_id.pop((head.tenant, head.record["id"]), None)
                done += 1
            async with self._append_lock:
                if not self.entries and self.bytes and self._fd is not None:
                    await asyncio.to_thread(self._empty)
                    self.bytes = 0
        if done:
            log.warning("record spool drained: %d record(s) now in Redis", done)
        return done

    def _empty(self) -> None:
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
