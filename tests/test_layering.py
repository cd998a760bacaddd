"""fedring's modules import each other without a circle, imports inside functions included.

The graph is built from the source with ``ast``: an edge ``a -> b`` for every ``import`` or
``from ... import`` in module ``a`` (at any depth: in functions, methods, ``try`` blocks) that
names fedring module ``b``, or a name defined in package ``b``. Imports under
``if TYPE_CHECKING:`` count too: they never run, but a circle hidden behind one is still two
modules that each need the other. ``importlib.import_module`` by a string (the task and
subcommand registries) is not an import statement and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fedring"


def modules() -> dict[str, tuple[Path, bool]]:
    """``dotted name -> (file, is a package)`` of every module of fedring."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(name: str, path: Path, package: bool, known: dict) -> set[str]:
    """The fedring modules that module ``name`` imports."""
    here = name if package else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def target(dotted: str) -> None:
        while dotted and dotted not in known:  # fedring.comm.Layout -> fedring.comm
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fedring":
                    target(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "fedring":
                for alias in node.names:
                    target(f"{module}.{alias.name}")
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, package, known) for name, (path, package) in known.items()}


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``edges`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := walk(start)):
            return found
    return None


def test_the_graph_sees_imports_in_functions_and_under_type_checking(tmp_path):
    pkg = tmp_path / "fedring"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedring.sub.b import B\n"
        "def f():\n    from .sub import B\n"
    )
    (pkg / "sub" / "b.py").write_text("def g():\n    import fedring.a\n")
    known = {
        name: (pkg / path, package)
        for name, path, package in [
            ("fedring", "__init__.py", True),
            ("fedring.sub", "sub/__init__.py", True),
            ("fedring.a", "a.py", False),
            ("fedring.sub.b", "sub/b.py", False),
        ]
    }
    edges = {name: imports(name, path, package, known) for name, (path, package) in known.items()}
    assert edges == {
        "fedring": set(),
        "fedring.sub": {"fedring.sub.b"},
        "fedring.a": {"fedring.sub", "fedring.sub.b"},
        "fedring.sub.b": {"fedring.a"},
    }
    assert cycle(edges) == ["fedring.a", "fedring.sub", "fedring.sub.b", "fedring.a"]


def test_fedring_has_no_import_circle():
    edges = graph()
    assert len(edges) > 50 and "fedring.train.loop" in edges["fedring.train.task"]
    assert cycle(edges) is None, " -> ".join(cycle(edges))
