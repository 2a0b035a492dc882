"""S3-compatible object stores (AWS S3, SeaweedFS, MinIO, ...) through s3fs.

s3fs (fsspec) is the S3 client most of the Python data stack already uses; it talks to
any endpoint (``remote_options={"client_kwargs": {"endpoint_url": ...}}``), has
concurrent ranged reads (`cat_ranges`) and an async core, so several ranges of an object
are fetched at once without a thread per request. Timeouts are short and retries few by
default: a slow or absent server must cost a request a recompute, not minutes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .remote import RemoteBackend, RemoteEntry, RemoteError, RemoteMissing, RemoteShort

#: client defaults; any of them can be overridden in ``remote_options``
DEFAULT_OPTIONS: dict[str, Any] = {
    "connect_timeout": 2,
    "read_timeout": 10,
    "retries": 2,
}


def _wrap(exc: BaseException, what: str) -> RemoteError:
    if isinstance(exc, FileNotFoundError):
        return RemoteMissing(f"{what}: not found")
    return RemoteError(f"{what}: {type(exc).__name__}: {exc}")


class S3Backend(RemoteBackend):
    def __init__(self, bucket: str, prefix: str, options: dict[str, Any]) -> None:
        import s3fs

        if len(bucket) < 3:
            raise RemoteError(f"S3 bucket names have at least 3 characters, got {bucket!r}")
        opts = {**DEFAULT_OPTIONS, **options}
        retries = int(opts.pop("retries"))
        config = dict(opts.pop("config_kwargs", {}))
        config.setdefault("connect_timeout", opts.pop("connect_timeout"))
        config.setdefault("read_timeout", opts.pop("read_timeout"))
        config.setdefault("retries", {"max_attempts": 1})
        config.setdefault("max_pool_connections", 32)  # ranges of a read are fetched concurrently
        # no listings cache: `head` must see objects other hosts added (or removed) after a `list`
        self.fs = s3fs.S3FileSystem(config_kwargs=config, skip_instance_cache=True, **{"use_listings_cache": False, **opts})
        self.fs.retries = max(1, retries)
        self.root = f"{bucket}/{prefix}".rstrip("/")
        self.bucket = bucket
        self.endpoint = str(opts.get("client_kwargs", {}).get("endpoint_url") or "the default S3 endpoint")

    def check(self) -> str | None:
        """One ``HEAD`` of the bucket: ``None`` when it answers, else what failed."""
        where = f"bucket {self.bucket!r} at {self.endpoint}"
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            return f"{where} does not exist"
        except PermissionError as exc:
            return f"{where} refuses these credentials ({exc})"
        except Exception as exc:  # noqa: BLE001 - unreachable, slow, anything else
            return f"{where} cannot be reached ({type(exc).__name__}: {exc})"
        return None

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests and the demo)."""
        try:
            if not self.fs.exists(self.bucket):
                self.fs.mkdir(self.bucket)
        except Exception as exc:  # noqa: BLE001 - every client failure is a RemoteError
            raise _wrap(exc, f"bucket {self.bucket}") from exc

    def put(self, name: str, data: bytes | memoryview) -> None:
        try:
            self.fs.pipe_file(self._path(name), bytes(data))
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, f"put {name}") from exc

    def get(self, name: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(name))
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, f"get {name}") from exc

    def get_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        path = self._path(name)
        try:
            out = self.fs.cat_ranges(
                [path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges], on_error="return"
            )
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, f"get ranges of {name}") from exc
        for got, (start, end) in zip(out, ranges):
            if isinstance(got, BaseException):
                raise _wrap(got, f"get {name}[{start}:{end}]") from got
            if len(got) != end - start:
                raise RemoteShort(f"get {name}[{start}:{end}]: {len(got)} bytes returned")
        return out

    def head(self, name: str) -> int | None:
        try:
            return int(self.fs.info(self._path(name))["size"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, f"head {name}") from exc

    def list(self, prefix: str) -> list[RemoteEntry]:
        base = self._path(prefix).rstrip("/")
        try:
            self.fs.invalidate_cache(base)
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, f"list {prefix}") from exc
        out = []
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            mtime = info.get("LastModified")
            out.append(RemoteEntry(path[len(self.root) + 1 :], int(info.get("size", 0)), mtime.timestamp() if mtime else 0.0))
        return out

    def delete(self, names: Sequence[str]) -> None:
        if not names:
            return
        try:
            self.fs.rm([self._path(n) for n in names])
        except FileNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            raise _wrap(exc, "delete") from exc
