"""What production code (the k2jax package) may import: never the tests, the test helpers (k2jax.testing) or the
demo (k2jax.demo; only the command line that runs it), nor jax's private modules (jax._src); and no private
name of another module. Checked on the source (ast), function-local imports included."""

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
