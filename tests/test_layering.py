"""The architecture stays visible: no import cycles between partir_torch's sub-packages (capture, rules,
propagate, tactics, lower, runtime, sim, xla), counting every import, also those inside functions; the base modules
every layer uses (errors, mesh, sharding) import no sub-package. The top (api, program, verify, the package
__init__) may import anything. No function is longer than 80 lines and no class longer than 300 (a function that
needs a scroll to read is usually two)."""
from __future__ import annotations

import ast
import os

import partir_torch

ROOT = os.path.dirname(partir_torch.__file__)


BASE = {"errors", "mesh", "sharding", "contract", "options"}


def _unit(module: str) -> str:
    """partir_torch.rules.views -> 'rules'; partir_torch.errors -> '<base>'; partir_torch.api -> '<top>'."""
    parts = module.split(".")
    if len(parts) < 2:
        return "<top>"
    if parts[1] in BASE:
        return "<base>"
    sub = os.path.join(ROOT, parts[1])
    return parts[1] if os.path.isdir(sub) else "<top>"


def import_graph() -> dict:
    """sub-package -> {sub-package it imports}, from every `import` / `from ... import` in the package."""
    graph: dict = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            module = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            package = module if f == "__init__.py" else module.rsplit(".", 1)[0]
            src = _unit(module)
            for node in ast.walk(ast.parse(open(path).read())):
                targets = []
                if isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")
                        anchor = anchor[:len(anchor) - node.level + 1]
                        base = ".".join(anchor + ([base] if base else []))
                    targets = [base] if base else []
                    if base in ("partir_torch",) or (node.level and not node.module):
                        targets = [f"{base}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                for t in targets:
                    if t.startswith("partir_torch.") and _unit(t) != src and src != "<top>":
                        graph.setdefault(src, set()).add(_unit(t))
    return graph


def cycles(graph: dict) -> list:
    found = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    found.append(path + [start])
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return found


def test_no_import_cycles_between_sub_packages():
    graph = import_graph()
    assert graph.get("lower") and "rules" in graph["lower"], graph      # the walk sees real imports
    assert graph.get("<base>", set()) == set(), graph["<base>"]
    below_top = {k: {v for v in vs if v != "<top>"} for k, vs in graph.items()}
    assert cycles(below_top) == [], cycles(below_top)


MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def oversized(root: str = ROOT) -> list:
    """Every function longer than MAX_FUNCTION_LINES and class longer than MAX_CLASS_LINES under `root`, counted as
    the AST node's span (end_lineno - lineno + 1: docstrings and comments included, decorators not)."""
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind, limit = "function", MAX_FUNCTION_LINES
                elif isinstance(node, ast.ClassDef):
                    kind, limit = "class", MAX_CLASS_LINES
                else:
                    continue
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{kind} {node.name} at {os.path.relpath(path, os.path.dirname(root))}:{node.lineno} "
                               f"is {n} lines (limit {limit})")
    return out


def test_no_function_over_80_lines_and_no_class_over_300():
    found = oversized()
    assert found == [], "split by responsibility:\n" + "\n".join(found)


def test_the_size_walk_finds_planted_long_definitions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()

    def function(name, n):      # n lines: the def and n - 1 statements
        return f"def {name}():\n" + "".join(f"    x{i} = {i}\n" for i in range(n - 1)) + "\n\n"

    def klass(name, methods):   # 3 lines per method, the last one's blank line outside the class
        return f"class {name}:\n" + "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(methods))

    (pkg / "funcs.py").write_text(function("at_limit", 80) + function("too_long", 81))
    (pkg / "classes.py").write_text(klass("AtLimit", 100) + "\n" + klass("TooLong", 101))
    assert oversized(str(pkg)) == ["class TooLong at pkg/classes.py:303 is 303 lines (limit 300)",
                                   "function too_long at pkg/funcs.py:83 is 81 lines (limit 80)"]


def test_the_walk_finds_a_planted_cycle():
    assert cycles({"rules": {"lower"}, "lower": {"rules"}}) == [["rules", "lower", "rules"], ["lower", "rules", "lower"]]
