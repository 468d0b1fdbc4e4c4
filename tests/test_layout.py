"""The package's shape: the library's import graph has no cycle, the core imports nothing
outside itself, the library nothing of the tools, the examples nothing of the tools."""

import ast
import pathlib
from typing import Dict, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, module: str, is_package: bool) -> Set[str]:
    """Every module ``path`` imports, at any depth of the file (lazy imports included)."""
    base = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _graph(top: pathlib.Path, package: str) -> Dict[str, Set[str]]:
    modules = {}
    for path in top.rglob("*.py"):
        parts = list(path.relative_to(top).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join([package] + (parts[:-1] if is_package else parts))] = (path, is_package)
    return {name: {m for m in _imports(path, name, is_package) if m in modules and m != name}
            for name, (path, is_package) in modules.items()}


def _cycles(graph: Dict[str, Set[str]]):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

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
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_library_and_the_tools_have_no_import_cycle():
    assert _cycles(_graph(ROOT / "bytescheduler_py", "bytescheduler")) == []
    assert _cycles(_graph(ROOT / "tools" / "bytescheduler_tools", "bytescheduler_tools")) == []


def test_the_core_imports_only_the_core_and_the_library_nothing_of_the_tools():
    library = _graph(ROOT / "bytescheduler_py", "bytescheduler")
    for module, imported in library.items():
        if module.startswith("bytescheduler.core"):
            assert all(m.startswith("bytescheduler.core") for m in imported), (module, imported)
    for path in (ROOT / "bytescheduler_py").rglob("*.py"):
        names = _imports(path, "bytescheduler.x", False)
        assert not any(name.split(".")[0] == "bytescheduler_tools" for name in names), path


def test_the_examples_use_the_library_and_their_framework_only():
    import sys

    for path in (ROOT / "examples").glob("*.py"):
        tops = {name.split(".")[0] for name in _imports(path, "examples.x", False)}
        outside = tops - set(sys.stdlib_module_names) - {"__future__", "bytescheduler", "synthetic", "examples"}
        assert outside <= {"torch", "horovod", "mxnet", "numpy"}, (path, outside)


def test_no_class_of_the_library_is_a_giant():
    """One object per role: a class that grows past this size holds two roles (split it)."""
    import ast

    sizes = {}
    for path in (ROOT / "bytescheduler_py").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert sizes and max(sizes.values()) <= 320, sorted(sizes.items(), key=lambda item: -item[1])[:3]

