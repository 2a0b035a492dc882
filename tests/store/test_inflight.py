"""A lookup reuses what a write still in flight stores: it waits for that one write to
commit (at most ``write_wait_s``), never reads a file the index does not hold yet, and a
write that fails just ends the wait.

The writer is held deterministically: its index ``COMMIT`` waits for the test
(`test_commit_handover.held_commit`), after the chunk file is written and renamed, the
point where a reader that looked at files instead of the index would see it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from impress_cache import ImpressCache, ImpressStore
from impress_cache.hf.compat import CACHE_KWARG
from test_budget import prompts
from test_commit_handover import WAIT_S, _done_while_held, _in_thread, held_commit
from test_reorder import _model, assert_reads_exact, cfg, kv_of, put


def _put_async(store: ImpressStore, toks: list[int], namespace: str | None = None):
    ks, vs = kv_of(toks)
    return store.put_async(toks, ks, vs, namespace=namespace)


def _until_waiting(store: ImpressStore) -> None:
    """Until a lookup waits for a write in flight (a waiter on one of its futures)."""
    deadline = time.monotonic() + WAIT_S
    while not any(f._waiters for f in list(store._writer.inflight._writes)):
        assert time.monotonic() < deadline, "no lookup waits for the write"
        time.sleep(0.001)



def _generate_once_waiting(store, model, held, ids, **cache_kwargs):
    """Run a request on another thread while the last write's commit is held, let the
    commit go once the request waits for it, and return ``(cache, sequences)``."""

    def request():
        cache = ImpressCache(store, ids, **cache_kwargs)
        with torch.no_grad():
            return cache, model.generate(ids, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: cache})

    t, out = _in_thread(request)
    _until_waiting(store)
    held.go.set()
    t.join(WAIT_S)
    return out[0]

def test_a_lookup_right_after_put_async_matches_the_whole_prompt(tmp_path):
    a, *_, b = prompts(1, 5)  # (one system prompt)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        with held_commit(store) as held:
            held.armed = True
            fut = _put_async(store, b)
            assert held.reached.wait(WAIT_S)  # the file is in place, the commit is not
            shared = store._catalog.match(b).length
            assert 0 < shared < len(b)
            t, out = _in_thread(store.match, b)
            _until_waiting(store)
            assert t.is_alive()
            held.go.set()
            t.join(WAIT_S)
        assert fut.result() is None
        (m,) = out
        assert m.length == len(b) and m.waited_s > 0
        assert assert_reads_exact(store, b) == len(b)
        assert store.match(b).waited_s == 0.0  # written: nothing to wait for


def test_a_lookup_the_write_does_not_extend_does_not_wait(tmp_path):
    a, c, *_, b = prompts(2, 5)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        put(store, a)
        store.match(a)  # (its file opened: a first open reads the index, which the held commit holds)
        with held_commit(store) as held:
            held.armed = True
            _put_async(store, b)
            assert held.reached.wait(WAIT_S)
            shared = store._catalog.match(b).length
            for toks in (a, c, b[:shared]):  # stored already, or beyond what b adds
                m = _done_while_held(store.match, toks)
                assert m.waited_s == 0.0
            # another namespace's write never holds up the default namespace, nor the reverse
            m = _done_while_held(lambda: store.match(b, namespace="other"))
            assert m.length == 0 and m.waited_s == 0.0


def test_a_failed_write_ends_the_wait_with_no_match(tmp_path):
    (b,) = prompts(3, 1)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        with held_commit(store) as held:
            held.armed, held.fail = True, True
            fut = _put_async(store, b)
            assert held.reached.wait(WAIT_S)
            t, out = _in_thread(store.match, b)
            _until_waiting(store)
            held.go.set()  # the COMMIT fails: the write is dropped
            t.join(WAIT_S)
        assert not t.is_alive()
        fut.result()  # (counted, not raised)
        (m,) = out
        assert m.length == 0 and m.waited_s > 0
        assert store.stats()["write_failures"] == 1
        assert not list((tmp_path / "chunks").iterdir())  # the file written before the commit is gone


def test_the_wait_is_bounded(tmp_path):
    (b,) = prompts(4, 1)
    with ImpressStore(tmp_path, _model(), cfg(write_wait_s=0.2)) as store:
        with held_commit(store) as held:
            held.armed = True
            _put_async(store, b)
            assert held.reached.wait(WAIT_S)
            t0 = time.monotonic()
            m = store.match(b)
            assert m.length == 0 and 0.2 <= m.waited_s < WAIT_S / 3
            assert time.monotonic() - t0 < WAIT_S / 3
            held.go.set()
        store.flush()
        assert store.match(b).length == len(b)
    with ImpressStore(tmp_path, _model(), cfg(write_wait_s=0)) as store:  # 0: never waits
        store.match(b)  # (its file opened before the commit is held)
        with held_commit(store) as held:
            held.armed = True
            c = b + [7, 8, 9]
            _put_async(store, c)
            assert held.reached.wait(WAIT_S)
            assert _done_while_held(store.match, c).length == len(b)


def test_namespaced_writes_in_flight_are_waited_for_in_their_namespace(tmp_path):
    (b,) = prompts(5, 1)
    with ImpressStore(tmp_path, _model(), cfg()) as store:
        store.namespaces.key(b, "t", create=True)  # (its id: a commit of its own, before the held one)
        with held_commit(store) as held:
            held.armed = True
            _put_async(store, b, namespace="t")
            assert held.reached.wait(WAIT_S)
            t, out = _in_thread(lambda: store.match(b, namespace="t"))
            _until_waiting(store)
            held.go.set()
            t.join(WAIT_S)
        assert out[0].length == len(b) and out[0].waited_s > 0
        assert store.match(b).length == 0


def test_concurrent_writers_and_lookups_only_ever_see_committed_exact_rows(tmp_path):
    """Threads store prompts and look them up at once: every lookup right after its own
    put_async matches the whole prompt, and every matched row reads back exactly."""
    rng = np.random.default_rng(0)
    trunk = rng.integers(3, 250, 24).tolist()
    jobs = [[trunk[: rng.integers(4, 25)] + rng.integers(3, 250, rng.integers(1, 30)).tolist() for _ in range(6)] for _ in range(4)]
    errors: list[BaseException] = []
    with ImpressStore(tmp_path, _model(), cfg(write_wait_s=30.0)) as store:

        def client(prompts_: list[list[int]]) -> None:
            try:
                for toks in prompts_:
                    _put_async(store, toks)
                    assert store.match(toks).length == len(toks)
                    assert assert_reads_exact(store, toks) == len(toks)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(j,)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        store.flush()
        for toks in (p for j in jobs for p in j):
            assert assert_reads_exact(store, toks) == len(toks)


@pytest.mark.parametrize("namespace", [None, "tenant"])
def test_a_request_right_after_the_one_that_stored_its_prefix_reuses_it(tmp_path, namespace):
    """Two generate requests, no flush between them: the second matches the first's
    whole prompt while its write is still held before the commit."""
    model = _model()
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(1))
    with ImpressStore(tmp_path, model, cfg(important_ratio=1.0)) as store:
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=4, do_sample=False)
        store.namespaces.key(ids[0], namespace, create=True)  # (a namespace's id: a commit before the held one)
        with held_commit(store) as held:
            held.armed = True
            first = ImpressCache(store, ids, namespace=namespace)
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: first})
            assert held.reached.wait(WAIT_S)

            cache, seq = _generate_once_waiting(store, model, held, ids, namespace=namespace)
        assert torch.equal(seq, ref)
        assert cache.stats.matched_tokens == 47 and cache.stats.waited_for_write_seconds > 0


def test_a_hybrid_models_next_request_waits_for_the_state_checkpoint_too(tmp_path):
    """A hybrid model reuses a prefix only up to a state checkpoint, written on the
    writer thread after the prompt's K/V: the next request waits for both."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
    from families import family_model

    model = family_model("qwen3_5_text")
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    with ImpressStore(tmp_path, model, cfg(important_ratio=1.0)) as store:
        nxt = torch.cat([ids, torch.tensor([[5, 6, 7]])], dim=1)  # (a checkpoint serves a longer prompt)
        with torch.no_grad():
            ref = model.generate(nxt, max_new_tokens=4, do_sample=False)
        with held_commit(store) as held:
            held.armed = True
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, do_sample=False, **{CACHE_KWARG: ImpressCache(store, ids)})
            assert held.reached.wait(WAIT_S)

            cache, seq = _generate_once_waiting(store, model, held, nxt)
        assert torch.equal(seq, ref)
        assert cache.stats.matched_tokens == 40 and cache.stats.waited_for_write_seconds > 0
