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
* ``compute_token``: seconds of prefill per new token, from prefills that reused
  nothing (a prompt's first request);
* ``compute_row``: seconds of prefill that are not waiting for reads, per prefix row
  (exact requests; what the new tokens cost, ``compute_token`` each, taken out);
* ``select_row``: seconds of scoring and choosing, per prefix row and scored layer, for
  `QUERY_ROWS` new tokens (sparse requests; before the first one, a calibration of the
  scorer on this machine): every new token's query scores every row, so a request with
  ``n > QUERY_ROWS`` new tokens is predicted ``n / QUERY_ROWS`` times that;
* ``sparse_read``: seconds the prefill waits per byte of chosen blocks (sparse requests;
  before the first one, ``1 / bw``);
* ``guard_rate``: share of sparse prefills whose guard read the rest before the first
  token.

and predicts the time to the first token of a request with a prefix of ``P`` rows and
``n`` new tokens both ways (``compute = compute_row * P + compute_token * n``):

* exact: ``max(compute, full_bytes / bw)`` (reads run beside the prefill);
* sparse, for each candidate ratio: ``compute + select_row * P * layers * max(1, n /
  QUERY_ROWS) + sparse_read * sparse_bytes + guard_rate * rest_bytes / bw`` (the compute
  term is exact's, an overestimate, so the model leans to exact reuse).

Sparse loading is chosen only when its prediction at the configured ratio
(``auto_ratio``) is below `MARGIN` times exact's. Among the candidate ratios (that one
and the larger `RATIOS`), the largest whose prediction is within `FREE` of the
configured ratio's, and still below `MARGIN` times exact's, is used: more rows cost
little when the compute or the guard dominates, and they only make the prefill closer to
dense reuse.
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
#: ratios larger than ``auto_ratio`` that a sparse plan may take instead ...
RATIOS = (0.25, 1 / 3, 0.5)
#: ... when predicted at most this much slower than ``auto_ratio``
FREE = 1.1
#: new tokens a ``select_row`` value stands for (the calibration's; fewer count as these)
QUERY_ROWS = 16
#: guard rate assumed before any sparse request was measured
PRIOR_GUARD_RATE = 0.2
#: reads smaller than this say more about latency than bandwidth: not used for ``bw``
MIN_BW_BYTES = 1 << 20
#: chosen-block bytes below this do not measure ``sparse_read``
MIN_SPARSE_BYTES = 1 << 18
SOURCES = ("disk", "remote")
_KEYS = tuple(f"bw_{s}" for s in SOURCES) + ("compute_token", "compute_row", "select_row", "sparse_read", "guard_rate")


@dataclass(frozen=True)
class Plan:
    """What `CostModel.plan` chose for one request, and why."""

    mode: str  #: ``"exact"`` or ``"sparse"``
    reason: str
    exact_seconds: float | None = None  #: predicted time to the first token, exact reuse
    sparse_seconds: float | None = None  #: the same for sparse loading at ``ratio``
    ratio: float | None = None  #: the share of rows a sparse plan loads per scored layer


@dataclass(frozen=True)
class Prefix:
    """What `CostModel.plan` needs to know about one request's prefix."""

    source: str  #: where its blocks are read from (`SOURCES`)
    rows: int  #: prefix rows reused
    new: int  #: new tokens the prefill computes
    layers: int  #: layers that would score (sparse)
    full_bytes: int  #: the whole read (memory-tier hits left out)
    sparse_bytes: Callable[[float], int]  #: ``ratio -> bytes`` a sparse read takes (probe copy included)
    guard: bool  #: whether the uncertainty guard may read the rest before the first token


def _query_factor(new: int) -> float:
    return max(1.0, new / QUERY_ROWS)


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

    def observe_tokens(self, new: int, prefill_seconds: float) -> None:
        """A prefill of ``new`` tokens that reused nothing."""
        if new > 0 and prefill_seconds > 0:
            self._add("compute_token", prefill_seconds / new)

    def observe_exact(self, rows: int, new: int, prefill_seconds: float, io_wait_seconds: float) -> None:
        """An exact request's prefill over ``rows`` prefix rows and ``new`` new tokens."""
        if rows > 0:
            with self._lock:
                per_token = self.values.get("compute_token", 0.0)
            self._add("compute_row", max(0.0, prefill_seconds - io_wait_seconds - per_token * new) / rows)

    def observe_sparse(
        self, rows: int, new: int, layers: int, select_seconds: float, io_wait_seconds: float, chosen_bytes: int,
    ) -> None:
        """A sparse prefill over ``rows`` prefix rows and ``new`` new tokens in ``layers`` scored layers."""
        if rows > 0 and layers > 0:
            self._add("select_row", select_seconds / (rows * layers * _query_factor(new)))
        if chosen_bytes >= MIN_SPARSE_BYTES:
            self._add("sparse_read", io_wait_seconds / chosen_bytes)

    def observe_guard(self, fired: bool) -> None:
        """The uncertainty guard of a sparse prefill read the rest of the prefix, or not."""
        self._add("guard_rate", 1.0 if fired else 0.0)

    # -- the decision -----------------------------------------------------------------------
    def plan(self, prefix: Prefix, ratio: float) -> Plan:
        """Exact reuse or sparse loading of ``prefix``, sparse at ``ratio`` or a larger
        candidate (`RATIOS`; see the module's description)."""
        with self._lock:
            v = dict(self.values)
        source = prefix.source
        bw, compute_row = v.get(f"bw_{source}"), v.get("compute_row")
        if prefix.full_bytes <= 0:
            return Plan("exact", "the prefix is in the memory tiers")
        if bw is None or compute_row is None:
            return Plan("exact", f"no read from {source} measured yet")
        select = v.get("select_row")
        if select is None:
            select = self.select_prior() if self.select_prior is not None else 0.0
        compute = compute_row * prefix.rows + v.get("compute_token", 0.0) * prefix.new
        exact = max(compute, prefix.full_bytes / bw)
        fixed = compute + select * prefix.rows * prefix.layers * _query_factor(prefix.new)
        guard_rate = v.get("guard_rate", PRIOR_GUARD_RATE) if prefix.guard else 0.0
        per_byte = v.get("sparse_read", 1 / bw)

        def sparse_at(r: float) -> float:
            nbytes = prefix.sparse_bytes(r)
            return fixed + per_byte * nbytes + guard_rate * max(0, prefix.full_bytes - nbytes) / bw

        base = sparse_at(ratio)
        if not base < MARGIN * exact:
            return Plan("exact", f"predicted {exact:.3f} s against {base:.3f} s sparse", exact, base)
        chosen, predicted = ratio, base
        for r in RATIOS:
            if r > ratio:
                t = sparse_at(r)
                if t <= FREE * base and t < MARGIN * exact:
                    chosen, predicted = r, t
        return Plan(
            "sparse", f"predicted {predicted:.3f} s at ratio {chosen:.3g} against {exact:.3f} s exact",
            exact, predicted, chosen,
        )

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values)
