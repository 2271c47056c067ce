"""The embedded default corpus: real text every Python installation ships.

- code (meta.pile_set_name = "Github"): each `*.py` file of the standard library
  (`sysconfig.get_paths()["stdlib"]`), one document per file;
- prose (meta.pile_set_name = "StdlibDocs"): per module, its module/class/function docstrings
  (extracted with `ast`, in source order, joined by blank lines), plus every `.txt` / `.rst`
  file found there (LICENSE, idlelib's NEWS, email/architecture.rst, ...).
Directories named test, tests, idle_test, site-packages, dist-packages, __pycache__ are skipped.

Files are visited in the order of sha256(relative path): deterministic, yet a spread sample
rather than only the alphabetically first modules when the cap cuts. Output is Pile-format
`.jsonl.zst` shards, so the default run exercises exactly the path real data takes.
The corpus differs between Python versions (the stdlib does); on one installation it is fixed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import zstandard

from data_prep.atomic import write_bytes_atomic
from data_prep.config import PrepError

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
CODE_DOMAIN = "Github"
PROSE_DOMAIN = "StdlibDocs"


@dataclass
class CorpusConfig:
    max_docs: int = 2000
    """Document cap. With `max_bytes` it keeps corpus + tokenizer (vocab 4000) + build well under
    two minutes on two CPU cores."""
    max_bytes: int = 6_000_000
    """Cap on the total UTF-8 text bytes (about half of a 3.11 stdlib's ~12 MB of .py source)."""
    max_file_bytes: int = 200_000
    """Larger single files (e.g. pydoc_data/topics.py, 750 kB of one string) are skipped."""
    shards: int = 4
    """Number of `.jsonl.zst` shards to split the documents over (contiguously, in order)."""

    def validate(self) -> None:
        for name in ("max_docs", "max_bytes", "max_file_bytes", "shards"):
            if getattr(self, name) < 1:
                raise PrepError(f"corpus.{name}={getattr(self, name)!r}: must be >= 1. Fix: pass a positive value.")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _candidate_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.suffix in (".py", ".txt", ".rst") and p.is_file()
             and not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest())


def docstrings(source: str) -> str:
    """Module, class and function docstrings of `source` in source order, joined by blank lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    nodes = [node for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))
    texts = [ast.get_docstring(node, clean=True) for node in nodes]
    return "\n\n".join(text for text in texts if text and text.strip())


def documents(config: CorpusConfig, root: Path | None = None):
    """(text, domain, relative path) in corpus order, until a cap is reached."""
    root = root or stdlib_root()
    count = size = 0
    for path in _candidate_files(root):
        if path.stat().st_size > config.max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are Latin-1 test data; not worth special-casing
        relative = str(path.relative_to(root))
        produced = [(text, CODE_DOMAIN if path.suffix == ".py" else PROSE_DOMAIN)]
        if path.suffix == ".py":
            produced.append((docstrings(text), PROSE_DOMAIN))
        for doc_text, domain in produced:
            if not doc_text.strip():
                continue
            if count >= config.max_docs or size + len(doc_text.encode("utf-8")) > config.max_bytes:
                return
            count += 1
            size += len(doc_text.encode("utf-8"))
            yield doc_text, domain, relative


def build_corpus(output: Path, config: CorpusConfig | None = None) -> list[Path]:
    """Write `output/stdlib-XX.jsonl.zst` shards; returns their paths."""
    config = config or CorpusConfig()
    config.validate()
    docs = list(documents(config))
    if not docs:
        raise PrepError(f"no readable .py/.txt/.rst files under {stdlib_root()}. Fix: pass --input with your own data.")
    output.mkdir(parents=True, exist_ok=True)
    for stale in output.glob("stdlib-*.jsonl.zst"):  # a previous run may have used more shards
        stale.unlink()
    shard_count = min(config.shards, len(docs))
    paths = []
    for index in range(shard_count):
        part = docs[index * len(docs) // shard_count:(index + 1) * len(docs) // shard_count]
        lines = b"".join(json.dumps({"text": text, "meta": {"pile_set_name": domain, "path": rel}},
                                    ensure_ascii=False).encode("utf-8") + b"\n" for text, domain, rel in part)
        path = output / f"stdlib-{index:02d}.jsonl.zst"
        write_bytes_atomic(path, zstandard.ZstdCompressor(level=3).compress(lines))
        paths.append(path)
    return paths
