"""One definition per concept, checked by reading the source (ast only: no import, well under 1 s).

- The kernels' package (`kernels/`, installed as `triroute_kernels`) imports nothing of
  `megatron_triroute`.
- The supported KV widths are written once, `SUPPORTED_BITS` in kernels/quant.py; config.py imports
  them; the only other literal of those widths is `RouterConfig.bits`' stated default.
- The attention modes are written once, routing/modes.py (`ATTN_MODES`, `N_MODES`, `SKIP`, ...): no
  other module assigns those names or spells a tuple of mode names, and no module writes the mode
  count as a bare 3 (the patterns in `mode_count_literals`).
Each rule is also run on a snippet that breaks it, so a rule that stops matching fails here too.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("megatron_triroute", "kernels", "benchmarks", "data_prep")
WIDTHS_HOME = "kernels/quant.py"
MODES_HOME = "megatron_triroute/routing/modes.py"
HOMES = {"SUPPORTED_BITS": WIDTHS_HOME, "NULL_EXPERT": "megatron_triroute/routing/gating.py",
         **{n: MODES_HOME for n in ("ATTN_MODES", "N_MODES", "SKIP", "LOCAL", "FULL", "READING_MODES")}}
SHAPE_CALLS = {"zeros", "ones", "empty", "full", "randn", "rand", "view", "reshape", "expand", "unflatten",
               "new_zeros", "new_ones", "new_empty"}
KNOWN_ELSEWHERE: set[tuple[str, str]] = set()
"""(file, source text) findings accepted for now; the test fails while an entry matches nothing."""


def _is_three(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 3


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _head_count(node: ast.AST) -> bool:
    """An expression of a head count: `H`, `H_a`, `n_heads`, `self.attn_heads`, `L * H`."""
    return any(n in ("H", "H_a", "H_q") or "head" in n.lower() for n in _names(node))


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _index(tree: ast.AST) -> dict[type, list[ast.AST]]:
    """The tree's nodes by type (one walk; each rule reads only the node types it checks)."""
    index: dict[type, list[ast.AST]] = {}
    for node in ast.walk(tree):
        index.setdefault(type(node), []).append(node)
    return index


def _of(index: dict[type, list[ast.AST]], *types: type) -> list[ast.AST]:
    return [n for t in types for n in index.get(t, ())]


def handles_modes(rel: str, index) -> bool:
    """Routing code, or a module that imports the mode contract or the router's decisions, or
    reads a decision's `.attn` axis."""
    return (rel.startswith("megatron_triroute/routing/")
            or any((n.module or "").split(".")[-1] in ("modes", "controller") for n in _of(index, ast.ImportFrom))
            or any(n.attr == "attn" for n in _of(index, ast.Attribute)))


def mode_count_literals(rel: str, index) -> list[str]:
    """A literal 3 standing for the number of attention modes. Anywhere: 3 times a head count
    (`3 * H`, `L * H * 3`). In modules that handle modes (routing/, or `_reads_modes`): `range(3)`,
    `eye(3)` / `one_hot(x, 3)`, a shape call whose last size is 3 (`zeros(B, T, H, 3)`,
    `.view(B, T, H, 3)`), a sum starting with 3 (`3 + 1 + |bits|`), and a last-axis index or
    slice bound of 3 (`x[..., 3]`, `x[..., :3]`). Not flagged: floats (`3.0` SwiGLU matrices),
    comparisons (`x.dim() == 3`), leading-axis slices (`rest[:3]`), `H + 3`."""
    found = []
    for node in _of(index, ast.BinOp):
        if isinstance(node.op, ast.Mult) and ((_is_three(node.left) and _head_count(node.right))
                                              or (_is_three(node.right) and _head_count(node.left))):
            found.append(node)
    if handles_modes(rel, index):
        for node in _of(index, ast.BinOp):
            if isinstance(node.op, ast.Add) and _is_three(node.left):
                found.append(node)
        for node in _of(index, ast.Call):
            name = _call_name(node)
            if ((name == "range" and len(node.args) == 1 and _is_three(node.args[0]))
                    or (name in ("eye", "one_hot") and any(_is_three(a) for a in node.args))
                    or (name in SHAPE_CALLS and node.args and _is_three(node.args[-1]))):
                found.append(node)
        for node in _of(index, ast.Subscript):
            elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else []
            if elts and isinstance(elts[0], ast.Constant) and elts[0].value is Ellipsis:
                last = elts[-1]
                bounds = [last.lower, last.upper] if isinstance(last, ast.Slice) else [last]
                if any(b is not None and _is_three(b) for b in bounds):
                    found.append(node)
    return [f"{rel}:{node.lineno}: {ast.unparse(node)}" for node in found]


def kernel_imports(rel: str, index) -> list[str]:
    """Imports of megatron_triroute (statements, or a module name handed to an import call)."""
    found = []
    for node in _of(index, ast.Import, ast.ImportFrom, ast.Call):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and _call_name(node) in ("import_module", "__import__", "find_spec"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if any(n.split(".")[0] == "megatron_triroute" for n in names):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def _router_bits_default(index) -> ast.AST | None:
    for cls in _of(index, ast.ClassDef):
        if cls.name == "RouterConfig":
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == "bits":
                    return stmt.value
    return None


def second_definitions(rel: str, index, widths: tuple[int, ...], mode_names: tuple[str, ...]) -> list[str]:
    """Outside their home module: an assignment to a contract name (`SUPPORTED_BITS`, `ATTN_MODES`,
    `N_MODES`, `SKIP`, ...), a literal collection of exactly the supported widths (except
    `RouterConfig.bits`' stated default), a literal collection of two or more mode names."""
    allowed = _router_bits_default(index) if rel == "megatron_triroute/config.py" else None
    found = []
    for node in _of(index, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Tuple, ast.List, ast.Set):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and HOMES.get(n.id, rel) != rel:
                        found.append(f"{rel}:{node.lineno}: assigns {n.id} (defined in {HOMES[n.id]})")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node is not allowed:
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            ints = sorted(v for v in values if type(v) is int)
            if rel != WIDTHS_HOME and ints == sorted(widths) and len(values) == len(node.elts):
                found.append(f"{rel}:{node.lineno}: the supported widths spelled out: {ast.unparse(node)}")
            if rel != MODES_HOME and sum(v in mode_names for v in values if isinstance(v, str)) >= 2:
                found.append(f"{rel}:{node.lineno}: attention mode names spelled out: {ast.unparse(node)}")
    return found


def _assigned_literal(path: Path, name: str):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} does not assign {name}")


def _sources(root: Path):
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            yield rel, _index(ast.parse(path.read_text(), rel))


def violations(root: Path = REPO) -> list[str]:
    """Every finding of every rule over the scanned packages of the checkout at `root`."""
    widths = _assigned_literal(root / WIDTHS_HOME, "SUPPORTED_BITS")
    mode_names = _assigned_literal(root / MODES_HOME, "ATTN_MODES")
    found = []
    config_imports_widths = False
    for rel, index in _sources(root):
        if rel.startswith("kernels/"):
            found += kernel_imports(rel, index)
        if rel != MODES_HOME:
            found += mode_count_literals(rel, index)
        found += second_definitions(rel, index, widths, mode_names)
        if rel == "megatron_triroute/config.py":
            config_imports_widths = any((n.module or "").startswith("triroute_kernels")
                                        and any(a.name == "SUPPORTED_BITS" for a in n.names)
                                        for n in _of(index, ast.ImportFrom))
    if not config_imports_widths:
        found.append("megatron_triroute/config.py: does not import SUPPORTED_BITS from triroute_kernels")
    return found


def _unexplained(found: list[str]) -> list[str]:
    known = [f for f in found if any(f.startswith(path + ":") and text in f for path, text in KNOWN_ELSEWHERE)]
    stale = [k for k in KNOWN_ELSEWHERE if not any(f.startswith(k[0] + ":") and k[1] in f for f in known)]
    return [f for f in found if f not in known] + [f"stale KNOWN_ELSEWHERE entry {k}" for k in stale]


def test_one_definition_of_modes_widths_and_the_kernels_package():
    assert _unexplained(violations()) == []


def _scan(rel: str, source: str, widths=(2, 4, 8, 16), mode_names=("skip", "local", "full")) -> list[str]:
    index = _index(ast.parse(source))
    return (kernel_imports(rel, index) if rel.startswith("kernels/") else []) + mode_count_literals(rel, index) \
        + second_definitions(rel, index, widths, mode_names)


def test_each_rule_catches_the_pattern_it_names():
    routing = "megatron_triroute/routing/x.py"
    caught = [
        ("kernels/torch_ops.py", "from megatron_triroute.routing.quant import pack_codes"),
        ("kernels/torch_ops.py", "import megatron_triroute.routing"),
        ("kernels/torch_ops.py", "importlib.import_module('megatron_triroute.config')"),
        ("megatron_triroute/model/x.py", "zeros = torch.zeros(b, s, H, 3)\nfrom ..routing.modes import FULL"),
        ("megatron_triroute/model/x.py", "y = lead.y.reshape(B, T, 3 * H)"),
        ("megatron_triroute/evaluation/x.py", "v = np.eye(3)[routing.attn]"),
        ("megatron_triroute/evaluation/x.py", "n = L * H * 3"),
        (routing, "feats[..., 3] = 1.0"),
        (routing, "feats[..., :3] = y"),
        (routing, "def size(b):\n    return 3 + 1 + b"),
        (routing, "a = [i for i in range(3)]"),
        (routing, "y = F.one_hot(h, 3)"),
        (routing, "BITS = (2, 4, 8, 16)"),
        (routing, "ok = b in [16, 8, 4, 2]"),
        (routing, "names = ('skip', 'full')"),
        (routing, "N_MODES = 3"),
        (routing, "SKIP, LOCAL = 0, 1"),
        ("megatron_triroute/config.py", "SUPPORTED_BITS = (2, 4, 8, 16)"),
    ]
    for rel, source in caught:
        assert _scan(rel, source), (rel, source)
    passes = [
        (routing, "if lp.dim() == 3: pass"),
        (routing, "flops = 3.0 * d * d_ff"),
        (routing, "lead = AxisDecision(*rest[:3])"),
        ("megatron_triroute/training/x.py", "for _ in range(3): pass"),
        ("megatron_triroute/training/x.py", "ffn = 3 * m.d_model * m.d_ff"),
        (routing, "checks = ('shared', 'full')"),
        (routing, "bits = (2, 4, 8)"),
        (routing, "p[FULL], p[LOCAL] = 0.5, 0.25"),  # indexing by a mode is a use, not a definition
        ("megatron_triroute/config.py", "class RouterConfig:\n    bits: tuple = (2, 4, 8, 16)"),
        (MODES_HOME, "ATTN_MODES = ('skip', 'local', 'full')"),
        (WIDTHS_HOME, "SUPPORTED_BITS = (2, 4, 8, 16)"),
        ("kernels/pool.py", "from .quant import SUPPORTED_BITS"),
    ]
    for rel, source in passes:
        assert not _scan(rel, source), (rel, source, _scan(rel, source))
