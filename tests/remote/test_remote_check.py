"""The remote is checked once when the store opens (issue 25, item 5).

A bucket that does not exist (or refuses the credentials, or a server that cannot be
reached) used to cost 30 s of retries per prompt and one S3 message per dropped upload,
while the store opened as if all was well. Now one warning at open names the bucket,
the endpoint and what failed, ``stats()["remote"]["state"]`` says it, and uploads are
dropped at once without trying the remote (checked again every `RECHECK_S` seconds).
Against a real SeaweedFS server (for refused credentials, one of the test's own that
knows a single identity: `SeaweedServer(credentials=...)`, ``-s3.config``).
"""

from __future__ import annotations

import logging

import torch

import pytest

from conftest import VOCAB, seaweed_server, tiny_model
from helpers import assert_same_as_uncached
from impress_cache import ImpressConfig, ImpressStore


def _doc(seed: int, n: int = 80) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _cfg(url: str, options: dict) -> ImpressConfig:
    return ImpressConfig(
        chunk_tokens=16, important_ratio=1.0, fsync=False, remote=url, remote_options=options, remote_retry_s=30.0,
        reorg_idle_ms=None,
    )


def _warnings(caplog, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


def test_a_missing_bucket_is_named_once_at_open_and_uploads_do_not_retry(seaweed, tmp_path, caplog):
    model = tiny_model("llama")
    caplog.set_level(logging.WARNING)
    with ImpressStore(tmp_path, model, _cfg("s3://nosuchbucket25/team", seaweed.options)) as store:
        store.flush()
        state = store.stats()["remote"]["state"]
        assert "'nosuchbucket25'" in state and "does not exist" in state
        assert seaweed.options["client_kwargs"]["endpoint_url"] in state
        for seed in (1, 2):
            assert_same_as_uncached(model, store, _doc(seed))  # served locally, exactly
        store.flush()
        remote = store.stats()["remote"]
        assert remote["uploads_dropped"] == 2 and remote["remote_errors"] == 0  # not even tried
    warned = _warnings(caplog, "nosuchbucket25")
    assert len(warned) == 1 and "cannot be used" in warned[0], warned


def test_an_unreachable_server_is_named_once(seaweed, tmp_path, caplog):
    model = tiny_model("llama")
    options = {**seaweed.options, "client_kwargs": {**seaweed.options["client_kwargs"], "endpoint_url": "http://127.0.0.1:9"}}
    caplog.set_level(logging.WARNING)
    with ImpressStore(tmp_path, model, _cfg("s3://kvbucket/team", options)) as store:
        assert_same_as_uncached(model, store, _doc(3))
        store.flush()
        remote = store.stats()["remote"]
        assert "cannot be reached" in remote["state"] and "http://127.0.0.1:9" in remote["state"]
        assert remote["uploads_dropped"] == 1
    assert len(_warnings(caplog, "cannot be used")) == 1


def test_a_working_bucket_is_ok(bucket, tmp_path):
    server, prefix, _ = bucket
    model = tiny_model("llama")
    with ImpressStore(tmp_path, model, _cfg(f"s3://kvbucket/{prefix}", server.options)) as store:
        assert_same_as_uncached(model, store, _doc(4))
        store.flush()
        remote = store.stats()["remote"]
        assert remote["state"] == "ok" and remote["prompts_advertised"] == 1 and remote["uploads_dropped"] == 0


@pytest.fixture
def guarded_seaweed(tmp_path):
    """A SeaweedFS server of the test's own that accepts one access key only."""
    server = seaweed_server()(tmp_path / "seaweed", credentials=("impresskey", "impresssecret"))
    try:
        yield server.start()
    finally:
        server.stop()


def test_refused_credentials_are_named_once_at_open_and_uploads_do_not_retry(guarded_seaweed, tmp_path, caplog):
    """The server refuses the store's keys (403): one warning at open names the bucket,
    the endpoint and the refusal, and prompts are served locally, exactly, their uploads
    dropped without a request to the server (no 30 s of retries per prompt)."""
    import time

    from impress_cache.storage.s3_remote import S3Backend

    good = S3Backend("kvbucket", "team", guarded_seaweed.options)
    good.ensure_bucket()  # (the bucket exists: only the keys are wrong)
    assert good.check() is None
    good.close()
    model = tiny_model("llama")
    wrong = {**guarded_seaweed.options, "key": "otherkey", "secret": "othersecret"}
    caplog.set_level(logging.WARNING)
    with ImpressStore(tmp_path / "kv", model, _cfg("s3://kvbucket/team", wrong)) as store:
        store.flush()
        state = store.stats()["remote"]["state"]
        assert "'kvbucket'" in state and "refuses these credentials" in state, state
        assert guarded_seaweed.endpoint in state
        t0 = time.monotonic()
        for seed in (5, 6):
            assert_same_as_uncached(model, store, _doc(seed))  # served locally, exactly
        store.flush()
        assert time.monotonic() - t0 < 25  # (before: 30 s of retries per prompt)
        remote = store.stats()["remote"]
        assert remote["uploads_dropped"] == 2 and remote["remote_errors"] == 0  # not even tried
    warned = _warnings(caplog, "kvbucket")
    assert len(warned) == 1 and "cannot be used" in warned[0] and "refuses these credentials" in warned[0], warned
