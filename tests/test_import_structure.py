"""The cache's modules import each other without a cycle, and the reader is storage- and shard-agnostic.

The layering (see ``latentfast/cache/store/opening.py``): the store's primitives (format, layout, fields,
tables, keytable, manifest) at the bottom; the feed (gather, samplers, loader) over them; the reader
(one cache, read through a storage strategy it is handed) over those; the shards (composing caches) over
the reader; object storage (``remote/``: the strategies, push and pull) over the store; and
``store/opening.py`` at the top, choosing a reader, shards and a storage by a cache's location.

Every file is parsed with :mod:`ast` (nothing is imported): an import statement in a module's body, or
in a class body or an ``if``/``try``/``with`` block of it, runs when the module is imported ("module
level"); one inside a function runs when the function is called ("function level").
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "latentfast"
CACHE = "latentfast.cache"

# Function-level imports of latentfast modules inside latentfast/cache that may stay, and why: each is
# there for what importing it costs, never to dodge a cycle (test_no_function_level_import_would_close_a_cycle
# checks that none of them would close one at the top of its module). (importer, imported or "*")
LAZY_ALLOWED = {
    # the command line starts without torch (`latentfast --help`, `latentfast cache inspect`); each
    # subcommand imports the machinery it runs (builders, encoders, text models, object storage)
    ("latentfast.cache.cli", "*"),
    # the op layer (and its native library) loads only where the pread pool reads; the samplers import coldread
    ("latentfast.cache.feed.coldread", "latentfast.ops"),
}
# (latentfast/cache/__init__.py resolves its public names on first use with importlib, by design: no
# import statement, so nothing here; tests/test_checkout_imports.py checks what `import latentfast.cache` loads)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(importer: str, node: ast.AST) -> set[str]:
    """The latentfast modules an import statement of ``importer`` runs: the named module (or, for ``from X
    import name``, ``X.name`` where that is a module) and the packages above it, less ``importer``'s own
    packages (already imported before it is)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = importer.split(".")
            if not MODULES[importer].name == "__init__.py":
                base = base[:-1]
            base = base[:len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
    found = set()
    for target in targets:
        parts = target.split(".")
        for k in range(1, len(parts) + 1):
            name = ".".join(parts[:k])
            if name in MODULES and name != importer and not importer.startswith(name + "."):
                found.add(name)
    return found


def _imports(body, in_function: bool):
    """``(import node, at function level)`` for every import statement under ``body``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                yield node, in_function
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, True)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue  # (never runs)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _imports(getattr(node, field, None) or [], in_function)


def import_table() -> list[tuple[str, str, bool, int]]:
    """``(importer, imported, at function level, line)`` for every import of a latentfast module."""
    rows = []
    for name, path in MODULES.items():
        for node, in_function in _imports(ast.parse(path.read_text(encoding="utf-8")).body, False):
            rows += [(name, target, in_function, node.lineno) for target in sorted(imported_modules(name, node))]
    return rows


TABLE = import_table()


def module_graph(extra=()) -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for importer, imported, in_function, _line in TABLE:
        if not in_function:
            graph[importer].add(imported)
    for importer, imported in extra:
        graph[importer].add(imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):  # (the graph is a few hundred modules deep at most)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_table_sees_the_imports_that_are_there():
    # what the assertions below stand on: edges that exist are found, at the level they are at
    rows = {(a, b, f) for a, b, f, _ in TABLE}
    assert ("latentfast.cache.store.shards", "latentfast.cache.store.reader", False) in rows
    assert ("latentfast.cache.store.reader", "latentfast.cache.store.layout", False) in rows
    assert ("latentfast.cache.store.opening", "latentfast.cache.remote.files", False) in rows
    assert ("latentfast.cache.remote.files", "latentfast.cache.remote", False) not in rows  # (its own package)
    assert ("latentfast.cache.feed.coldread", "latentfast.ops", True) in rows
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_module_level_imports_form_no_cycle():
    found = [c for c in cycles(module_graph()) if any(m == CACHE or m.startswith(CACHE + ".") for m in c)]
    assert not found, f"module-level import cycles through latentfast/cache: {found}"


@pytest.mark.parametrize("forbidden", ["latentfast.cache.remote", "latentfast.cache.store.shards", "latentfast.cache.store.opening"])
def test_the_reader_imports_neither_object_storage_nor_shards(forbidden):
    # not at any level, nor through anything it imports at module level
    direct = {b for a, b, _f, _ in TABLE if a == "latentfast.cache.store.reader"}
    reached = closure(module_graph(), "latentfast.cache.store.reader") | direct
    bad = sorted(m for m in reached if m == forbidden or m.startswith(forbidden + "."))
    assert not bad, f"latentfast/cache/store/reader.py reaches {bad}: it reads through the storage it is handed"


def test_the_shards_and_the_feed_import_no_object_storage():
    graph = module_graph()
    for start in ("latentfast.cache.store.shards", "latentfast.cache.feed.loader", "latentfast.cache.feed.sampler"):
        bad = sorted(m for m in closure(graph, start) if m.startswith("latentfast.cache.remote"))
        assert not bad, f"{start} reaches {bad}"


def function_level_imports() -> list[tuple[str, str, int]]:
    return [(a, b, line) for a, b, f, line in TABLE if f and (a == CACHE or a.startswith(CACHE + "."))]


def allowed(importer: str, imported: str) -> bool:
    return (importer, "*") in LAZY_ALLOWED or (importer, imported) in LAZY_ALLOWED


def test_function_level_imports_are_only_the_allowed_ones():
    bad = [f"{MODULES[a].relative_to(ROOT)}:{line} imports {b}" for a, b, line in function_level_imports() if not allowed(a, b)]
    assert not bad, "function-level imports of latentfast modules (move them to the top of the module):\n" + "\n".join(bad)


def test_every_allowed_entry_is_still_needed():
    used = {(a, "*") if (a, "*") in LAZY_ALLOWED else (a, b) for a, b, _ in function_level_imports()}
    assert LAZY_ALLOWED <= used, f"allow-list entries nothing needs any more: {sorted(LAZY_ALLOWED - used)}"


def test_no_function_level_import_would_close_a_cycle():
    # an allowed lazy import is there for its cost: at the top of its module it must still make no cycle
    for importer, imported, line in function_level_imports():
        found = [c for c in cycles(module_graph([(importer, imported)])) if importer in c]
        assert not found, f"{MODULES[importer].relative_to(ROOT)}:{line}: importing {imported} at module level " \
                          f"would close the cycle {found[0]}: it dodges one"
