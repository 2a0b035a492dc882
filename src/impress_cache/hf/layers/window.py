"""Sliding-window and chunked attention layers of an ImpressCache.

Every row of such a layer is stored (a later prompt may match anywhere), but a new token
at position ``P`` sees only positions after ``P - window``: a request reads only the last
``window - 1`` rows before its match point (the rows transformers' own
`DynamicSlidingWindowLayer` keeps) and holds them as the rows after ``hidden`` others.
The model builds the sliding (or chunked) mask from the first sliding layer's
``get_mask_sizes``, which tells it where the held rows sit, so the result is exact.
"""

from __future__ import annotations

from .full import ImpressLayer


class ImpressWindowLayer(ImpressLayer):
    """An `ImpressLayer` that holds only the rows its window still sees (how many: the
    request's `held_rows`; ``is_sliding`` tells the mask helpers to build this layer's
    mask with the window)."""

    is_sliding = True
