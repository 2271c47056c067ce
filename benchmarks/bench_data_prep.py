"""Throughput of the data pipeline on the embedded corpus, at 1 and 2 workers (not run in CI).

    python benchmarks/bench_data_prep.py [--max-docs N] [--max-bytes B] [--workers 1 2]
    python benchmarks/bench_data_prep.py --megatron-lm /path/to/Megatron-LM [--megatron-lm-pythonpath DIR]

1. Writes the embedded stdlib corpus and trains its tokenizer once (warm-up: imports paid,
   tokenizer trained, neither timed below).
2. For each worker count, times `build --tokenizer <that model>` in this process: parse, dedup,
   split, tokenize, token tables, buckets and final datasets. Prints documents/s and tokens/s,
   and the ratio of the last worker count to the first.
3. With --megatron-lm, runs that checkout's `tools/preprocess_data.py` (SentencePieceTokenizer,
   the same model, --append-eod) on the same documents as one JSON-lines file, and our CLI as a
   subprocess too, so both include interpreter start-up and imports; prints the ratio.
   Note that our pipeline also dedups, validates, splits and cuts buckets; theirs only tokenizes.
   Its training package imports six, regex, pyyaml and triton: install them somewhere (e.g.
   `pip install --target DIR six regex pyyaml triton`) and pass --megatron-lm-pythonpath DIR; that
   path is given to the Megatron-LM subprocess only.
Every timed run starts from an empty output directory (a leftover one would be resumed, not redone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.__main__ import main as data_prep_main  # noqa: E402
from data_prep.corpus import CorpusConfig, build_corpus  # noqa: E402


def _summary(output: Path) -> tuple[int, int]:
    summary = json.loads((output / "summary.json").read_text())
    return summary["documents"]["read"], summary["tokens"]["train"] + summary["tokens"]["valid"]


def _fresh(directory: Path) -> Path:
    if directory.exists():
        shutil.rmtree(directory)
    return directory


def _rate(label: str, docs: int, tokens: int, seconds: float) -> float:
    print(f"{label:<44} {seconds:7.2f} s  {docs / seconds:9.1f} docs/s  {tokens / seconds:11.0f} tokens/s")
    return tokens / seconds


def _quiet_build(args: list[str]) -> None:
    # The pipeline's own progress lines go to stderr; keep the benchmark table readable.
    with open(os.devnull, "w") as devnull:
        saved, sys.stderr = sys.stderr, devnull
        try:
            code = data_prep_main(args)
        finally:
            sys.stderr = saved
    if code != 0:
        raise SystemExit(f"data_prep {' '.join(args)} failed with {code}")


def _megatron_tokens(prefix: Path) -> int:
    from data_prep.megatron_io import open_dataset

    dataset = open_dataset(prefix)  # keep it alive: sequence_lengths is a view into its memory map
    return int(dataset.sequence_lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-docs", type=int, default=CorpusConfig.max_docs)
    parser.add_argument("--max-bytes", type=int, default=CorpusConfig.max_bytes)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout to compare with")
    parser.add_argument("--megatron-lm-pythonpath", default="", help="extra import path for that checkout's deps")
    parser.add_argument("--work-dir", type=Path, help="keep the outputs here (default: a temporary directory)")
    args = parser.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_data_prep_"))
    corpus = work / "corpus"
    build_corpus(corpus, CorpusConfig(max_docs=args.max_docs, max_bytes=args.max_bytes))
    _fresh(work / "warmup")
    start = time.perf_counter()
    _quiet_build(["build", "--input", str(corpus), "--output", str(work / "warmup")])
    model = work / "warmup" / "tokenizer" / "tokenizer.model"
    docs, tokens = _summary(work / "warmup")
    print(f"corpus: {docs} documents, {tokens} tokens; warm-up build incl. imports and tokenizer training: "
          f"{time.perf_counter() - start:.1f} s (cpus: {os.cpu_count()})")

    rates = {}
    for workers in args.workers:
        out = _fresh(work / f"ours-w{workers}")
        start = time.perf_counter()
        _quiet_build(["build", "--input", str(corpus), "--output", str(out), "--tokenizer", str(model),
                      "--workers", str(workers)])
        rates[workers] = _rate(f"data_prep build, {workers} worker(s), in-process", *_summary(out),
                               time.perf_counter() - start)
    if len(rates) > 1:
        first, last = args.workers[0], args.workers[-1]
        print(f"ratio {last}-worker / {first}-worker tokens/s: {rates[last] / rates[first]:.2f}")

    if args.megatron_lm:
        _compare_with_megatron(args, work, corpus, model)


def _corpus_as_jsonl(corpus: Path, target: Path) -> int:
    """The corpus shards as one plain JSON-lines file (what preprocess_data.py reads)."""
    import zstandard

    count = 0
    with open(target, "wb") as out:
        for shard in sorted(corpus.glob("*.jsonl.zst")):
            data = zstandard.ZstdDecompressor().stream_reader(shard.read_bytes(), read_across_frames=True).read()
            for line in data.splitlines():
                if line.strip():
                    out.write(line + b"\n")
                    count += 1
    return count


def _timed(command: list[str], env: dict, cwd: Path) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])} ... failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return elapsed


def _compare_with_megatron(args, work: Path, corpus: Path, model: Path) -> None:
    script = args.megatron_lm / "tools" / "preprocess_data.py"
    if not script.is_file():
        raise SystemExit(f"--megatron-lm {args.megatron_lm}: no tools/preprocess_data.py there")
    jsonl = work / "corpus.jsonl"
    docs = _corpus_as_jsonl(corpus, jsonl)
    # The checkout's own megatron package (core and training) must win over the installed one.
    theirs_env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(args.megatron_lm), args.megatron_lm_pythonpath, os.environ.get("PYTHONPATH", "")) if p)}
    ours_env = {**os.environ, "PYTHONPATH": str(REPO)}
    print("subprocess timings (interpreter start-up and imports included on both sides):")
    for workers in args.workers:
        prefix = _fresh(work / f"megatron-w{workers}") / "corpus"
        prefix.parent.mkdir(parents=True)
        seconds = _timed([sys.executable, str(script), "--input", str(jsonl), "--output-prefix", str(prefix),
                          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(model),
                          "--json-keys", "text", "--append-eod", "--workers", str(workers)], theirs_env, work)
        theirs = _rate(f"Megatron-LM preprocess_data.py, {workers} worker(s)", docs,
                       _megatron_tokens(Path(f"{prefix}_text_document")), seconds)
        out = _fresh(work / f"ours-cli-w{workers}")
        seconds = _timed([sys.executable, "-m", "data_prep", "build", "--input", str(corpus), "--output", str(out),
                          "--tokenizer", str(model), "--workers", str(workers)], ours_env, REPO)
        ours = _rate(f"data_prep CLI, {workers} worker(s)", *_summary(out), seconds)
        print(f"ratio data_prep / Megatron-LM tokens/s at {workers} worker(s): {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
