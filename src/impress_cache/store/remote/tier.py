"""The remote tier: a shared object store behind the local directory (docs: Several hosts).

The local store stays the index of what this host knows and the only place requests read
from. `RemoteTier.pull` runs when a request's prompt is not (fully) stored locally: it
looks the prompt up remotely by the hashes of its prefixes at fixed boundaries (a binary
search over lookup keys), downloads the objects holding the longest stored prefix, checks
every byte (`objects.parse_object`) and links them into the local store as chunk files
and radix nodes; the request then matches locally and reuses exactly as if this host had
written them. `RemoteTier.push` runs after a prompt was written locally: a background
thread uploads its chunk files, then the manifest, then the lookup keys (so a prompt is
advertised only once its data is complete), retrying until ``remote_retry_s`` has passed.

Every remote failure (unreachable, slow, missing, damaged, foreign) costs a recompute and
one warning per kind, never a failed request or wrong K/V.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np

from ...config import ImpressConfig
from ...index.radix import RadixNode
from ...index.sqlite import FileRecord
from ...model_info import ModelSpec
from ...storage.remote import RemoteEntry, RemoteError, RemoteMissing, RemoteShort, open_remote
from ..binding import ProbeSpec
from ..catalog import Catalog
from ..namespaces import namespaced
from .lazy import RemoteFiles
from .objects import (
    BadObject, ChainEntry, Manifest, boundaries, header_length, key_name, manifest_name, namespace, parse_object,
    use_name,
)

log = logging.getLogger(__name__)

#: seconds an object that failed its checks is not imported again by this process
BAD_COOLDOWN_S = 60.0
#: seconds lookups are skipped after one failed on an unreachable or slow server
DOWN_BACKOFF_S = 10.0
#: seconds a remote found failing (`RemoteTier.check`) is left alone before it is checked again
RECHECK_S = 60.0
#: bytes asked for first when an object's header is fetched
HEADER_GUESS = 64 * 1024

#: called after an import is committed: (file_id, blocks per layer, new leaf)
OnImported = Callable[[int, int, "RadixNode | None"], None]


@dataclass
class RemoteCounters:
    lookups: int = 0
    lookup_hits: int = 0
    tokens_imported: int = 0
    objects_linked: int = 0
    ranges_fetched: int = 0
    bytes_downloaded: int = 0
    objects_uploaded: int = 0
    bytes_uploaded: int = 0
    #: bytes of local chunk files read by uploads (a header per file; the whole file only when uploaded)
    local_bytes_read: int = 0
    prompts_advertised: int = 0
    uploads_dropped: int = 0
    bad_objects: int = 0
    remote_errors: int = 0
    objects_evicted: int = 0
    bytes_evicted: int = 0


@dataclass(frozen=True)
class _Upload:
    tokens: np.ndarray  # the stored prompt's path, [0, E)
    files: tuple[tuple[str, int, int], ...]  # (local name, first position, end used on the path)


class RemoteTier:
    def __init__(
        self, catalog: Catalog, config: ImpressConfig, spec: ModelSpec, probe: ProbeSpec,
        row_bytes: tuple[int, int], on_imported: OnImported,
    ) -> None:
        self._catalog = catalog
        self._cfg = config
        self._spec = spec
        self._probe = probe
        self._row_bytes = row_bytes
        self._on_imported = on_imported
        self.backend = open_remote(str(config.remote), config.remote_options)
        self.ns = namespace(spec, probe)
        self.counters = RemoteCounters()
        self._bad: dict[str, float] = {}  # objects that failed: not used again for BAD_COOLDOWN_S
        self.files = RemoteFiles(
            catalog.root, catalog.chunks_fd, self.backend, self._fetched, config.file_mode, config.fsync
        )
        catalog.companions = self.files  # sidecars go with their files and count in the disk budget
        self._warned: set[str] = set()
        self._import_lock = threading.Lock()
        self._down_until = 0.0  # lookups skipped until then (the server failed a request)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="impress-upload")
        self._pending: list[Future[None]] = []
        self._pending_lock = threading.Lock()
        #: ``"unchecked"``, ``"ok"`` or what failed (`check`), shown in ``stats()["remote"]``
        self.state = "unchecked"
        self._failing_until = 0.0
        # checked once at open, on the upload thread (opening does not wait for the network):
        # uploads queued behind it see the answer
        with self._pending_lock:
            self._pending.append(self._pool.submit(self.check))

    # -- faults ----------------------------------------------------------------------
    def _fetched(self, ranges: int, nbytes: int) -> None:
        self.counters.ranges_fetched += ranges
        self.counters.bytes_downloaded += nbytes

    def quarantined(self, record: FileRecord | None) -> None:
        """A local file failed (a damaged block, a fetch that failed): the object it came
        from is not imported again for a while."""
        if record is None:
            return
        local = record.name
        obj = self.files.object_of(local)
        if obj is not None:
            self._bad[obj] = time.monotonic()
            self.counters.bad_objects += 1
            self.files.drop(local)

    def _is_bad(self, obj: str) -> bool:
        t = self._bad.get(obj)
        return t is not None and time.monotonic() - t < BAD_COOLDOWN_S

    def _warn(self, kind: str, exc: BaseException) -> None:
        if isinstance(exc, BadObject):
            self.counters.bad_objects += 1
        else:
            self.counters.remote_errors += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("remote tier %s: %s (recomputing; further such messages at debug level)", kind, exc)
        else:
            log.debug("remote tier %s: %s", kind, exc)

    def check(self) -> bool:
        """Ask the remote whether it can be used (`RemoteBackend.check`, one request).
        When it cannot, one warning names the bucket, the endpoint and what failed, and
        lookups and uploads leave it alone for `RECHECK_S` seconds (an upload is dropped
        at once instead of retried for ``remote_retry_s``). Returns whether it is usable."""
        problem = self.backend.check()
        was = self.state
        self.state = "ok" if problem is None else problem
        if problem is None:
            if was not in ("ok", "unchecked"):
                log.warning("remote tier %s answers again", self._cfg.remote)
            self._failing_until = 0.0
            return True
        self._failing_until = time.monotonic() + RECHECK_S
        self._down_until = max(self._down_until, self._failing_until)
        if problem != was:
            log.warning(
                "remote tier %s cannot be used: %s. The store works locally; prompts are not shared until the "
                "remote answers (checked again every %.0f s).", self._cfg.remote, problem, RECHECK_S,
            )
        return False

    def _usable(self) -> bool:
        """Whether uploads should try the remote now (a failing one is checked again
        every `RECHECK_S` seconds)."""
        if self.state in ("ok", "unchecked"):
            return True
        return time.monotonic() >= self._failing_until and self.check()

    # -- lookups and imports ------------------------------------------------------------
    def pull(self, tokens: np.ndarray, limit: int | None) -> int:
        """Import from the remote the longest stored prefix of ``tokens[:limit]`` that is
        longer than the local match; returns the tokens now matched locally beyond it."""
        if namespaced(tokens):  # namespaces' ids are per store: only the default namespace travels
            return 0
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        local = self._catalog.match(tokens, limit).length
        cands = [b for b in boundaries(limit, self._cfg.remote_key_tokens) if b > local]
        if not cands or time.monotonic() < self._down_until:
            return 0
        self.counters.lookups += 1
        try:
            manifest = self._find(tokens, cands)
            if manifest is None:
                return 0
            with self._import_lock:
                self._import(tokens[:limit], manifest)
        except BadObject as exc:
            self._warn("object check", exc)
        except RemoteError as exc:
            if not isinstance(exc, RemoteMissing):
                self._down_until = time.monotonic() + DOWN_BACKOFF_S
            self._warn("request", exc)
        except OSError as exc:  # a local write of the pull (no space, a file gone): compute instead
            self._warn("local write", exc)
        gained = self._catalog.match(tokens, limit).length - local
        if gained > 0:
            self.counters.lookup_hits += 1
            self.counters.tokens_imported += gained
        return max(gained, 0)

    def _find(self, tokens: np.ndarray, cands: list[int]) -> Manifest | None:
        """Binary search for the longest boundary with a lookup key, then its manifest."""
        lo, hi, found = 0, len(cands) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                found = self.backend.get(key_name(self.ns, tokens[: cands[mid]]))
                self.counters.bytes_downloaded += len(found)
                lo = mid + 1
            except RemoteMissing:
                hi = mid - 1
        if found is None:
            return None
        try:
            man = str(json.loads(found)["manifest"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadObject(f"unreadable lookup key: {exc}") from exc
        if not man.startswith(f"m-{self.ns}/man/"):
            raise BadObject("lookup key points outside this model's namespace")
        try:
            raw = self.backend.get(man)
            self.counters.bytes_downloaded += len(raw)
            return Manifest.decode(raw, self.ns)
        except RemoteMissing:
            return None

    def _import(self, prompt: np.ndarray, manifest: Manifest) -> None:
        n = min(len(prompt), len(manifest.tokens))
        diff = np.flatnonzero(prompt[:n] != manifest.tokens[:n])
        common = int(diff[0]) if len(diff) else n
        for entry in manifest.chain:
            if entry.start >= common:
                break
            if self._catalog.match(manifest.tokens[: entry.end]).length >= entry.end:
                continue  # this host has these rows already
            if self._is_bad(entry.object):
                return
            self._import_object(entry, manifest)

    def _import_object(self, entry: ChainEntry, manifest: Manifest) -> None:
        """Link one object into the local store: its header now, its blocks when read."""
        try:
            head = self.backend.get_ranges(entry.object, [(0, min(entry.size, HEADER_GUESS))])[0]
            n = header_length(head)
            if n > len(head):
                if n > entry.size:
                    raise BadObject("header larger than the object")
                head += self.backend.get_ranges(entry.object, [(len(head), n)])[0]
            head = head[:n]
            self.counters.bytes_downloaded += len(head)
            parsed = parse_object(head, entry.object, self.ns, self._spec, self._probe, self._row_bytes, size=entry.size)
            if parsed.new_file.first_pos != entry.start or not np.array_equal(
                parsed.tokens[: entry.end], manifest.tokens[: entry.end]
            ):
                raise BadObject("object does not hold the rows its manifest lists")
        except RemoteShort as exc:
            self._bad[entry.object] = time.monotonic()
            raise BadObject(f"object shorter than its manifest says: {exc}") from exc
        except BadObject:
            self._bad[entry.object] = time.monotonic()
            raise
        cat = self._catalog
        name = parsed.file_name
        if os.path.lexists(cat.chunks / name):
            return  # this host holds that file already (under another path)
        if cat.match(parsed.tokens).length < parsed.new_file.first_pos:
            return  # the prefix it extends is not here (removed meanwhile)
        with cat.gate.creating():  # (the leftover scan waits)
            if not self.files.create(name, entry.object, entry.size, head):
                return  # another process of this directory linked it first: its file, not ours to remove
            # (a discarded file's sidecar goes with it)
            done = cat.commit_or_discard(
                name, lambda: cat.commit_prompt(parsed.tokens, parsed.new_file.first_pos, parsed.new_file)
            )
            if done is None:
                return
        self.counters.objects_linked += 1
        file_id, leaf = done
        self._on_imported(file_id, parsed.new_file.offsets.shape[2], leaf)
        try:
            self.backend.put(use_name(entry.object), b"")
        except RemoteError as exc:
            self._warn("recency marker", exc)

    # -- uploads -----------------------------------------------------------------------
    def push(self, leaf: RadixNode | None) -> None:
        """Upload the stored prompt ending at ``leaf`` in the background (called after the
        local commit, on the writer thread; ``None``: nothing to upload)."""
        if leaf is None:
            return
        with self._catalog.lock:
            path = leaf.path()
            files: list[list] = []
            pos = 0
            for nd in path:
                rec = self._catalog.records.get(nd.file_id)
                if rec is None or rec.format != "safetensors":
                    return  # only safetensors files travel (docs: Several hosts)
                if files and files[-1][0] == rec.name:
                    files[-1][2] = pos + len(nd.tokens)
                else:
                    files.append([rec.name, rec.first_pos, pos + len(nd.tokens)])
                pos += len(nd.tokens)
            tokens = leaf.path_tokens().astype(np.int64)
        if pos == 0 or namespaced(tokens):
            return
        job = _Upload(tokens, tuple((a, b, c) for a, b, c in files))
        try:
            fut = self._pool.submit(self._upload_retrying, job)
        except RuntimeError:
            return  # closed
        with self._pending_lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]

    def _upload_retrying(self, job: _Upload) -> None:
        deadline = time.monotonic() + self._cfg.remote_retry_s
        delay = 0.1
        while True:
            if not self._usable():  # known to fail: not retried for remote_retry_s per prompt
                self.counters.uploads_dropped += 1
                log.debug("remote tier: not uploading a %d-token prompt: %s", len(job.tokens), self.state)
                return
            try:
                self._upload(job)
                return
            except Exception as exc:  # noqa: BLE001 - an upload never fails the store
                if isinstance(exc, RemoteError):
                    self.counters.remote_errors += 1
                    if not self.check():  # the remote started failing: dropped now (check warned)
                        self.counters.uploads_dropped += 1
                        return
                if time.monotonic() + delay > deadline or self._stop.is_set():
                    self.counters.uploads_dropped += 1
                    log.warning(
                        "remote tier: dropping the upload of a %d-token prompt after retrying for %.0f s: %s",
                        len(job.tokens), self._cfg.remote_retry_s, exc,
                    )
                    return
                log.debug("remote tier: upload failed (%s); retrying in %.1f s", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)

    def _upload(self, job: _Upload) -> None:
        # every object the manifest lists is checked on the server now (HEAD), never taken
        # from what this process saw earlier: another host may have evicted it meanwhile
        chain = []
        for local, first_pos, end in job.files:
            linked = self.files.object_of(local)
            if linked is not None:  # imported from the remote, not all here: it is there
                size = self.backend.head(linked)
                if size is None:
                    log.debug("remote tier: %s was evicted remotely; not uploading a prompt that needs it", linked)
                    return
                self.backend.put(use_name(linked), b"")  # advertised again: recent for the remote budget
                chain.append(ChainEntry(linked, first_pos, end, size))
                continue
            try:
                fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._catalog.chunks_fd)
            except FileNotFoundError:
                log.debug("remote tier: %s is gone locally; not uploading its prompt", local)
                return
            with os.fdopen(fd, "rb") as f:
                name, size = self._offer(f)
            chain.append(ChainEntry(name, first_pos, end, size))
        manifest = Manifest(job.tokens, tuple(chain))
        man = manifest_name(self.ns, job.tokens, [c.object for c in chain])
        raw = manifest.encode()
        self.backend.put(man, raw)
        pointer = json.dumps({"manifest": man}).encode()
        for b in boundaries(len(job.tokens), self._cfg.remote_key_tokens):
            self.backend.put(key_name(self.ns, job.tokens[:b]), pointer)
        self.counters.prompts_advertised += 1
        if self._cfg.remote_bytes is not None:
            self.enforce_budget(keep={c.object for c in chain})

    def _offer(self, f: BinaryIO) -> tuple[str, int]:
        """Upload a local chunk file unless its object is on the server already; returns
        the object's name and size. The header alone names the object: it is read, the
        object looked up (HEAD), and the whole file read and checked only when it must be
        uploaded (a damaged file is never uploaded; the name carries the file's UUID, so
        no other file's object is ever overwritten)."""
        size = os.fstat(f.fileno()).st_size
        head = self._read_local(f, 8)
        n = header_length(head)
        if n > size:
            raise BadObject("local file shorter than its header")
        head += self._read_local(f, n - len(head))
        name = parse_object(head, None, self.ns, self._spec, self._probe, self._row_bytes, size=size).object
        if self.backend.head(name) == size:
            self.backend.put(use_name(name), b"")  # advertised again: recent for the remote budget
            return name, size
        data = head + self._read_local(f, size - len(head))
        parse_object(data, name, self.ns, self._spec, self._probe, self._row_bytes)  # BadObject if it changed meanwhile
        self.backend.put(name, data)
        self.counters.objects_uploaded += 1
        self.counters.bytes_uploaded += len(data)
        return name, size

    def _read_local(self, f: BinaryIO, n: int) -> bytes:
        data = f.read(n)
        self.counters.local_bytes_read += len(data)
        if len(data) != n:
            raise BadObject("local file shorter than its header says")
        return data

    # -- remote space ------------------------------------------------------------------
    def enforce_budget(self, keep: set[str] = frozenset()) -> dict[str, int]:  # type: ignore[assignment]
        """Delete the least recently used objects of this model until they fit
        ``remote_bytes``; objects younger than ``remote_grace_s`` (by the server's
        clock) stay, so other hosts can finish reading what they just found."""
        budget = self._cfg.remote_bytes
        objs = self.backend.list(f"m-{self.ns}/obj/")
        total = sum(o.size for o in objs)
        out = {"remote_bytes": total, "evicted_objects": 0, "evicted_bytes": 0}
        if budget is None or total <= budget:
            return out
        uses = {o.name: o.mtime for o in self.backend.list(f"m-{self.ns}/use/")}
        now = time.time()
        def used_at(o: RemoteEntry) -> float:
            return max(o.mtime, uses.get(use_name(o.name), 0.0))

        # the grace period counts from the last upload or link: a host that just found an
        # object can read it
        cands = [o for o in objs if o.name not in keep and now - used_at(o) >= self._cfg.remote_grace_s]
        cands.sort(key=used_at)
        for o in cands:
            if total <= budget:
                break
            self.backend.delete([o.name, use_name(o.name)])
            total -= o.size
            out["evicted_objects"] += 1
            out["evicted_bytes"] += o.size
        self.counters.objects_evicted += out["evicted_objects"]
        self.counters.bytes_evicted += out["evicted_bytes"]
        out["remote_bytes"] = total
        return out

    # -- life cycle ----------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for pending uploads (each ends uploaded or dropped within ``remote_retry_s``)
        and write the sidecars of linked files filled since their last save."""
        while True:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            if not pending:
                break
            for f in pending:
                f.result()
        self.files.save()

    def close(self) -> None:
        self.flush()
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._catalog.companions = None
        self.files.close()
        self.backend.close()

    def stats(self) -> dict[str, int | str]:
        return {**asdict(self.counters), "state": self.state}

