"""The package's import edges, read from the source with `ast` (nothing is imported or run).

- no library module imports a command-line module (their helpers live in library modules), and each
  command-line module stays small (its usage text, its flags and a call);
- `data_prep` and `megatron_triroute` do not import each other both ways (data_prep imports the
  package: the vocabulary files, durability; the package never imports data_prep);
- no import circle between the files of the package, data_prep or the kernels (the exporter and the
  Llama writer once imported each other);
- what docs/architecture.md says never imports Megatron or DeepSpeed does not, at import time nor
  through the reads it makes lazily (one level of function-level imports, then module level).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARIES = {"megatron_triroute": REPO / "megatron_triroute", "data_prep": REPO / "data_prep",
             "triroute_kernels": REPO / "kernels"}
COMMANDS = {f"megatron_triroute.{name}" for name in
            ("overhead", "train", "evaluate", "generate", "analyze", "sweep", "lm_eval_harness", "export.__main__")}
"""Command-line modules (`python -m ...`, console scripts): argument parsing and a call."""
COMMAND_MAX_LINES = 150
"""Usage text, flags, a call into the library and its printing fit in this; past it, library code has
crept into the command (the longest command is about 135 lines)."""
NEVER_MEGATRON = ("megatron_triroute.routing", "megatron_triroute.config", "megatron_triroute.inference",
                  "triroute_kernels", "megatron_triroute.checkpoint.reader", "megatron_triroute.vocab")
FOREIGN_HEAVY = ("megatron", "deepspeed")
ONE_PROCESS_READ = {"megatron_triroute.checkpoint.sharded": ("full_model_state", "stored_tensors", "coverage_problems",
                                                             "current_name")}
"""The functions of a module that also holds Megatron code (imported inside other functions) which the
checkpoint reader calls: their own imports count too."""


def module_files() -> dict[str, Path]:
    modules = {}
    for top, root in LIBRARIES.items():
        for path in root.rglob("*.py"):
            if "hf_code" in path.parts:  # the exported remote code: a separate package, not imported here
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((top,) + (parts[:-1] if parts[-1] == "__init__" else parts))
            modules[name] = path
    return modules


@functools.lru_cache(maxsize=None)
def imports(name: str, path: Path, *, lazy: bool = True, functions: tuple[str, ...] = ()) -> frozenset[str]:
    """Dotted names `path` imports (relative imports resolved; `from m import x` gives m and m.x).
    `lazy=False`: module-level statements only (not inside a function); `functions`: only those
    inside the named top-level functions."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if functions:
        nodes = (n for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in functions for n in ast.walk(f))
    else:
        nodes = ast.walk(tree) if lazy else _module_level(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return frozenset(found)


def _module_level(tree: ast.AST):
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def edges(modules: dict[str, Path], *, lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name resolved to the longest module it names)."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(name, path, lazy=lazy):
            parts = imported.split(".")
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in modules:
                    targets.add(".".join(parts[:k]))
                    break
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


def under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_library_module_imports_a_command_line_module():
    modules = module_files()
    assert COMMANDS <= set(modules), sorted(COMMANDS - set(modules))
    graph = edges(modules)
    offending = sorted(f"{m} imports {t}" for m, targets in graph.items() if m not in COMMANDS
                       for t in targets & COMMANDS)
    assert not offending, offending


def test_command_line_modules_stay_small():
    modules = module_files()
    lines = {name: len(modules[name].read_text().splitlines()) for name in sorted(COMMANDS)}
    long = [f"{name}: {n} lines" for name, n in lines.items() if n > COMMAND_MAX_LINES]
    assert not long, (f"{long}: at most {COMMAND_MAX_LINES}. Fix: move the library code into the library "
                      "module the command calls (e.g. the sweep's into evaluation/sweep.py)")


def test_data_prep_and_the_package_do_not_import_each_other():
    graph = edges(module_files())
    prep_to_package = sorted(f"{m} -> {t}" for m, ts in graph.items() if under(m, ["data_prep"])
                             for t in ts if under(t, ["megatron_triroute"]))
    package_to_prep = sorted(f"{m} -> {t}" for m, ts in graph.items() if under(m, ["megatron_triroute"])
                             for t in ts if under(t, ["data_prep"]))
    assert not (prep_to_package and package_to_prep), (prep_to_package, package_to_prep)
    assert not package_to_prep, package_to_prep  # the direction chosen: data_prep builds on the package


def test_no_import_circle_between_files():
    assert cycles(edges(module_files())) == []


def test_the_circle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_what_never_imports_megatron_or_deepspeed():
    modules = module_files()
    lazy, module_level = edges(modules), edges(modules, lazy=False)
    for name, functions in ONE_PROCESS_READ.items():
        module_level[name] |= {m for m in imports(name, modules[name], functions=functions) if m in modules}
    offending = []
    for start in sorted(m for m in modules if under(m, NEVER_MEGATRON)):
        todo, seen = [start] + sorted(lazy[start]), set()  # the reads it makes, then their module level
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            own = imports(m, modules[m], lazy=m == start)
            if m in ONE_PROCESS_READ:
                own |= imports(m, modules[m], functions=ONE_PROCESS_READ[m])
            heavy = sorted(i for i in own if under(i, FOREIGN_HEAVY))
            if heavy:
                offending.append(f"{start} reaches {m}, which imports {heavy}")
            todo.extend(module_level[m])
    assert not offending, offending
