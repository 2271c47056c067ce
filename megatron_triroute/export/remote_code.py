"""The modeling code an export ships: the engine's own modules, copied, not reimplemented.

`InferenceModel` (megatron_triroute/inference/model.py) and every project module it imports
(transitively, including imports inside functions) are copied into the export directory as flat
files (`megatron_triroute/routing/controller.py` -> `tr_routing_controller.py`), with their
relative imports rewritten to point at the flat names: Hugging Face's remote-code loader resolves
only single-level relative imports. Any other import must be the standard library or torch; a
module that needs more (e.g. a compiled kernel package) is refused at export time, naming it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent  # megatron_triroute/
ROOTS = ("inference/model.py",)
ALLOWED_TOP_LEVEL = {"torch", "__future__"}
TEMPLATES = Path(__file__).resolve().parent / "hf_code"
TEMPLATE_FILES = ("configuration_triroute.py", "modeling_triroute.py", "tokenization_triroute.py")


class RemoteCodeError(RuntimeError):
    """The engine's modules cannot be shipped as remote code; the message names the import."""


def flat_name(path: Path) -> str:
    """megatron_triroute/routing/controller.py -> tr_routing_controller"""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return "tr_" + "_".join(rel.parts)


def _resolve(source: Path, level: int, module: str | None) -> Path:
    base = source.parent
    for _ in range(level - 1):
        base = base.parent
    target = base.joinpath(*module.split(".")) if module else base
    if target.with_suffix(".py").is_file():
        return target.with_suffix(".py")
    raise RemoteCodeError(f"{source.relative_to(PACKAGE.parent)}: relative import of "
                          f"{'.' * level}{module or ''} is not a module file (a package import cannot be "
                          "flattened). Fix: import the module itself, e.g. `from .pkg.module import name`.")


def _imports(path: Path) -> tuple[list[tuple[int, str | None]], set[str]]:
    relative, absolute = [], set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            relative.append((node.level, node.module))
        elif isinstance(node, ast.ImportFrom):
            absolute.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            absolute.update(alias.name.split(".")[0] for alias in node.names)
    return relative, absolute


def module_closure(roots=ROOTS) -> list[Path]:
    """Every project module the roots need, checked to import only the stdlib and torch otherwise."""
    todo = [PACKAGE / r for r in roots]
    seen: list[Path] = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        relative, absolute = _imports(path)
        foreign = sorted(a for a in absolute - ALLOWED_TOP_LEVEL if a not in sys.stdlib_module_names)
        if foreign:
            raise RemoteCodeError(f"{path.relative_to(PACKAGE.parent)} imports {foreign}: the exported modeling "
                                  "code may import only the standard library and torch (it must load where "
                                  "megatron_triroute is not installed). Fix: guard that import in a try/except with a "
                                  "pure-torch fallback, or keep it out of the inference model's import graph.")
        todo.extend(_resolve(path, level, module) for level, module in relative)
    return sorted(seen)


_FROM = re.compile(r"^(\s*)from\s+(\.+)([\w.]*)\s+import\b", re.MULTILINE)


def rewrite(path: Path) -> str:
    """The module's source with every relative import pointing at the flat file names."""
    def sub(match: re.Match) -> str:
        target = _resolve(path, len(match.group(2)), match.group(3) or None)
        return f"{match.group(1)}from .{flat_name(target)} import"

    header = f"# Copied from megatron_triroute/{path.relative_to(PACKAGE).as_posix()} by the exporter; do not edit.\n"
    return header + _FROM.sub(sub, path.read_text())


def remote_code_files() -> dict[str, str]:
    """file name -> source of everything `modeling_triroute.py` needs, plus the templates."""
    files = {flat_name(p) + ".py": rewrite(p) for p in module_closure()}
    for name in TEMPLATE_FILES:
        files[name] = (TEMPLATES / name).read_text()
    return files
