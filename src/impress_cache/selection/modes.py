"""Names of the selection modes (no torch here, so the configuration can validate them)."""

#: IMPRESS selection: ``"block"`` ranks whole blocks by summed probe scores, ``"token"``
#: votes on single rows
SELECTORS: tuple[str, ...] = ("block", "token")
#: same-budget baselines: random rows; attention sinks + most recent rows
#: (StreamingLLM-like); all keys read, then each KV head's top-k (H2O-like)
BASELINES: tuple[str, ...] = ("random", "recent", "h2o")
#: every value ``ImpressConfig.selection`` accepts
SELECTION_MODES: tuple[str, ...] = SELECTORS + BASELINES
#: how ``"block"`` and ``"token"`` selection score the prefix: ``"rows"`` every row with
#: the probed query heads, ``"bounds"`` every unit (block) by its probe keys' per-channel
#: minimum and maximum
BLOCK_SCORES: tuple[str, ...] = ("bounds", "rows")
