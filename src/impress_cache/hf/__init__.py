"""The transformers integration: the only package that imports ``transformers``.

`cache` holds `ImpressCache` and `ImpressLayer` (the cache protocol), `request` one
request's plan (match, lease, retry, dense or sparse, background fetch, storing the
prompt), `sparse` the per-layer selection during a sparse prefill, `hooks` the hooks a
cache needs on its model, `guards` the input checks and `compat` the differences between
supported transformers versions.
"""
