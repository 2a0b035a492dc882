"""Starting an HTTP server as a subprocess on a free loopback port and stopping it: the
tests, the benchmark and the example start ``impress-cache serve`` (and ``transformers
serve``) this way. Not used by the server itself."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """GET (``body`` None) or POST JSON (``body`` bytes are sent as they are); returns
    ``(status, parsed body or text)``. HTTP errors are returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


class ServerProcess:
    """``command`` run as a subprocess (its own process group); `start` waits until
    ``ready_path`` answers 200. A context manager: leaving it stops the server."""

    def __init__(self, command: Sequence[str], port: int, log_file: str | Path | None = None,
                 ready_path: str = "/health", env: dict[str, str] | None = None) -> None:
        self.command, self.port, self.ready_path = list(command), port, ready_path
        self.log_file = Path(log_file) if log_file is not None else None
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> ServerProcess:
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_file, "ab")
        out = self._log if self._log is not None else subprocess.DEVNULL
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready: "
                                   f"{' '.join(self.command)} (log: {self.log_file})")
            try:
                if http_json(self.url + self.ready_path, timeout=5)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"the server did not answer {self.ready_path} within {timeout:.0f} s: {' '.join(self.command)}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (a graceful shutdown: the stores are closed), SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the server %d did not stop within %.0f s; killing it", proc.pid, timeout)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def impress_serve_command(model: str | Path, store: str | Path, port: int, *extra: str) -> list[str]:
    """The command line of ``impress-cache serve`` with this interpreter."""
    return [sys.executable, "-m", "impress_cache.cli", "serve", str(model), "--store", str(store),
            "--host", "127.0.0.1", "--port", str(port), *extra]
