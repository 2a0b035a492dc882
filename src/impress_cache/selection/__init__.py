"""Choosing the important prefix rows of a layer (IMPRESS section 1).

`scores` holds the pure maths (attention column scores, top-k, Jaccard, threshold,
voting, whole-unit selection), `selectors` the per-layer selection with its fallback
and `baselines` the same-budget baselines. `modes` names them without importing torch.
"""
