"""``impress-cache stats`` and ``impress-cache prune`` on real stores of a tiny model."""

from __future__ import annotations

import json
import time

import pytest
from helpers import run, tokens

from impress_cache import ImpressCache, ImpressConfig, ImpressStore
from impress_cache.cli import main
from impress_cache.operate import parse_age, parse_size

CONFIG = ImpressConfig(chunk_tokens=16, important_ratio=1.0)


def store_prompts(path, model, seeds, n=200):
    with ImpressStore(path, model, CONFIG) as store:
        for seed in seeds:
            run(model, tokens(seed, n).unsqueeze(0), cache=ImpressCache(store), new_tokens=1)
        store.flush()


def matched(path, model, seed, n=200) -> int:
    with ImpressStore(path, model, CONFIG) as store:
        cache = ImpressCache(store)
        run(model, tokens(seed, n).unsqueeze(0), cache=cache, new_tokens=1)
        store.flush()
        return cache.stats.matched_tokens


def cli_json(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_sizes_and_ages_parse():
    assert parse_size("500M") == 500 << 20 and parse_size("2GiB") == 2 << 30 and parse_size("1234") == 1234
    assert parse_age("30d") == 30 * 86400 and parse_age("90m") == 5400 and parse_age("45") == 45
    with pytest.raises(Exception):
        parse_size("lots")


def test_stats_reports_prefixes_bytes_reuse_and_the_model(tiny_llama, tmp_path, capsys):
    store_prompts(tmp_path / "kv", tiny_llama, [1, 2])
    assert matched(tmp_path / "kv", tiny_llama, 1) == 199
    out = cli_json(capsys, "stats", str(tmp_path / "kv"))
    # (asked again, prompt 1 is stored already: that request commits nothing)
    assert out["prefixes"] == 2 and out["stored_prompts"] == 2 and out["tokens_stored"] == 400
    assert out["model"]["model_type"] == "llama" and out["disk_bytes"] > 0
    assert out["nodes_reused"] == 1 and out["reuses"] == 1
    # a server's root: one entry per tenant store
    store_prompts(tmp_path / "root" / "default", tiny_llama, [3])
    store_prompts(tmp_path / "root" / "tenants" / "0123456789abcdef", tiny_llama, [4, 5])
    out = cli_json(capsys, "stats", str(tmp_path / "root"))
    assert {k: v["prefixes"] for k, v in out["stores"].items()} == {"default": 1, "tenants/0123456789abcdef": 2}


def test_prune_to_a_size_removes_prefixes_until_the_store_fits(tiny_llama, tmp_path, capsys):
    path = tmp_path / "kv"
    store_prompts(path, tiny_llama, [1, 2, 3, 4])
    before = cli_json(capsys, "stats", str(path))["disk_bytes"]
    out = cli_json(capsys, "prune", str(path), "--to", str(before // 2))
    assert out["removed_prefixes"] >= 2 and out["disk_bytes"] <= before // 2
    assert cli_json(capsys, "stats", str(path))["prefixes"] == 4 - out["removed_prefixes"]


def test_prune_older_than_removes_only_prefixes_unused_for_that_long(tiny_llama, tmp_path, capsys):
    path = tmp_path / "kv"
    store_prompts(path, tiny_llama, [1, 2, 3])
    time.sleep(2.5)
    assert matched(path, tiny_llama, 1) == 199  # used again: young
    store_prompts(path, tiny_llama, [4])  # written now: young
    out = cli_json(capsys, "prune", str(path), "--older-than", "2s")
    assert out["removed_prefixes"] == 2  # prompts 2 and 3
    assert matched(path, tiny_llama, 1) == 199 and matched(path, tiny_llama, 4) == 199
    assert matched(path, tiny_llama, 2) == 0
    out = cli_json(capsys, "prune", str(path), "--older-than", "1h")
    assert out["removed_prefixes"] == 0


def test_stats_and_prune_refuse_a_directory_without_a_store(tmp_path):
    with pytest.raises(SystemExit, match="not an impress_cache store"):
        main(["stats", str(tmp_path)])
