"""The store's cost model: exact reuse or sparse loading, per request (``important_ratio="auto"``).

Sparse loading reads fewer bytes but pays for choosing them (scoring the probe copy,
per row and layer), for reads scattered over the chosen blocks, and, with
``decode="full"``, for the uncertainty guard that sometimes reads the rest of the prefix
before the first token. Whether that pays depends on where the blocks are and on this
machine: on a fast local disk (or the page cache, or a memory tier) exact reuse's reads
hide behind the prefill and sparse loading only adds work; on a slow disk or a remote
tier the bytes dominate. So the store measures, from the requests it serves:

* ``bw_<source>``: bytes per second a whole-prefix read delivers (``disk`` or
  ``remote``: a prefix with blocks in a remote-linked file), from exact requests' loads
  and from the background read of the whole prefix after a sparse prefill;
* ``compute_row``: seconds of prefill that are not waiting for reads, per prefix row
  (exact requests);
* ``select_row``: seconds of scoring and choosing, per prefix row and scored layer
  (sparse requests; before the first one, a calibration of the scorer on this machine);
* ``sparse_read``: seconds the prefill waits per byte of chosen blocks (sparse requests;
  before the first one, ``1 / bw``);
* ``guard_rate``: share of sparse prefills whose guard read the rest before the first
  token.

and predicts a request's time to the first token both ways:

* exact: ``max(compute_row * P, full_bytes / bw)`` (reads run beside the prefill);
* sparse: ``compute_row * P + select_row * P * layers + sparse_read * sparse_bytes +
  guard_rate * rest_bytes / bw`` (the compute term is exact's, an overestimate, so the
  model leans to exact reuse).

Sparse loading is chosen only when its prediction is below `MARGIN` times exact's.
Until a source's bandwidth and the compute are measured, requests reuse exactly (that
first request measures them). Every value is an exponentially weighted mean (weight
`ALPHA` for the newest), so the model follows a disk that gets faster (the page cache)
or slower. The values persist in ``costs.json`` in the store's folder (written at
`flush` and close, atomically); a store opened read-only keeps them in memory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .directory import write_file

log = logging.getLogger(__name__)

FILE = "costs.json"
#: weight of the newest observation in every mean
ALPHA = 0.3
#: sparse loading must be predicted this much faster than exact reuse
MARGIN = 0.9
#: guard rate assumed before any sparse request was measured
PRIOR_GUARD_RATE = 0.2
#: reads smaller than this say more about latency than bandwidth: not used for ``bw``
MIN_BW_BYTES = 1 << 20
#: chosen-block bytes below this do not measure ``sparse_read``
MIN_SPARSE_BYTES = 1 << 18
SOURCES = ("disk", "remote")
_KEYS = tuple(f"bw_{s}" for s in SOURCES) + ("compute_row", "select_row", "sparse_read", "guard_rate")


@dataclass(frozen=True)
class Plan:
    """What `CostModel.plan` chose for one request, and why."""

    mode: str  #: ``"exact"`` or ``"sparse"``
    reason: str
    exact_seconds: float | None = None  #: predicted time to the first token, exact reuse
    sparse_seconds: float | None = None  #: the same for sparse loading


class CostModel:
    """Measured costs of this store's reads and of this machine's selection (thread-safe)."""

    def __init__(
        self, folder: Path | None = None, select_prior: Callable[[], float] | None = None, file_mode: int = 0o644,
    ) -> None:
        #: where ``costs.json`` lives (``None``: kept in memory only)
        self.folder = folder
        self._mode = file_mode
        #: ``() -> seconds per row and layer`` of selection before any was measured
        self.select_prior = select_prior
        self._lock = threading.Lock()
        self.values: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self._dirty = False

    # -- persistence --------------------------------------------------------------------
    @classmethod
    def load(cls, folder: Path, writable: bool, file_mode: int = 0o644) -> CostModel:
        """The model saved in ``folder`` (a missing or unreadable file: an empty model)."""
        model = cls(folder if writable else None, file_mode=file_mode)
        try:
            saved = json.loads((folder / FILE).read_text())
            values, counts = saved["values"], saved["counts"]
            for key in _KEYS:
                v = values.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v) and v >= 0:
                    model.values[key] = float(v)
                    model.counts[key] = int(counts.get(key, 1))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring the saved cost model in %s (measuring again): %s", folder / FILE, exc)
        return model

    def save(self) -> None:
        """Write ``costs.json`` if anything changed since the last save."""
        with self._lock:
            if self.folder is None or not self._dirty:
                return
            data = json.dumps({"version": 1, "values": self.values, "counts": self.counts}, indent=1).encode()
            self._dirty = False
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            write_file(fd, FILE, data, self._mode, fsync=False)
        except OSError as exc:  # a cost model is advice: never fail a flush for it
            log.warning("could not save the cost model in %s: %s", self.folder, exc)
        finally:
            os.close(fd)

    # -- observations -----------------------------------------------------------------------
    def _add(self, key: str, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            return
        with self._lock:
            old = self.values.get(key)
            self.values[key] = value if old is None else (1 - ALPHA) * old + ALPHA * value
            self.counts[key] = self.counts.get(key, 0) + 1
            self._dirty = True

    def observe_read(self, source: str, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` of a prefix's blocks took ``seconds`` (wall time)."""
        if nbytes >= MIN_BW_BYTES and seconds > 0:
            self._add(f"bw_{source}", nbytes / seconds)

    def observe_exact(self, rows: int, prefill_seconds: float, io_wait_seconds: float) -> None:
        """An exact request's prefill over ``rows`` prefix rows."""
        if rows > 0:
            self._add("compute_row", max(0.0, prefill_seconds - io_wait_seconds) / rows)

    def observe_sparse(self, rows: int, layers: int, select_seconds: float, io_wait_seconds: float, chosen_bytes: int) -> None:
        """A sparse prefill over ``rows`` prefix rows in ``layers`` scored layers."""
        if rows > 0 and layers > 0:
            self._add("select_row", select_seconds / (rows * layers))
        if chosen_bytes >= MIN_SPARSE_BYTES:
            self._add("sparse_read", io_wait_seconds / chosen_bytes)

    def observe_guard(self, fired: bool) -> None:
        """The uncertainty guard of a sparse prefill read the rest of the prefix, or not."""
        self._add("guard_rate", 1.0 if fired else 0.0)

    # -- the decision -----------------------------------------------------------------------
    def plan(
        self, source: str, rows: int, layers: int, full_bytes: int, sparse_bytes: int, guard: bool,
    ) -> Plan:
        """Exact reuse or sparse loading for a prefix of ``rows`` rows whose whole read is
        ``full_bytes`` from ``source`` (memory-tier hits left out) and whose sparse read
        is ``sparse_bytes`` (probe copy included), with ``layers`` layers that would score."""
        with self._lock:
            v = dict(self.values)
        bw, compute = v.get(f"bw_{source}"), v.get("compute_row")
        if full_bytes <= 0:
            return Plan("exact", "the prefix is in the memory tiers")
        if bw is None or compute is None:
            return Plan("exact", f"no read from {source} measured yet")
        select = v.get("select_row")
        if select is None:
            select = self.select_prior() if self.select_prior is not None else 0.0
        exact = max(compute * rows, full_bytes / bw)
        sparse = (
            compute * rows + select * rows * layers + v.get("sparse_read", 1 / bw) * sparse_bytes
            + (v.get("guard_rate", PRIOR_GUARD_RATE) if guard else 0.0) * max(0, full_bytes - sparse_bytes) / bw
        )
        if sparse < MARGIN * exact:
            return Plan("sparse", f"predicted {sparse:.3f} s against {exact:.3f} s exact", exact, sparse)
        return Plan("exact", f"predicted {exact:.3f} s against {sparse:.3f} s sparse", exact, sparse)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)
