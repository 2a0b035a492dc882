"""ImpressCache: one request's view of an `ImpressStore`, as a transformers cache.

This module binds a cache to its prompt and speaks the transformers cache protocol; the
plan of the request lives in `request`, the sparse prefill in `sparse`, the hooks in
`hooks` and the checks in `guards`:

* a cache built without ids has every layer but no prompt (length 0) until it is bound:
  by the ``generate`` wrapper in `hooks`, or by a first forward (`ImpressCache.bind`);
* ``generate`` computes only ``input_ids.shape[1] - cache.get_seq_length()`` tokens, so
  before the first forward every layer reports the reused prefix length;
* on its first ``update`` a layer puts the stored prefix rows in front of the new ones;
* once the last layer has seen the whole prompt, the prompt's K/V go to the store's
  background writer (dense reuse) or the rest of the prefix is fetched (sparse reuse
  with ``decode="full"``).

Left padding: each row reuses the same number of columns ``C`` (the cache holds one
sequence length), ``C = min_i(pad_i + match_i)``; padding columns hold zeros, which the
attention mask hides.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..errors import CacheUsageError
from ..stats import RequestStats
from ..store.namespaces import check_namespace
from ..store.store import ImpressStore
from .guards import PromptGuard, check_inputs
from .hooks import install_hooks
from .layers import ImpressLayer, make_layers, restore_states, state_tensors
from .refresh import recompute_new_tokens
from .request import PrefixRequest


class ImpressCache(Cache):
    """A ``transformers`` cache that reuses the longest stored prefix of each prompt.

    Build it empty and give it to ``generate``; it binds to the prompt ``generate``
    receives::

        out = model.generate(**inputs, cache=ImpressCache(store), max_new_tokens=32)

    (``past_key_values=`` before transformers 5.24.)

    Parameters
    ----------
    store:
        The `ImpressStore` to read from and write to. Its model must be the one that
        runs the request.
    input_ids:
        Optional: the full prompt, ``[batch, seq]`` integer tensor, exactly as passed to
        ``generate``; the stored prefix is then found and loaded here instead of when
        ``generate`` starts. Each row reuses at most ``seq - 1`` stored tokens.
    attention_mask:
        With ``input_ids``: the mask passed to ``generate`` (left padding only).
        Required when the batch is padded.
    store_prompt:
        Write the prompt's K/V to the store once it has been computed.
    store_answer:
        When ``generate`` returns, also write the K/V of the tokens it fed back while
        decoding (the answer but its last token), so that the next turn of a
        conversation (prompt, answer, new message) matches through the answer. Only K/V
        equal to dense reuse's are stored: a sparse request's answer only after
        ``decode="full"`` restored the prefix and recomputed the new tokens
        (``refresh_new_tokens``); never with beams or repeated rows. It needs the
        ``generate`` wrapper: a model's very first ``generate`` call, looked up before
        the first ImpressCache installed the hooks, stores only its prompt.
    namespace:
        Match only prefixes stored under this name, and store under it (a tenant, a
        user): nothing stored under one namespace is matched under another or under
        the default namespace ``None`` (what every request used before namespaces). A
        string of 1 to 1024 characters; the store records only its SHA-256. See
        docs/serving.md (Tenants).

    Notes
    -----
    One cache serves one request: build a new one for every ``generate`` call. An
    unbound cache binds to the prompt when ``generate`` is called with it (before
    ``generate`` asks its length), or, in a plain ``model(...)`` forward, to that
    forward's ``input_ids``: the forward computes every token it is given, so that
    binding reuses nothing and only stores the prompt.
    """

    def __init__(
        self,
        store: ImpressStore,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        store_prompt: bool = True,
        store_answer: bool = False,
        namespace: str | None = None,
    ) -> None:
        if not isinstance(store, ImpressStore):
            raise TypeError(f"store must be an ImpressStore, got {type(store).__name__}")
        if store.model is None:
            raise CacheUsageError(
                f"the store at {store.path} was opened without a model (for maintenance); "
                "open it with ImpressStore(path, model) to serve requests"
            )
        if input_ids is None and attention_mask is not None:
            raise CacheUsageError("attention_mask without input_ids: pass both, or neither and let generate bind the cache")
        self.store = store
        #: the namespace this request matches and stores under (None: the default)
        self.namespace = check_namespace(namespace)
        self.store_prompt = store_prompt
        self.store_answer = store_answer
        self._request: PrefixRequest | None = None
        self._guard: PromptGuard | None = None
        self._written = False
        #: rows of the whole prefix read in the background (``decode="full"``), in the
        #: batch's current order; None while no such read is pending
        self._restore_rows: torch.Tensor | None = None
        #: the uncertainty guard looks at the logits of the forward that ends the prefill
        self._guard_pending = False
        #: a hybrid model's states go to a checkpoint after the prefill
        self._checkpoint_due = False
        #: the tokens fed back while decoding (``[batch, 1]`` each), and whether every
        #: layer holds K/V equal to dense reuse's (what may be stored after generate)
        self._fed: list[torch.Tensor] = []
        self._exact = True
        #: forwards after the prefill, and whether this one re-selects (``keep_reselect``)
        self._decode_steps = 0
        self._reselect_now = False
        super().__init__(layers=make_layers(store.spec))
        #: stored layer index of each model layer that stores K/V
        self._stored = {m: s for s, m in enumerate(store.spec.stored_layers)}
        install_hooks(store.model, ImpressCache)
        if input_ids is not None:
            self.bind(input_ids, attention_mask)

    # -- binding ---------------------------------------------------------------------------
    @property
    def is_bound(self) -> bool:
        """Whether the cache knows its prompt (given up front, or seen by ``generate``)."""
        return self._request is not None

    def bind(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, reuse: bool = True) -> None:
        """Find and lease the stored prefix of this prompt and start loading it.

        Called by the constructor when it gets ``input_ids``, else by the hooks when
        ``generate`` (or a first forward, with ``reuse=False``) sees the cache.
        """
        if self._request is not None:
            raise CacheUsageError("this ImpressCache is bound to a prompt already; build a new ImpressCache per request")
        ids, mask = check_inputs(input_ids, attention_mask, self.store.spec.vocab_size)
        req = PrefixRequest(self.store, ids, mask, reuse=reuse, namespace=self.namespace)
        for m, s in self._stored.items():
            self.layers[m].start_with(req.reused, req.reused - req.held[s])
        if req.states is not None and req.reused:
            restore_states(self.store.spec, self.layers, req.states, self.store.device)
        self._checkpoint_due = self.store.states is not None and self.store_prompt and req.sparse is None
        self._exact = req.sparse is None
        self._request = req
        self._guard = PromptGuard(req)

    def _bound(self) -> PrefixRequest:
        if self._request is None:
            raise CacheUsageError(
                "this ImpressCache has no prompt: pass it to generate (or to a forward) of the model its store was "
                "opened with, or build it with ImpressCache(store, input_ids, attention_mask=...). If "
                "remove_hooks(model) ran after the cache was built, build a new cache"
            )
        return self._request

    # -- what users read ---------------------------------------------------------------
    @property
    def stats(self) -> RequestStats:
        """What this request reused, computed, read and wrote (see `RequestStats`);
        empty until the cache is bound."""
        return self._request.stats if self._request is not None else RequestStats()

    @property
    def reused_tokens(self) -> int:
        """Columns of the prompt served from the store (the same for every row)."""
        return self._request.reused if self._request is not None else 0

    @property
    def selections(self) -> dict[int, dict[int, torch.Tensor]]:
        """Sparse prefill: ``selections[layer][batch_row]`` = prefix positions attended
        (relative to the row's first real token; ``[k]`` shared or ``[kv_heads, k]``): the
        prefill's choice (``keep_reselect`` changes the rows held while decoding)."""
        sparse = self._request.sparse if self._request is not None else None
        return {} if sparse is None else sparse.selections

    # -- called by the hooks -------------------------------------------------------------
    @property
    def wants_queries(self) -> bool:
        """True while a sparse prefill still needs the new tokens' queries."""
        return (
            self._request is not None and self._request.sparse is not None and (not self._written or self._reselect_now)
        )

    def capture_queries(self, layer_idx: int, queries: torch.Tensor) -> None:
        """Receive ``[batch, q_heads, n, head_dim]`` post-RoPE queries of one layer."""
        req = self._bound()
        s = self._stored.get(layer_idx)
        if req.sparse is not None and s in req.sparse_layers and (not self.layers[layer_idx].is_initialized or self._reselect_now):
            req.sparse.capture(s, queries)

    def begin_generate(self, input_ids: Any, attention_mask: torch.Tensor | None) -> None:
        """``generate`` got this cache: bind it to the prompt, or refuse a second request."""
        if self._request is None:
            self.bind(input_ids, attention_mask)
        elif self._guard is not None and self._guard.state != "ready":
            raise CacheUsageError(
                "this ImpressCache already served a request; build a new ImpressCache for every generate call"
            )

    def end_generate(self, completed: bool = True) -> None:
        """``generate`` returned (``completed``) or failed: a keep-mode request that
        re-selects rows while decoding releases its lease and what it kept for that (a
        cache that ``generate`` never saw releases them when it is garbage-collected);
        a completed one stores its answer's K/V (``store_answer``)."""
        req = self._request
        if req is not None and req.sparse is not None and req.sparse.reselector is not None:
            req.end_decoding()
        self._reselect_now = False
        if (
            completed and req is not None and self.store_answer and self._exact and self._fed
            and not req.full_pending and torch.equal(req.rows, torch.arange(len(req.rows)))
        ):
            fed, self._fed = self._fed, []
            states = state_tensors(self.store.spec, self.layers) if self.store.states is not None and req.one_unpadded_row else None
            req.store_sequence([self.layers[m] for m in self.store.spec.stored_layers], fed, states)

    def check_prompt(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """``generate`` shows the whole prompt (the forward only sees the tokens after the
        reused prefix): it must be the one the cache was built for."""
        self._bound()
        assert self._guard is not None
        self._guard.check_prompt(input_ids, attention_mask, self.expand)

    def check_forward(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """Before every model forward that uses this cache; an unbound cache binds to the
        forward's input as its whole prompt (nothing to reuse: the forward computes it all)."""
        if self._request is None and isinstance(input_ids, torch.Tensor):
            mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
            self.bind(input_ids, mask, reuse=False)
        req = self._bound()
        assert self._guard is not None
        if req.prefill_started is None:
            req.prefill_started = time.perf_counter()
        if self._written:
            self._decode_steps += 1
            if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 1:
                self._fed.append(input_ids.detach().to("cpu"))
            else:
                self._exact = False  # not one token per step: what the layers hold is not known here
            every = self.store.config.keep_reselect
            reselector = req.sparse.reselector if req.sparse is not None else None
            self._reselect_now = reselector is not None and self._decode_steps % every == 0
            if reselector is not None and self._decode_steps == 1:
                reselector.refresh(self.layers, self.store.model, req.ids, req.mask, req.reused)
        if self._guard.check_forward(input_ids, attention_mask, self.expand) and req.full_pending:
            self._restore_full(req, self.store.config.refresh_new_tokens, False)

    def _restore_full(self, req: PrefixRequest, refresh: bool, guard: bool) -> torch.Tensor | None:
        """Restore the whole prefix read in the background (``decode="full"``); with
        ``refresh``, recompute the new tokens against it. Returns the recomputed logits
        after the prompt (``None`` without ``refresh``)."""
        keys, values = req.take_full_prefix(before_first_token=guard)
        self._exact = refresh  # without the refresh, the new tokens' K/V stay approximate
        rows = self._restore_rows
        self._restore_rows = None
        # the whole prefix for the sparse layers; every other stored layer keeps its rows
        full: dict[int, tuple[Any, Any]] = {
            m: (keys[s][rows], values[s][rows]) if s in req.sparse_layers else (None, None) for m, s in self._stored.items()
        }
        new: dict[int, Any] = {}
        logits = None
        if refresh:
            t0 = time.perf_counter()
            prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for m, (k, v) in full.items():
                layer = self.layers[m]
                if k is not None:
                    prefix[m] = layer.own(k, v)
                else:  # held rows, behind zeros where the layer hides rows (a window never sees them)
                    held = layer.prefix_len - layer.hidden
                    prefix[m] = tuple(  # type: ignore[assignment]
                        torch.nn.functional.pad(t[:, :, :held], (0, 0, layer.hidden, 0)) for t in (layer.keys, layer.values)
                    )
            dtype = next(la.keys.dtype for la in self.layers if isinstance(la, ImpressLayer) and la.keys is not None)
            new, logits = recompute_new_tokens(self.store.model, req.ids, req.mask, req.reused, prefix, dtype)
            req.stats.refreshed_tokens += int(req.mask[:, req.reused :].sum())
            req.stats.refresh_seconds += time.perf_counter() - t0
        for m, (k, v) in full.items():
            self.layers[m].restore_prefix(k, v, new.get(m))
        return logits

    def after_forward(self, output: Any) -> None:
        """After a model forward with this cache: right after a sparse prefill, note the
        smallest top-1/top-2 logit gap of its last position, and run the uncertainty
        guard. When the gap is below ``guard_margin`` (``decode="full"``), the whole
        prefix is restored and the new tokens recomputed now, and the exact logits
        replace the sparse ones before ``generate`` picks the first token."""
        if self._checkpoint_due:  # the prefill's forward: the states after the whole prompt
            self._checkpoint_due = False
            req = self._request
            if req is not None and req.one_unpadded_row:
                assert self.store.states is not None
                key = self.store.namespaces.key(req.ids[0].numpy(), self.namespace, create=True)
                self.store.states.put_async(key.tolist(), state_tensors(self.store.spec, self.layers))
        if not self._guard_pending:
            return
        self._guard_pending = False
        logits = getattr(output, "logits", None)
        req = self._request
        if not isinstance(logits, torch.Tensor) or req is None or logits.shape[-1] < 2:
            return
        margin = _gap(logits[:, -1])
        req.stats.first_token_margin = margin
        guard = req.full_pending and self.store.config.guard_margin > 0
        if guard:
            self.store.costs.observe_guard(margin < self.store.config.guard_margin)
        if margin >= self.store.config.guard_margin or not req.full_pending:
            return
        req.stats.guard_triggered += 1
        t0 = time.perf_counter()
        exact = self._restore_full(req, True, True)
        assert exact is not None
        logits[:, -1] = exact.to(logits.device, logits.dtype)
        req.stats.guard_seconds += time.perf_counter() - t0

    # -- the cache protocol --------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # 5.24 passes the attention module's kwargs as update(..., kwargs=...): they go on to the layer
        req = self._bound()
        assert self._guard is not None
        if self._guard.state == "ready":  # no forward of the store's model checked this one
            raise CacheUsageError(
                f"this ImpressCache serves only the model its store at {self.store.path} was opened with, through "
                "that model's forward: it was used by another model (or after remove_hooks). Open a store for this "
                "model and build the cache on it"
            )
        layer = self.layers[layer_idx]
        s = self._stored[layer_idx]
        if not layer.is_initialized and req.reused > 0:
            layer.place(*req.prefix_for(s, key_states))
        elif self._reselect_now and req.sparse is not None and s in req.sparse_layers:
            req.sparse.reselect(s, key_states, layer.keys, layer.values)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if (
            not self._written
            and s == len(self._stored) - 1
            and layer.get_seq_length() >= self._guard.ids.shape[1]
        ):
            self._written = True
            req.finish_prefill([self.layers[m] for m in self.store.spec.stored_layers], self.store_prompt)
            self._guard_pending = req.sparse is not None
            if req.full_pending:
                self._restore_rows = torch.arange(req.ids.shape[0])
        return keys, values

    def expand(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times (for ``num_return_sequences`` or beams)."""
        self.batch_repeat_interleave(repeats)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times: held rows, prefix rows not placed yet, and the
        prompt the hooks check against."""
        super().batch_repeat_interleave(repeats)
        if self._restore_rows is not None:
            self._restore_rows = self._restore_rows.repeat_interleave(repeats)
        if self._request is not None:
            n = self._request.ids.shape[0]
            self._request.expand(repeats)
            self._reselect_rows(torch.arange(n).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (held, not placed yet, and the prompt checked)."""
        self._rows_changed(indices, "batch_select_indices")
        super().batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``j`` becomes row ``beam_idx[j]``, for everything the cache holds."""
        self._rows_changed(beam_idx, "reorder_cache")
        super().reorder_cache(beam_idx)

    def _rows_changed(self, indices: torch.Tensor, what: str) -> None:
        req = self._request
        if req is None:
            return
        idx = indices.to("cpu", torch.long)
        req.select_rows(idx)
        if self._restore_rows is not None:
            self._restore_rows = self._restore_rows[idx]
        self._reselect_rows(idx)

    def _reselect_rows(self, idx: torch.Tensor) -> None:
        sparse = self._request.sparse if self._request is not None else None
        if sparse is not None and sparse.reselector is not None:
            sparse.reselector.rows_changed(idx)

    def reset(self) -> None:
        raise CacheUsageError("an ImpressCache cannot be reset; build a new ImpressCache for every request")


def _gap(logits: torch.Tensor) -> float:
    """The smallest top-1/top-2 gap of ``[batch, vocab]`` logits over the batch."""
    top2 = logits.float().topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())
