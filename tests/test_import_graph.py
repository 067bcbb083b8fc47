"""The `outrider` package's import graph has no cycles, and every module imports on its own in a fresh interpreter.

The graph is read from the source with `ast`, one edge per `import outrider...` / `from outrider... import ...`
found anywhere in a module:
  - at module level;
  - inside functions (lazy imports): a circle closed by a deferred import is still a circle, only one that fails
    later, at the first call that takes it;
  - under `if TYPE_CHECKING:` (type-only imports): the annotation states a dependency, and a circle closed that
    way is the same knot in the design (issue 41 names two of them); a type checker follows it.
`from pkg import name` is an edge to the module pkg.name when there is one, else to pkg itself (its __init__).
Not an edge: the parent packages Python initialises before a module (importing outrider.a.b runs outrider/a's
__init__ first whatever the importer wants); counting them would call every package that re-exports its children
a circle, and says nothing about the importing module's design.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "outrider"
# Modules that import a GPU-only library at load (Triton): on a machine without it they cannot be imported, only
# parsed. The fresh-interpreter test accepts exactly that failure from them.
GPU_ONLY = ("triton",)


def module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports (see the module docstring for what counts)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {known(a.name) for a in node.names if a.name.split(".")[0] == "outrider"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] == "outrider":
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base) for a in node.names}
    out.discard(name)
    out.discard("")
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_top_level_lazy_type_only_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "outrider"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from outrider.sub.b import B\n")
    (pkg / "a.py").write_text(textwrap.dedent("""\
        from typing import TYPE_CHECKING
        import outrider.sub.b
        if TYPE_CHECKING:
            from outrider.c import C
        def f():
            from outrider import d
        """))
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import B as _\n")
    for name in ("c", "d"):
        (pkg / f"{name}.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["outrider.a"] == {"outrider.sub.b", "outrider.c", "outrider.d"}
    assert graph["outrider.sub.b"] == {"outrider.a", "outrider.sub"}
    assert cycles(graph) == [["outrider.a", "outrider.sub", "outrider.sub.b"]]  # (sub re-exports b, b reads sub)


def test_the_server_package_imports_neither_the_tools_nor_the_tests():
    """outrider_tools (trainers, measurement, soak) and tests build on the server; it never reaches back."""
    found = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name}: {n}" for n in names if n.split(".")[0] in ("outrider_tools", "tests")]
    assert not found, found


def test_the_package_import_graph_has_no_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    """Each module imported first, with no other outrider module loaded (torch and the like stay cached): no import
    order hides a module that only loads when something else was imported before it. (`__main__` modules run the
    program when imported: they are in the graph, not here.)"""
    names = sorted(n for n in module_files() if not n.endswith(".__main__"))
    script = textwrap.dedent(f"""\
        import importlib, json, sys, traceback
        failed = {{}}
        for name in {names!r}:
            for loaded in [m for m in sys.modules if m == "outrider" or m.startswith("outrider.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name not in {GPU_ONLY!r}:
                    failed[name] = traceback.format_exc()
            except Exception:
                failed[name] = traceback.format_exc()
        print(json.dumps(failed))
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())
