"""Running the app with uvicorn (``impress-cache serve``)."""

from __future__ import annotations

import logging
from pathlib import Path

from impress_cache import ImpressConfig

from .app import create_app
from .loading import load_model

log = logging.getLogger(__name__)


def serve(
    model_path: str | Path, store: str | Path, host: str = "127.0.0.1", port: int = 8000,
    config: ImpressConfig | None = None, model_id: str | None = None, max_open_stores: int = 8,
    log_level: str = "info", answer_ids: bool = False,
) -> None:
    """Load the model at ``model_path`` and serve it on ``host:port`` until interrupted."""
    import uvicorn

    loaded = load_model(model_path, model_id)
    app = create_app(loaded, store, config, max_open_stores, answer_ids=answer_ids)
    log.info("model %s loaded (context %d); listening on http://%s:%d", loaded.model_id, loaded.context, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
