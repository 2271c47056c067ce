"""The modeling code an export ships: the engine's own modules, copied, not reimplemented.

`InferenceModel` (megatron_triroute/inference/model.py) and every project module it imports
(transitively, including imports inside functions; project = `megatron_triroute` and the
`triroute_kernels` package in kernels/) are copied into the export directory as flat files
(`megatron_triroute/routing/controller.py` -> `tr_routing_controller.py`, `kernels/pool.py` ->
`tk_pool.py`), with their imports of project modules (relative or absolute) rewritten to the flat
names (a package's `__init__.py` -> `tk.py`, `tr_routing.py`): Hugging Face's remote-code loader
resolves only single-level relative imports. Any other import must be the standard library or
torch, unless it sits in a `try:` block (Hugging Face does not require those). A project module
imported only lazily (inside a function or a `try:`) whose own imports need more (the Triton
kernel module `triroute_kernels.triton_ops`, imported only when the Triton backend is chosen) is
left out, and that import statement becomes `raise ImportError(...)`: the CPU path never reaches
it, a `try:` takes its fallback. Anything else is refused at export time, naming the import.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # megatron_triroute/
ROOT_FILE = PACKAGE / "inference" / "model.py"
EXTRA_ROOTS = (PACKAGE / "inference" / "serve_budget.py",)
"""Shipped beside the model's closure: the per-request budget (targets to prices) the modeling
code's `target_flops`/`target_mem` use."""
ALLOWED_TOP_LEVEL = {"torch", "__future__"}
TEMPLATES = Path(__file__).resolve().parent / "hf_code"
TEMPLATE_FILES = ("configuration_triroute.py", "modeling_triroute.py", "tokenization_triroute.py")


class RemoteCodeError(RuntimeError):
    """The engine's modules cannot be shipped as remote code; the message names the import."""


def project_roots() -> dict[str, tuple[Path, str]]:
    """Top-level import name -> (its directory, flat-name prefix)."""
    roots = {"megatron_triroute": (PACKAGE, "tr")}
    kernels = PACKAGE.parent / "kernels"
    if not (kernels / "__init__.py").is_file():
        import importlib.util

        spec = importlib.util.find_spec("triroute_kernels")
        kernels = Path(spec.origin).parent if spec and spec.origin else None
    if kernels is not None:
        roots["triroute_kernels"] = (kernels, "tk")
    return roots


class _Graph:
    def __init__(self, roots: dict[str, tuple[Path, str]]):
        self.roots = roots

    def root_of(self, path: Path) -> tuple[str, Path, str]:
        for name, (directory, prefix) in self.roots.items():
            if path.is_relative_to(directory):
                return name, directory, prefix
        raise RemoteCodeError(f"{path} is outside the project packages {sorted(self.roots)}")

    def flat_name(self, path: Path) -> str:
        _, directory, prefix = self.root_of(path)
        parts = path.relative_to(directory).with_suffix("").parts
        return "_".join((prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)))

    def resolve(self, source: Path, level: int, module: str | None) -> Path | None:
        """The project module file an import names, None for a non-project import."""
        if level:
            base = source.parent
            for _ in range(level - 1):
                base = base.parent
        else:
            top = (module or "").split(".")[0]
            if top not in self.roots:
                return None
            base, module = self.roots[top][0], module.partition(".")[2] or None
        target = base.joinpath(*module.split(".")) if module else base
        if target.with_suffix(".py").is_file():
            return target.with_suffix(".py")
        if (target / "__init__.py").is_file():
            return target / "__init__.py"
        raise RemoteCodeError(f"{source}: `{'.' * level}{module or ''}` names no module file. Fix: import from "
                              "a module of the project (`from .pkg.module import name`).")

    def imports(self, path: Path):
        """(project files imported, foreign top-level names), each split into required and in-try."""
        tree = ast.parse(path.read_text(), str(path))
        in_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for stmt in t.body for n in ast.walk(stmt)}
        lazy = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)}
        need, maybe, foreign, optional_foreign = [], [], set(), set()
        for node in ast.walk(tree):
            optional = id(node) in in_try  # Hugging Face does not require foreign imports in a try
            if isinstance(node, ast.ImportFrom):
                target = self.resolve(path, node.level, node.module)
                if target is not None:  # project modules imported lazily are shipped only if they can be
                    (maybe if optional or id(node) in lazy else need).append(target)
                else:
                    (optional_foreign if optional else foreign).add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    if top in self.roots:
                        raise RemoteCodeError(f"{path}: `import {alias.name}` cannot be flattened. Fix: use "
                                              f"`from {alias.name.rpartition('.')[0] or alias.name} import ...`.")
                    (optional_foreign if optional else foreign).add(top)
        allowed = ALLOWED_TOP_LEVEL | set(sys.stdlib_module_names)
        return need, maybe, sorted(foreign - allowed)

    def closure(self, root: Path) -> list[Path]:
        """Every module `root` needs; modules reachable only through lazy (`try:` or in-function)
        imports are kept only when their own closure is shippable."""
        seen: list[Path] = []

        def visit(path: Path, trail: list[Path]) -> None:
            if path in seen or path in trail:
                return
            need, maybe, foreign = self.imports(path)
            if foreign:
                raise RemoteCodeError(
                    f"{path} imports {foreign} (via {' -> '.join(p.name for p in trail + [path])}): the exported "
                    "modeling code may import only the standard library and torch outside `try:` blocks (it must "
                    "load where megatron_triroute is not installed). Fix: put that import in a try/except with a "
                    "pure-torch fallback, or keep it out of the inference model's import graph.")
            seen.append(path)
            for target in need:
                visit(target, trail + [path])
            for target in maybe:
                snapshot = list(seen)
                try:
                    visit(target, trail + [path])
                except RemoteCodeError:
                    seen[:] = snapshot  # left out: that import raises ImportError (rewrite)

        visit(root, [])
        return sorted(seen)

    def rewrite(self, path: Path, shipped: set[Path]) -> str:
        """The module's source with every project import pointing at the flat file names."""
        lines = path.read_text().splitlines(keepends=True)
        for node in ast.walk(ast.parse("".join(lines), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = self.resolve(path, node.level, node.module)
            if target is None:
                continue
            i = node.lineno - 1
            if target not in shipped:  # left out: the statement raises (same line count, same indent)
                indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
                lines[i] = (f"{indent}raise ImportError({self.flat_name(target)!r} ' is not part of this export: it "
                            "needs packages the exported code may not import (kernels: set TRIROUTE_KERNELS=torch)')\n")
                for j in range(i + 1, node.end_lineno):
                    lines[j] = "\n"
                continue
            new = f".{self.flat_name(target)}"
            pattern = re.compile(r"from\s+" + re.escape("." * node.level + (node.module or "")) + r"\s+import\b")
            lines[i], count = pattern.subn(f"from {new} import", lines[i], count=1)
            if count != 1:
                raise RemoteCodeError(f"{path}:{node.lineno}: cannot rewrite this import (split over lines?). Fix: "
                                      "write `from module import (...)` with the module on the first line.")
        _, directory, _ = self.root_of(path)
        origin = f"{directory.name}/{path.relative_to(directory).as_posix()}"
        return f"# Copied from {origin} by megatron_triroute.export; do not edit.\n" + "".join(lines)


def remote_code_files(roots: dict[str, tuple[Path, str]] | None = None, root_file: Path = ROOT_FILE) -> dict[str, str]:
    """file name -> source of everything `modeling_triroute.py` needs, plus the templates."""
    graph = _Graph(roots or project_roots())
    modules = graph.closure(root_file)
    if root_file == ROOT_FILE:
        modules += [p for extra in EXTRA_ROOTS for p in graph.closure(extra) if p not in modules]
    files = {graph.flat_name(p) + ".py": graph.rewrite(p, set(modules)) for p in modules}
    for name in TEMPLATE_FILES:
        files[name] = (TEMPLATES / name).read_text()
    return files
