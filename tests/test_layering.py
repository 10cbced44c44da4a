"""The architecture stays visible.

- No import cycle between modules: over every module of partir_torch, the top-level ones (api, program, verify,
  reporting, the package __init__) included, neither the imports a module runs when it is imported (module-level
  statements; `if TYPE_CHECKING:` blocks excluded) nor all its imports (also those inside functions) form a cycle.
- No import cycle between partir_torch's sub-packages (capture, rules, propagate, tactics, lower, runtime, sim,
  xla), counting every import, also those inside functions; the base modules every layer uses (errors, mesh,
  sharding, contract, options) import no sub-package. The top (api, program, verify, the package __init__) may
  import any sub-package.
- No function is longer than 80 lines and no class longer than 300 (a function that needs a scroll to read is
  usually two)."""
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


def _modules(root: str = ROOT) -> dict:
    """Dotted module name -> file, for every module under root (a package by its __init__)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _type_checking(test) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _module_level_imports(body: list):
    """The import statements a module runs when it is imported: its top-level statements, also inside top-level
    if / try / with blocks and class bodies; not in functions, not under `if TYPE_CHECKING:`."""
    for st in body:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            yield st
        elif isinstance(st, ast.If):
            if not _type_checking(st.test):
                yield from _module_level_imports(st.body)
            yield from _module_level_imports(st.orelse)
        elif isinstance(st, ast.Try):
            for block in (st.body, st.orelse, st.finalbody, *(h.body for h in st.handlers)):
                yield from _module_level_imports(block)
        elif isinstance(st, (ast.With, ast.ClassDef)):
            yield from _module_level_imports(st.body)


def module_graph(root: str = ROOT, module_level_only: bool = True) -> dict:
    """module -> {modules of the package it imports}. `from p import x` imports the module p.x where there is
    one, else p; relative imports are resolved. module_level_only: the imports run at import time (see
    _module_level_imports); else every import statement, also those inside functions."""
    mods = _modules(root)
    graph: dict = {}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        tree = ast.parse(open(path).read())
        statements = _module_level_imports(tree.body) if module_level_only else \
            [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        edges = graph.setdefault(mod, set())
        for st in statements:
            if isinstance(st, ast.Import):
                names = [a.name for a in st.names]
            else:
                base = st.module or ""
                if st.level:
                    anchor = package.split(".")
                    base = ".".join(anchor[:len(anchor) - st.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in st.names]
            edges |= {n for n in names if n in mods and n != mod}
    return graph


def module_cycles(graph: dict) -> list:
    """One cycle per strongly connected component of more than one module, as a path ending where it starts."""
    comps, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):                                  # Tarjan
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
            comp = set()
            while v not in comp:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph: dict, comp: set) -> list:
    """A shortest cycle through the component's first module (breadth first, inside the component)."""
    start = min(comp)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in the component {sorted(comp)}")


def test_no_import_cycles_between_modules():
    at_import = module_graph()
    assert "partir_torch.plan" in at_import["partir_torch.api"], at_import["partir_torch.api"]
    assert "partir_torch.reporting" in at_import["partir_torch.program"]          # the walk sees top-level modules
    found = module_cycles(at_import)
    assert found == [], "import cycles at import time:\n" + "\n".join(" -> ".join(c) for c in found)
    every = module_graph(module_level_only=False)
    assert "partir_torch.rules.tables" in every["partir_torch.rules.registry"]    # imports inside functions too
    found = module_cycles(every)
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


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


def test_the_module_walk_finds_planted_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    from . import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
                                      "try:\n    from ..a import f\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    at_import = module_graph(str(pkg))
    assert at_import == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.c": {"pkg.a"}, "pkg.sub": set(),
                         "pkg.sub.b": {"pkg.a"}}
    assert module_cycles(at_import) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    every = module_graph(str(pkg), module_level_only=False)
    assert every["pkg.a"] == {"pkg.sub.b", "pkg.c"}
    assert module_cycles(every) == [["pkg.a", "pkg.c", "pkg.a"]]


def _imports_benchmarks(path: str) -> list:
    """The lines of `path` that import a benchmarks/ module (any import form, also inside functions)."""
    tree = ast.parse(open(path).read(), path)
    hits = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            hits.append(node.lineno)
    return sorted(hits)


def test_no_test_imports_a_benchmark_script():
    # code shared by tests and benchmarks lives in examples/zoo/ (a benchmark script is a command, not a library)
    tests = os.path.dirname(os.path.abspath(__file__))
    bad = [f"{os.path.relpath(os.path.join(d, f), tests)}:{line}" for d, _, files in os.walk(tests)
           for f in files if f.endswith(".py") for line in _imports_benchmarks(os.path.join(d, f))]
    assert not bad, f"tests import benchmark scripts: {bad}"


def test_the_benchmark_import_walk_finds_a_planted_import(tmp_path):
    p = tmp_path / "t.py"
    p.write_text("def f():\n    from benchmarks import x\nimport benchmarks.y as z\nimport benchmarksx\n")
    assert _imports_benchmarks(str(p)) == [2, 3]


# -- pipeline schedules are types: their names live in one table ---------------------------------------------------
SCHEDULE_TABLE = os.path.join(ROOT, "lower", "ppschedules.py")
SCHEDULE_ALIASES = {"interleaved", "zb", "zbv", "zbh1", "zero_bubble", "zerobubble", "dualpipe", "1f1b_interleaved",
                    "pipedream", "looped_bfs"}      # names other libraries use: no module may branch on them either


def schedule_strings(root: str = ROOT, table: str = SCHEDULE_TABLE, names=None) -> list:
    """Every string literal outside the table module that names a pipeline schedule (a name of
    lower/ppschedules.SCHEDULES or an alias, any case; docstrings excepted): code that compares or picks a schedule
    by its name instead of asking the schedule object."""
    if names is None:
        from partir_torch.lower.ppschedules import SCHEDULES
        names = set(SCHEDULES)
    wanted = {n.lower() for n in names} | SCHEDULE_ALIASES
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            if not f.endswith(".py") or os.path.abspath(path) == os.path.abspath(table):
                continue
            tree = ast.parse(open(path).read())
            docs = {id(b[0].value) for b in [tree.body] + [n.body for n in ast.walk(tree) if isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
                if b and isinstance(b[0], ast.Expr) and isinstance(b[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                        and node.value.strip().lower() in wanted:
                    out.append(f"{os.path.relpath(path, os.path.dirname(root))}:{node.lineno} {node.value!r}")
    return out


def test_schedule_names_only_in_the_schedule_table():
    from partir_torch.lower.ppschedules import SCHEDULES

    assert set(SCHEDULES) >= {"GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"}, set(SCHEDULES)
    found = schedule_strings()
    assert found == [], ("schedule names outside lower/ppschedules.py (ask the Schedule: PipelineSpec.schedule, "
                         "Pipeline.kind):\n" + "\n".join(found))


def test_the_schedule_walk_finds_planted_names(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "table.py").write_text('NAMES = ("GPipe", "1F1B")\n')
    (pkg / "user.py").write_text('"""Runs "GPipe" or "1F1B"."""\n\ndef f(spec):\n    """"1F1B"."""\n'
                                 '    if spec.schedule == "GPipe":\n        return 1\n'
                                 '    return spec.schedule in ("1f1b", "Interleaved")\n')
    assert schedule_strings(str(pkg), str(pkg / "table.py"), {"GPipe", "1F1B"}) == [
        "pkg/user.py:5 'GPipe'", "pkg/user.py:7 '1f1b'", "pkg/user.py:7 'Interleaved'"]


# -- backends are asked what they can do, objects of ours what their type declares --------------------------------
# getattr/hasattr probes in partir_torch/ ("file: the call's source" -> why). A probe is hasattr(...), or getattr
# with a default or a literal name; getattr(obj, name) over a dataclass's fields is plain reflection. A probe of a
# project object is a member its type should declare (runtime/backend.py's capabilities are the model); the probes
# of torch, Python, Hugging Face or user objects below stay, each with its reason.
THIRD_PARTY_PROBES = {
    "partir_torch/capture/capture.py: getattr(gm, node.target, None)": "a GraphModule's get_attr target (torch)",
    "partir_torch/capture/capture.py: getattr(torch.compiler, '_compile_session_context', None)":
        "a private torch API present in some torch versions only",
    "partir_torch/capture/capture.py: hasattr(loss, 'loss')": "what the user's loss_fn returned (an HF output?)",
    "partir_torch/capture/counts.py: getattr(func, '__name__', '')": "a torch function under TorchFunctionMode",
    "partir_torch/capture/counts.py: getattr(func, '__self__', None)": "a torch function under TorchFunctionMode",
    "partir_torch/capture/counts.py: getattr(getattr(func, '__self__', None), '__name__', '')":
        "a torch function under TorchFunctionMode",
    "partir_torch/capture/lora.py: getattr(x.args[0], 'target', None)": "an FX argument: a Node or a constant",
    "partir_torch/capture/moe.py: getattr(module, '_is_expert_parallel', False)": "a Hugging Face experts module",
    "partir_torch/capture/moe.py: getattr(module, 'has_bias', False)": "a Hugging Face experts module",
    "partir_torch/capture/moe.py: getattr(module, 'has_post_expert_norm', False)": "a Hugging Face experts module",
    "partir_torch/capture/moe.py: getattr(moe, 'ALL_EXPERTS_FUNCTIONS', None)": "transformers across versions",
    "partir_torch/capture/moe.py: getattr(registry, '_global_mapping', None)": "transformers across versions",
    "partir_torch/capture/moe.py: getattr(type(module), '_apply_gate', None)": "a Hugging Face experts module",
    "partir_torch/capture/moe.py: hasattr(original, 'partir_original')":
        "transformers' experts function, marked once wrapped",
    "partir_torch/capture/outputs.py: getattr(c, '__slots__', ())": "a model's output object (any class)",
    "partir_torch/capture/outputs.py: hasattr(template.kind, '_fields')": "a model's output type (a namedtuple?)",
    "partir_torch/capture/outputs.py: hasattr(x, '__dict__')": "a model's output object (any class)",
    "partir_torch/capture/outputs.py: hasattr(x, '_fields')": "a model's output object (a namedtuple?)",
    "partir_torch/capture/outputs.py: hasattr(x, s)": "a model's output object's slots",
    "partir_torch/capture/padrules.py: hasattr(x, 'op')": "an FX argument: a Node or a constant",
    "partir_torch/capture/padrules.py: hasattr(y, 'op')": "an FX argument: a Node or a constant",
    "partir_torch/capture/tidy.py: hasattr(val, 'fake_mode')": "a node's meta value: a FakeTensor or another tensor",
    "partir_torch/lower/fakeprop.py: getattr(target, '_schema', None)": "an FX target: a torch op or a function",
    "partir_torch/lower/fuse.py: getattr(getattr(target, '_schema', None), 'returns', ())":
        "an FX target: a torch op or a function",
    "partir_torch/lower/fuse.py: getattr(target, '_schema', None)": "an FX target: a torch op or a function",
    "partir_torch/lower/why.py: hasattr(a, 'meta')": "an FX argument: a Node or a constant",
    "partir_torch/lower/why.py: hasattr(a, 'op')": "an FX argument: a Node or a constant",
    "partir_torch/lower/why.py: hasattr(n, 'op')": "an FX output argument: a Node or a constant",
    "partir_torch/reporting.py: getattr(val, 'dtype', '')": "a node's meta value: a tensor, a SymInt or a constant",
    "partir_torch/reporting.py: hasattr(a, 'name')": "an FX argument: a Node or a constant",
    "partir_torch/reporting.py: hasattr(val, 'shape')": "a node's meta value: a tensor, a SymInt or a constant",
    "partir_torch/rules/localize.py: getattr(target, '_schema', None)": "an FX target: a torch op or a function",
    "partir_torch/rules/registry.py: getattr(aten, op._schema.name.split('::')[1] + '_copy', None)":
        "a torch op's _copy variant, where torch has one",
    "partir_torch/rules/registry.py: getattr(op, '_schema', None)": "a torch op or a Python function",
    "partir_torch/rules/registry.py: getattr(op, 'overloadpacket', None)": "a torch op or a Python function",
    "partir_torch/rules/registry.py: getattr(packet, op._overloadname, None)": "a torch op's overload, if any",
    "partir_torch/rules/registry.py: getattr(rule, '__closure__', None)": "a rule: any Python callable",
    "partir_torch/rules/registry.py: getattr(rule, '__qualname__', repr(rule))": "a rule: any Python callable",
    "partir_torch/runtime/executor.py: getattr(exc, EXC_NODE, None)":
        "any exception a step raised (torch's, the model's); the interpreter names its node on those it relays",
    "partir_torch/runtime/faults.py: getattr(torch.distributed, 'DistError', ())": "torch across versions",
    "partir_torch/runtime/faults.py: hasattr(a, 'meta')": "an FX argument: a Node or a constant",
    "partir_torch/runtime/faults.py: hasattr(node, 'meta')": "an FX argument: a Node or a constant",
    "partir_torch/runtime/owner.py: getattr(fn, '_partir_checked', False)":
        "the user's optimizer step (any callable), marked once wrapped",
    "partir_torch/runtime/restart.py: getattr(handler, '_partir_per_attempt', False)":
        "torchrun's signal handler (any callable), marked once wrapped",
    "partir_torch/runtime/state.py: hasattr(v, 'full_tensor')": "a loaded step count: a DTensor or a tensor",
    "partir_torch/sim/allocator.py: getattr(node, 'target', '')": "an FX argument: a Node or a constant",
    "partir_torch/sim/memory.py: getattr(getattr(target, '_schema', None), 'returns', ())":
        "an FX target: a torch op or a function",
    "partir_torch/sim/memory.py: getattr(target, '_schema', None)": "an FX target: a torch op or a function",
    "partir_torch/sim/simulate.py: getattr(gm, '_partir_sim_facts', None)":
        "a torch GraphModule, the simulator's facts cached on it",
    "partir_torch/sim/simulate.py: getattr(gm, '_partir_step_flops', None)":
        "a torch GraphModule, its FLOPs per step cached on it",
    "partir_torch/sim/timeline.py: getattr(n.target, '_schema', None)": "an FX target: a torch op or a function",
    "partir_torch/tactics/manual.py: getattr(sel, 'pattern', repr(sel))": "a selector: a str or an re.Pattern",
    "partir_torch/xla/kernels.py: getattr(aten, target._schema.name.split('::')[1] + '_copy', None)":
        "a torch op's _copy variant, where torch has one",
    "partir_torch/xla/kernels.py: getattr(packet, target._overloadname, None)": "a torch op's overload, if any",
}
BACKEND_KINDS = {"emulated", "distributed", "xla", "interpreted"}


def _python_files(root: str):
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, os.path.dirname(root)), ast.parse(open(path).read())


def probes(root: str = ROOT) -> list:
    """"file: source" of every getattr/hasattr probe under root (see THIRD_PARTY_PROBES), sorted, each once."""
    out = set()
    for rel, tree in _python_files(root):
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"):
                if n.func.id == "hasattr" or len(n.args) >= 3 or \
                        (len(n.args) == 2 and isinstance(n.args[1], ast.Constant)):
                    out.add(f"{rel}: {ast.unparse(n)}")
    return sorted(out)


def kind_checks(root: str = ROOT) -> list:
    """Backends told apart by a kind string: a comparison of `<x>.kind` where x is a backend (rt, backend,
    runtime) or the other side a backend's kind name; and a backend class (...Runtime, ...Backend) defining `kind`."""
    out = []
    for rel, tree in _python_files(root):
        for n in ast.walk(tree):
            if isinstance(n, ast.Compare):
                sides = [n.left, *n.comparators]
                kinds = [s for s in sides if isinstance(s, ast.Attribute) and s.attr == "kind"]
                named = any(ast.unparse(k.value).split(".")[-1].lstrip("_") in ("rt", "backend", "runtime")
                            for k in kinds)
                consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)}
                if kinds and (named or consts & BACKEND_KINDS):
                    out.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
            elif isinstance(n, ast.ClassDef) and n.name.endswith(("Runtime", "Backend")):
                for st in n.body:
                    targets = st.targets if isinstance(st, ast.Assign) else [st.target] \
                        if isinstance(st, ast.AnnAssign) else []
                    if any(isinstance(t, ast.Name) and t.id == "kind" for t in targets):
                        out.append(f"{rel}:{st.lineno}: class {n.name} declares kind")
    return out


def test_backends_are_told_apart_by_capabilities_not_kind_strings():
    found = kind_checks()
    assert found == [], "ask the backend's capabilities (runtime/backend.py) instead:\n" + "\n".join(found)


def test_no_getattr_probes_of_project_objects():
    now = set(probes())      # walked once (a walk per listed probe took 100 s)
    found = [p for p in sorted(now) if p not in THIRD_PARTY_PROBES]
    assert found == [], ("declare the member on the object's type (a backend: a capability of runtime/backend.py's "
                         "protocol); a probe of a third-party object goes in THIRD_PARTY_PROBES with its reason:\n"
                         + "\n".join(found))
    gone = [p for p in THIRD_PARTY_PROBES if p not in now]
    assert gone == [], "listed probes no longer in the code: drop them from THIRD_PARTY_PROBES\n" + "\n".join(gone)


def test_the_probe_and_kind_walks_find_planted_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("class FakeRuntime:\n    kind = 'emulated'\n\n"
                              "def f(rt, ex, x, fields):\n"
                              "    a = rt.kind == 'distributed'\n"
                              "    b = ex.rt.kind in ('xla',)\n"
                              "    c = x.kind == 'sgd'\n"                        # an optimizer's kind: not a backend
                              "    d = getattr(rt, 'last_peak', None)\n"
                              "    e = hasattr(rt, 'agree')\n"
                              "    return [getattr(x, f) for f in fields]\n")   # reflection, not a probe
    assert probes(str(pkg)) == ["pkg/m.py: getattr(rt, 'last_peak', None)", "pkg/m.py: hasattr(rt, 'agree')"]
    assert kind_checks(str(pkg)) == ["pkg/m.py:2: class FakeRuntime declares kind",
                                     "pkg/m.py:5: rt.kind == 'distributed'", "pkg/m.py:6: ex.rt.kind in ('xla',)"]
