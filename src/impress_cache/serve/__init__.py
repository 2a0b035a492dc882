"""An OpenAI-compatible HTTP server over an `ImpressStore` (``impress-cache serve``).

Built on the library's public API only (`ImpressStore`, `ImpressConfig`, `ImpressCache`);
the library never imports this package. Rooms: `loading` (a model directory or a GGUF
file), `tenancy` (``cache_salt`` -> a store directory of its own), `worker` (the one
inference thread), `metrics` (Prometheus), `schemas` (request bodies, errors), `app`
(routes) and `runner` (uvicorn).
"""

from __future__ import annotations

from .app import create_app
from .loading import LoadedModel, load_model
from .runner import serve

__all__ = ["LoadedModel", "create_app", "load_model", "serve"]
