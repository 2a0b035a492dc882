"""The package's layering rules, checked on the import statements of every module.

Lower rooms never import upper ones: the tier package needs neither torch nor the rest of
the store; storage and index know nothing of the store; the store never imports the
selection logic or the transformers glue; only ``hf/`` (and the tools and the server)
import transformers. The HTTP server (``serve/``) uses only the public API and is never
imported by the library (the CLI's ``serve`` command starts it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "impress_cache"


def _imports(path: Path) -> set[str]:
    """Absolute names of everything a module imports (relative imports resolved)."""
    module = ".".join(("impress_cache",) + path.relative_to(PKG).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        package = module.removesuffix(".__init__")
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _modules(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).is_dir() else [PKG / f"{sub}.py"]


RULES = {
    # room: prefixes it must not import
    "tiers": ("torch", "impress_cache.store", "impress_cache.hf", "impress_cache.selection", "impress_cache.index",
              "impress_cache.storage", "transformers"),
    "storage": ("impress_cache.store", "impress_cache.hf", "impress_cache.selection", "impress_cache.index",
                "impress_cache.tiers", "transformers"),
    "index": ("impress_cache.store", "impress_cache.hf", "impress_cache.selection", "impress_cache.tiers",
              "transformers"),
    "store": ("impress_cache.hf", "impress_cache.selection.selectors", "impress_cache.selection.scores",
              "impress_cache.selection.baselines", "transformers"),
    "selection": ("impress_cache.hf", "transformers"),
    "config": ("impress_cache.store", "impress_cache.hf", "transformers"),
    "validate": ("torch", "impress_cache.store", "impress_cache.hf"),
}


@pytest.mark.parametrize("room", sorted(RULES))
def test_rooms_import_only_downwards(room):
    bad = []
    for path in _modules(room):
        for name in _imports(path):
            if any(name == p or name.startswith(p + ".") for p in RULES[room]):
                bad.append(f"{path.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_hf_and_the_tools_import_transformers():
    bad = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.relative_to(PKG).parts[0] not in ("hf", "tools", "serve")
        and any(n == "transformers" or n.startswith("transformers.") for n in _imports(p))
    ]
    assert not bad


def test_no_module_over_600_lines_and_no_class_over_450():
    long_modules = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if len(p.read_text().splitlines()) > 600]
    long_classes = [
        f"{p.relative_to(PKG)}:{n.name}"
        for p in PKG.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 470
    ]
    assert not long_modules and not long_classes, (long_modules, long_classes)


#: what serve/ may import of the package: the public API, and the name transformers gives the cache argument
SERVE_MAY_IMPORT = ("impress_cache", "impress_cache.hf.compat", "impress_cache.hf.compat.CACHE_KWARG")


def test_the_server_uses_only_the_public_api_and_the_library_never_imports_it():
    bad = []
    for path in _modules("serve"):
        for name in _imports(path):
            public = name in SERVE_MAY_IMPORT or name.startswith("impress_cache.serve") or (
                name.startswith("impress_cache.") and name.count(".") == 1 and name.split(".")[1][0].isupper())
            if name.startswith("impress_cache") and not public:
                bad.append(f"{path.relative_to(PKG)} imports {name}")
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "serve" or rel == Path("operate.py"):  # (operate: the CLI's serve command, imported lazily)
            continue
        bad += [f"{rel} imports {n}" for n in _imports(path) if n == "impress_cache.serve" or n.startswith("impress_cache.serve.")]
    assert not bad, "\n".join(bad)
