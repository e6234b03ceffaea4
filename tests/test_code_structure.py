"""The shape of the package: no import cycle inside compiler/, compile-time code never imports the runtime, and
importing the CLI imports no TVM (`mobilec --help` answers at once). Read from the sources' import statements."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "compiler"
# What may import the runtime: the runtime itself, the server built on it, the CLI that dispatches to them, and test
# support.
RUNTIME_USERS = ("compiler.runtime", "compiler.serve", "compiler.commands.cli", "compiler.__main__", "compiler.testing")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (at the top or inside functions alike)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in files else base)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """Negative control: a package whose modules import each other is reported."""
    package = tmp_path / "compiler"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    (package / "a.py").write_text("from .sub import b\n")
    assert cycles(import_graph(package)) == [["compiler.a", "compiler.sub.b"]]


def test_compile_time_code_never_imports_the_runtime():
    graph = import_graph()
    offenders = {m: sorted(d for d in deps if d.startswith("compiler.runtime"))
                 for m, deps in graph.items() if not m.startswith(RUNTIME_USERS)}
    assert {m: d for m, d in offenders.items() if d} == {}
    # the check sees runtime imports
    assert any(d.startswith("compiler.runtime") for d in graph["compiler.commands.cli"])


def test_importing_the_cli_imports_no_tvm():
    code = ("import sys, compiler.commands.cli; "
            "print(sorted(m for m in ('tvm', 'tvm_ffi', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert run.stdout.strip() == "[]", run.stdout
    control = subprocess.run([sys.executable, "-c", code.replace("compiler.commands.cli", "compiler.codegen.pipeline")],
                             capture_output=True, text=True, check=True, cwd=PACKAGE.parent)
    assert "tvm" in control.stdout  # negative control: the check sees TVM when it is imported


def test_the_files_scheduled_first_exist():
    """tests/conftest.py's LONGEST_FILES name files that are there (a renamed one would silently lose its place)."""
    from tests.conftest import LONGEST_FILES, TESTS_DIR

    assert [name for name in LONGEST_FILES if not (TESTS_DIR / name).is_file()] == []
