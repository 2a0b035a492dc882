"""The package's top level (`impress_cache`): the names that need transformers
(`ImpressCache`, `remove_hooks`) are loaded on first use, and still listed, exported by
``import *`` and pickled as the classes they are."""

from __future__ import annotations

import subprocess
import sys

_CHECK = """
import pickle, sys
import impress_cache
assert "transformers" not in sys.modules, "importing the package imported transformers"
assert {"ImpressCache", "remove_hooks"} <= set(dir(impress_cache)), "dir() does not list the names loaded on first use"
assert set(impress_cache.__all__) <= set(dir(impress_cache))
assert not hasattr(impress_cache, "NoSuchName")
names = {}
exec("from impress_cache import *", names)
from impress_cache.hf.cache import ImpressCache
from impress_cache.hf.hooks import remove_hooks
assert names["ImpressCache"] is ImpressCache and names["remove_hooks"] is remove_hooks
assert impress_cache.ImpressCache is ImpressCache
assert pickle.loads(pickle.dumps(impress_cache.ImpressCache)) is ImpressCache
print("ok")
"""


def test_the_names_that_need_transformers_are_loaded_on_first_use_and_listed():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
