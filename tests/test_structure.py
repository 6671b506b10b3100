"""What production code (the k2jax package) may import: never the tests, the test helpers (k2jax.testing) or the
demo (k2jax.demo; only the command line that runs it), nor jax's private modules (jax._src); and no private
name of another module; and no import circles (imports go one way). Checked on the source (ast), function-local
imports included."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "k2jax"
FORBIDDEN = ("tests", "k2jax.testing", "k2jax.demo", "jax._src")
ALLOWED = {("cli.py", "k2jax.demo")}  # `k2jax demo` is a command of the command line
PRIVATE_ALLOWED = {("ops/expert_parallel.py", "k2jax.ops.moe", "_ragged_swiglu")}  # ops-internal (to be moved)


def imports(path: pathlib.Path):
    """(module, names) of every import statement in the file, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            yield node.module, names
            yield from ((f"{node.module}.{n}", []) for n in names)  # `from k2jax import demo`


FILES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_production_imports(path):
    rel = str(path.relative_to(PACKAGE))
    for module, names in imports(path):
        bad = next((f for f in FORBIDDEN if module == f or module.startswith(f + ".")), None)
        assert bad is None or (rel, bad) in ALLOWED, f"k2jax/{rel} imports {module}"
        if module.startswith("k2jax."):
            private = [n for n in names if n.startswith("_") and (rel, module, n) not in PRIVATE_ALLOWED]
            assert not private, f"k2jax/{rel} imports private {private} from {module}"


def module_graph() -> dict[str, set[str]]:
    """k2jax module -> the k2jax modules it imports (function-local imports included; `from k2jax.x import y`
    counts as importing k2jax.x.y when that is a module, else k2jax.x; a package's __init__ is the package)."""
    mods = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in FILES}
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for module, _ in imports(p):
            while module and module not in mods:
                module = module.rpartition(".")[0]
            if module and module != m and not m.startswith(module + "."):  # a package's own modules see it
                graph[m].add(module)
    return graph


def test_no_import_circles():
    """Imports go one way: no module reaches itself through the modules it imports (Tarjan's strongly
    connected components of the import graph; any component of two or more modules is a circle)."""
    graph = module_graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"
    assert "k2jax.nn.model" not in _reach(graph, "k2jax.sharding")  # the rules know nothing of the model
    for ops_module in (m for m in graph if m.startswith("k2jax.ops")):
        assert not any(m.startswith("k2jax.nn") for m in _reach(graph, ops_module)), ops_module  # nn -> ops only


def _reach(graph, start) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen
