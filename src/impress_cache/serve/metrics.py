"""Prometheus metrics of a server: per request (from `ImpressCache.stats`) and per store
(from ``store.stats()`` of the open tenants' stores, summed: no tenant is named)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .tenancy import Tenants

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class StoreCollector(Collector):
    """Store gauges and counters, read from the open stores at every scrape."""

    def __init__(self, tenants: Tenants) -> None:
        self.tenants = tenants

    def collect(self) -> Iterator[Any]:
        stats = self.tenants.each(lambda s: s.stats())
        closed = dict(self.tenants.closed_totals)

        def total(key: str) -> float:
            return float(sum(s.get(key) or 0 for s in stats))

        for name, key, doc in (
            ("impress_store_disk_bytes", "disk_bytes", "Bytes the open stores take on disk (chunk files, index, WAL)"),
            ("impress_store_nodes", "nodes", "Radix-tree nodes (stored prefixes and their shared parts) of the open stores"),
            ("impress_store_files", "files", "Chunk files of the open stores"),
        ):
            yield GaugeMetricFamily(name, doc, value=total(key))
        yield GaugeMetricFamily("impress_store_open", "Tenant stores open now", value=len(stats))
        for name, key, doc in (
            ("impress_store_prefixes_evicted", "prefixes_evicted", "Prefixes the disk budget removed"),
            ("impress_store_quarantined_files", "quarantined_files", "Damaged chunk files moved to quarantine/"),
            ("impress_store_prompts_written", "prompts_written", "Prompts written to the stores"),
        ):
            yield CounterMetricFamily(name, doc, value=total(key) + closed.get(key, 0))
        looked = CounterMetricFamily(
            "impress_store_lookup_bytes", "Block bytes looked up, by kind (kv, probe) and source tier", labels=["kind", "source"]
        )
        sums: dict[tuple[str, str], float] = {}
        for s in stats:
            for kind, entry in (s.get("lookups") or {}).items():
                for source in ("device", "host", "disk"):
                    value = (entry.get(source) or {}).get("bytes", 0)
                    sums[(kind, source)] = sums.get((kind, source), 0.0) + value
        for (kind, source), value in sorted(sums.items()):
            looked.add_metric([kind, source], value)
        yield looked
        remote = CounterMetricFamily("impress_store_remote_bytes_downloaded", "Bytes fetched from the remote tier")
        remote.add_metric([], float(sum((s.get("remote") or {}).get("bytes_downloaded", 0) for s in stats)))
        yield remote


class Metrics:
    """The server's registry (one per app: several apps in a process do not collide)."""

    def __init__(self, tenants: Tenants) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("impress_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("impress_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.matched_tokens = Counter("impress_matched_tokens", "Prompt tokens served from the store", registry=r)
        self.computed_tokens = Counter("impress_computed_tokens", "Prompt tokens the model computed", registry=r)
        self.completion_tokens = Counter("impress_completion_tokens", "Generated tokens", registry=r)
        self.bytes_read = Counter("impress_bytes_read_disk", "Bytes requests read from the stores' chunk files", registry=r)
        self.guard = Counter("impress_guard_firings", "Sparse requests whose uncertainty guard read the whole prefix", registry=r)
        self.ttft = Histogram(
            "impress_ttft_seconds", "Time from a request's arrival to its first generated token", buckets=TTFT_BUCKETS, registry=r
        )
        self.duration = Histogram(
            "impress_request_seconds", "Time from a request's arrival to its last token", buckets=TTFT_BUCKETS, registry=r
        )
        r.register(StoreCollector(tenants))

    def observe(self, stats: Any, prompt_tokens: int, completion_tokens: int, ttft: float | None, seconds: float) -> None:
        """Count one finished generation (``stats``: its `RequestStats`)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.matched_tokens.inc(stats.matched_tokens)
        self.computed_tokens.inc(stats.computed_tokens)
        self.bytes_read.inc(stats.bytes_read_disk)
        self.guard.inc(stats.guard_triggered)
        if ttft is not None:
            self.ttft.observe(ttft)
        self.duration.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServingTotals:
    """Request counters kept in ``ROOT/serving-stats.json`` across restarts, per tenant
    directory (the salts themselves are not written): what ``impress-cache stats ROOT``
    reports as hit rates. Written atomically after every request (on the inference thread)."""

    FILE = "serving-stats.json"

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / self.FILE
        self.data: dict[str, Any] = {}
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            pass
        self.data.setdefault("tenants", {})

    def add(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        for entry in (self.data, self.data["tenants"].setdefault(tenant, {})):
            entry["requests"] = entry.get("requests", 0) + 1
            entry["requests_with_cached_tokens"] = entry.get("requests_with_cached_tokens", 0) + (cached_tokens > 0)
            entry["prompt_tokens"] = entry.get("prompt_tokens", 0) + prompt_tokens
            entry["cached_tokens"] = entry.get("cached_tokens", 0) + cached_tokens
            entry["request_hit_rate"] = entry["requests_with_cached_tokens"] / entry["requests"]
            entry["token_hit_rate"] = entry["cached_tokens"] / max(1, entry["prompt_tokens"])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.path, exc)
