"""specray's modules import each other without cycles, and its layers import downwards only.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` in a
module, including those inside functions and under ``if TYPE_CHECKING`` (a function-local
import used to dodge a cycle is still a cycle). Importing ``a.b.c`` also runs ``a.b``'s
``__init__``, so it counts as an edge to the package too (all but ``specray`` itself, the
public API that imports everything, and a module's own packages, initialised before it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import specray

ROOT = Path(specray.__file__).parent
LAYERS = ["comm", "kv", "models", "workers", "executor", "launch"]
"""DESIGN.md's one-way calls, lowest first: a module may import its own layer and those below."""


def module_files() -> dict[str, Path]:
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_names(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for name in imported_names(path, module):
            while name and name not in files:  # `from pkg import name`: name may be an attribute
                name = name.rpartition(".")[0]
            while name and name != "specray":
                if not (module == name or module.startswith(name + ".")):  # its own packages ran before it
                    graph[module].add(name)
                name = name.rpartition(".")[0]  # the packages whose __init__ runs first
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("import os\nfrom . import sib\n\ndef f():\n    from specray.comm.group import Group\n")
    assert imported_names(source, "specray.kv.mod") == {"os", "specray.kv", "specray.kv.sib",
                                                        "specray.comm.group", "specray.comm.group.Group"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_specray_modules():
    graph = import_graph()
    assert len(graph) > 50 and graph["specray.workers.worker"], "the walk found specray's modules"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_downwards_only():
    wrong = []
    for module, imports in import_graph().items():
        layer = module.split(".")[1] if module.count(".") else ""
        if layer not in LAYERS:
            continue
        for name in imports:
            other = name.split(".")[1] if name.count(".") else ""
            if other in LAYERS and LAYERS.index(other) > LAYERS.index(layer):
                wrong.append(f"{module} imports {name}")
    assert wrong == []
