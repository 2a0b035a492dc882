"""Checkpoints of the layers that keep a recurrent state (linear attention, SSM, convolution).

Such a layer's state is valid only at the exact position where it was taken: a request
can reuse a stored prefix of a hybrid model only up to a position where the state of
every state layer is known. A checkpoint holds, for one token prefix, the conv and
recurrent states of every state layer, in one safetensors file named by the SHA-256 of
the prefix's token ids (``states/<hash>.safetensors``): content-addressed, so two writers
of the same prefix write the same file, and a file is never changed once it is there.
Each file records its position, the model's weights fingerprint and a CRC-32C of its
tensors; a file that does not check out is removed and counts as absent (the request
then reuses a shorter prefix, or none). Files are written atomically (temporary name,
fsync, rename, fsync of the directory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..config import ImpressConfig
from ..errors import ImpressError
from ..model_info import ModelSpec
from .directory import dir_mode, ensure_dir, write_file

log = logging.getLogger(__name__)

#: the folder (in the store directory) of the checkpoints
STATE_DIR = "states"


def _crc(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for key in sorted(tensors):
        crc = crc32c.crc32c(tensors[key].contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


class StateCheckpoints:
    """The state checkpoints of one store (created on the first write)."""

    def __init__(
        self, root: Path, model_digest: str, file_mode: int, fsync: bool, read_only: bool,
        submit: Callable[[Callable[[], Any], Sequence[int]], Any] | None = None,
    ) -> None:
        self.dir = root / STATE_DIR
        #: runs a job on the store's writer thread (after the prompts submitted before it)
        self._submit = submit
        self._digest = model_digest
        self._mode = file_mode
        self._fsync = fsync
        self._read_only = read_only

    @classmethod
    def of(
        cls, root: Path, spec: ModelSpec, config: ImpressConfig, read_only: bool,
        submit: Callable[[Callable[[], Any], Sequence[int]], Any],
    ) -> "StateCheckpoints | None":
        """The checkpoints of a store of ``spec``'s model (None: it has no state layer)."""
        if not spec.state_layers:
            return None
        return cls(root, spec.weights_sha256, config.file_mode, config.fsync, read_only, submit)

    @staticmethod
    def usage_of(states: "StateCheckpoints | None") -> tuple[int, int]:
        """`usage`, or ``(0, 0)`` without checkpoints."""
        return states.usage() if states is not None else (0, 0)

    @staticmethod
    def name(tokens: Sequence[int] | np.ndarray) -> str:
        """The file name of the checkpoint after ``tokens``."""
        return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest() + ".safetensors"

    def put_async(self, tokens: Sequence[int], tensors: dict[str, torch.Tensor]) -> None:
        """`put` on the writer thread, after the prompt's K/V submitted before it (CPU
        copies expected); a failure is logged: a lost checkpoint costs a recompute."""
        if self._read_only:
            return
        if self._submit is None:
            self._put_logged(tokens, tensors)
            return
        try:
            self._submit(lambda: self._put_logged(tokens, tensors), tokens)
        except RuntimeError:  # the store is closing
            log.debug("the store is closing: a state checkpoint is not stored")

    def _put_logged(self, tokens: Sequence[int], tensors: dict[str, torch.Tensor]) -> None:
        try:
            self.put(tokens, tensors)
        except (OSError, ImpressError) as exc:
            log.warning("a state checkpoint was not stored: %s", exc)

    def put(self, tokens: Sequence[int] | np.ndarray, tensors: dict[str, torch.Tensor]) -> int:
        """Keep the states after ``tokens`` (CPU tensors); returns the bytes written (0
        when the checkpoint was there already, or the store is read-only)."""
        if self._read_only:
            return 0
        name = self.name(tokens)
        if (self.dir / name).exists():
            return 0
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = {"position": str(len(tokens)), "model": self._digest, "crc32c": _crc(cpu)}
        data = save_tensors(cpu, metadata=meta)
        ensure_dir(self.dir, dir_mode(self._mode), "the state checkpoints' folder")
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            written = write_file(fd, name, data, self._mode, self._fsync, replace=False)
        finally:
            os.close(fd)
        return written or 0

    def get(self, tokens: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor] | None:
        """The states after ``tokens``, or None (absent, or damaged: then removed)."""
        path = self.dir / self.name(tokens)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the state checkpoint %s: %s", path, exc)
            return None
        try:
            tensors = load_tensors(data)
            meta = _metadata(data)
            ok = (
                meta.get("position") == str(len(tokens)) and meta.get("model") == self._digest
                and meta.get("crc32c") == _crc(tensors)
            )
        except Exception as exc:  # noqa: BLE001 - any parse failure is damage
            ok, tensors = False, {}
            log.debug("state checkpoint %s does not parse: %s", path, exc)
        if not ok:
            log.warning("the state checkpoint %s is damaged or belongs to another model; it is removed", path)
            if not self._read_only:
                try:
                    path.unlink()
                except OSError:
                    pass
            return None
        return tensors

    def best(self, tokens: np.ndarray, positions: Sequence[int]) -> tuple[int, dict[str, torch.Tensor] | None]:
        """The largest of ``positions`` with a checkpoint, and its states; ``(0, None)``
        when none has one."""
        for p in sorted({int(p) for p in positions if p > 0}, reverse=True):
            got = self.get(tokens[:p])
            if got is not None:
                return p, got
        return 0, None

    def usage(self) -> tuple[int, int]:
        """Checkpoint files and the bytes they take."""
        try:
            with os.scandir(self.dir) as entries:
                sizes = [e.stat().st_blocks * 512 for e in entries if e.name.endswith(".safetensors")]
        except FileNotFoundError:
            return 0, 0
        return len(sizes), sum(sizes)


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file held in memory."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]).get("__metadata__", {}) or {}
