"""Peak memory of the Hugging Face export (`python -m megatron_triroute.export`) against the model's size.

    python benchmarks/bench_export_memory.py [--recipe 160m] [--data data/tiny] [--shards 8]
        [--workdir /tmp] [--keep] [--json] [--quick]

1. Builds the recipe's `TriRouteGPTModel` (its system; random weights, fp32) in this process at
   tensor/pipeline/expert 1/1/1 (a gloo group of one, `overhead.single_process_parallel`), saves it
   as a layout-independent checkpoint (`checkpoint.sharded.plan_state_save` through `store.save_checkpoint`,
   as training does) and frees it. The vocabulary is the recipe's (the data directory's tokenizer
   tables padded to it, as training pads them), so the embedding and LM head have the recipe's size.
2. Runs the export CLI in a fresh subprocess per row (`python -X importtime -m megatron_triroute.export
   --checkpoint ... --output ... --dtype D --max-shard-size S`) and reads that one process's peak RSS
   (`ru_maxrss` of `os.wait4` on it, forked from a small launcher interpreter: see `LAUNCHER`).
3. Baseline: a fresh interpreter that imports the same modules the export processes imported (the
   names `-X importtime` reports at the top level, in order) and nothing else; its peak RSS.

Reported: `model_bytes` (the bytes of every model tensor in the checkpoint, as its metadata records
them: what the exporter reads and holds), per row the peak RSS, the exported safetensors' tensor bytes
(from their headers), the shard count, and `ratio = (peak_rss - baseline_rss) / model_bytes`: 1 means
the export held the model once and nothing else. `bound` is what docs/export.md promises (the model
once, plus the query weights split out of the fused QKV, a reshape copy, plus at most one shard as
written, its views being copied as they are cast: 1 + (largest shard + query weights) / model bytes);
rows are marked against it in the output, never asserted. Rows: fp32 and bf16 with `--max-shard-size`
= model bytes / `--shards` (several shards), and fp32 with the CLI's default 5GB (one file at these
sizes). Measured: 160m 2 minutes, 410m 5 minutes (about 8 GiB at most) on 2 CPU cores.

`--quick` uses the `tiny` recipe's shape (under a minute; its ratios are dominated by allocator noise).
The scratch directory is removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

STEP = 1
DEFAULT_SHARD = "5GB"  # the CLI's default --max-shard-size
BYTES_PER_KIB = 1024  # ru_maxrss is in KiB on Linux


# --- the checkpoint ------------------------------------------------------------------------------------
def padded_tables(data: Path, vocab: int):
    """The data directory's token tables padded to `vocab` ids, as `train.py` pads them."""
    from megatron_triroute.routing.side_features import TokenTables
    from megatron_triroute.vocab import load_token_tables, tables_path

    log_prob, word_start, eod = load_token_tables(tables_path(data))
    n = log_prob.numel()
    if vocab < n:
        raise ValueError(f"the recipe's vocabulary ({vocab}) is smaller than the tokenizer's ({n})")
    pad = torch.full((vocab - n,), float(log_prob.min()))
    return TokenTables(torch.cat([log_prob, pad]), torch.cat([word_start, torch.zeros(vocab - n, dtype=torch.bool)]),
                       eod), n


def recipe_config(recipe: str, data: Path):
    """(run config, TriRouteConfig, tables, tokenizer vocab): the recipe's vocabulary, or the tokenizer's
    padded to a multiple of 128 when it is larger."""
    from megatron_triroute.training.data import padded_vocab
    from megatron_triroute.training.recipes import get_recipe
    from megatron_triroute.vocab import load_token_tables, tables_path

    run = get_recipe(recipe)
    cfg = run.triroute
    n = load_token_tables(tables_path(data))[0].numel()
    cfg.model.vocab_size = max(cfg.model.vocab_size, padded_vocab(n, 1))
    cfg.validate()
    tables, n = padded_tables(data, cfg.model.vocab_size)
    return run, cfg, tables, n


def write_checkpoint(root: Path, recipe: str, data: Path) -> dict:
    """Build the recipe's model in this process (1/1/1), save it under `root`, free it."""
    import torch.distributed as dist

    from megatron_triroute.checkpoint.sharded import GLOBAL_FORMAT, plan_state_save
    from megatron_triroute.checkpoint.store import save_checkpoint
    from megatron_triroute.distributed.one_process import single_process_parallel
    from megatron_triroute.model.gpt import TriRouteGPTModel
    from megatron_triroute.model.spec import transformer_config
    from megatron_triroute.routing.cost import expert_width

    run, cfg, tables, tokenizer_vocab = recipe_config(recipe, data)
    t0 = time.perf_counter()
    with single_process_parallel() as groups:
        torch.manual_seed(1234)
        model = TriRouteGPTModel(transformer_config(cfg), cfg, groups=groups, use_te=False, tables=tables)
        parameters = sum(p.numel() for p in model.parameters())
        built = time.perf_counter()
        meta = {"step": STEP, "config": {"name": run.name, "system": run.system, "triroute": cfg.to_dict(),
                                         "data": {"path": str(data)}},
                "checkpoint_format": GLOBAL_FORMAT,
                "layout": {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}}
        save_checkpoint(root, STEP, {}, meta, rank=0, world_size=1, barrier=dist.barrier,
                        write_extra=lambda directory: plan_state_save(directory, model, None))
        del model
    gc.collect()
    m, r = cfg.model, cfg.router
    return {"recipe": recipe, "system": run.system, "parameters": parameters,
            "shape": {"d_model": m.d_model, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
                      "d_ff": m.d_ff, "vocab_size": m.vocab_size, "tokenizer_vocab": tokenizer_vocab,
                      "num_experts": r.num_experts if r.expert_routing else 0,
                      "expert_width": expert_width(m, r) if r.expert_routing else 0},
            "build_s": built - t0, "save_s": time.perf_counter() - built}


def checkpoint_tensors(root: Path) -> dict[str, int]:
    """Model tensor name -> bytes, from the checkpoint's own metadata (nothing loaded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_triroute.checkpoint.sharded import read_metadata
    from megatron_triroute.checkpoint.store import latest_valid_checkpoint

    info = latest_valid_checkpoint(root)
    metadata = read_metadata(info.path / "sharded")
    return {k[len("model."):]: math.prod(v.size) * v.properties.dtype.itemsize
            for k, v in metadata.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# --- the export's safetensors --------------------------------------------------------------------------
def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def exported_tensors(directory: Path) -> dict[str, dict]:
    """file -> {tensor name -> bytes} of every weights file (headers only)."""
    return {f.name: {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in safetensors_header(f).items()}
            for f in sorted(Path(directory).glob("*.safetensors"))}


# --- measuring a child ---------------------------------------------------------------------------------
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execv(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
sys.stdout.flush()
print(f"\\nmaxrss_kib={usage.ru_maxrss}", flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""Runs one command and prints its peak RSS. A child's `ru_maxrss` starts at the RSS of the process
it was forked from (Linux records the old image's high-water mark at exec; Python's subprocess even
vforks), so the measured command is forked from this small interpreter (`python -S`, a few MiB),
not from the benchmark process, which holds torch and Megatron (and built the model)."""


def run_measured(argv: list[str], env: dict, stdout: bool = False) -> tuple:
    """(exit status, peak RSS in bytes of that one process, wall seconds, stderr[, stdout]) of `argv`."""
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, *argv], capture_output=True, text=True, env=env,
                         cwd=REPO)
    wall = time.perf_counter() - t0
    lines = run.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("maxrss_kib="):
        raise RuntimeError(f"no peak RSS from {argv[:4]}: exit {run.returncode}\n{run.stderr[-2000:]}")
    got = run.returncode, int(lines[-1].split("=", 1)[1]) * BYTES_PER_KIB, wall, run.stderr
    return got + ("\n".join(lines[:-1]),) if stdout else got


def top_level_imports(importtime: str) -> list[str]:
    """Modules imported directly by the running code (not by another import), in order, from the
    `-X importtime` lines `import time: self | cumulative | name` (nesting = two spaces per level)."""
    names = []
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        field = line.split("|", 2)[2]
        name = field.strip()
        if field[1:2] != " " and name and name != "imported package" and name not in names:
            names.append(name)
    return names


BASELINE = """
import importlib, json, sys
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name)
print(json.dumps(failed))
"""


def child_env() -> dict:
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(name, "1")
    return env


def export_row(name: str, checkpoint: Path, output: Path, dtype: str, max_shard: str, env: dict) -> tuple[dict, list]:
    argv = [sys.executable, "-X", "importtime", "-m", "megatron_triroute.export", "--checkpoint", str(checkpoint),
            "--output", str(output), "--dtype", dtype, "--max-shard-size", max_shard]
    rc, peak, wall, err = run_measured(argv, env)
    if rc != 0:
        tail = "\n".join(line for line in err.splitlines() if not line.startswith("import time:"))[-3000:]
        raise RuntimeError(f"export {name} exited {rc}:\n{tail}")
    files = exported_tensors(output)
    shard_bytes = [sum(f.values()) for f in files.values()]
    row = {"name": name, "dtype": dtype, "max_shard_size": max_shard, "shards": len(files),
           "largest_shard_bytes": max(shard_bytes), "exported_tensor_bytes": sum(shard_bytes),
           "exported_tensors": sum(len(f) for f in files.values()), "peak_rss_bytes": peak, "wall_s": wall}
    return row, top_level_imports(err)


# --- the benchmark -------------------------------------------------------------------------------------
def measure(recipe: str, data: Path, shards: int, workdir: Path, keep: bool = False) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="bench_export_memory_", dir=workdir))
    try:
        ckpt = scratch / "checkpoints"
        print(f"[bench] building and saving the {recipe} model under {ckpt}", file=sys.stderr)
        result = write_checkpoint(ckpt, recipe, data)
        tensors = checkpoint_tensors(ckpt)
        model_bytes = sum(tensors.values())
        from megatron_triroute.inference.checkpoint import IGNORED

        shape = result["shape"]
        qkv = tensors["decoder.layers.self_attention.linear_qkv.weight"]
        query_split = qkv * shape["n_heads"] // (shape["n_heads"] + 2 * shape["n_kv_heads"])
        result.update(model_bytes=model_bytes, model_tensors=len(tensors), query_split_bytes=query_split,
                      training_only_bytes=sum(v for k, v in tensors.items() if k in IGNORED),
                      checkpoint_disk_bytes=directory_bytes(ckpt))
        sharded = str(math.ceil(model_bytes / shards))
        plan = [("fp32_sharded", "fp32", sharded), ("bf16_sharded", "bf16", sharded),
                ("fp32_one_file", "fp32", DEFAULT_SHARD)]
        env, rows, modules = child_env(), [], []
        for name, dtype, max_shard in plan:
            print(f"[bench] export {name} (--dtype {dtype} --max-shard-size {max_shard})", file=sys.stderr)
            out = scratch / f"hf_{name}"
            row, imported = export_row(name, ckpt, out, dtype, max_shard, env)
            modules += [m for m in imported if m not in modules]
            shutil.rmtree(out)
            rows.append(row)
        print(f"[bench] baseline: a fresh interpreter importing the export's {len(modules)} top-level modules",
              file=sys.stderr)
        rc, baseline, _, err, out = run_measured([sys.executable, "-c", BASELINE, *modules], env, stdout=True)
        if rc != 0:
            raise RuntimeError(f"baseline exited {rc}: {err[-2000:]}")
        result.update(baseline_rss_bytes=baseline, baseline_modules=modules,
                      baseline_import_failures=json.loads(out.strip().splitlines()[0]))
        for row in rows:
            # A shard's views are copied as written: cast straight to bf16, or cloned at fp32.
            row["ratio"] = (row["peak_rss_bytes"] - baseline) / model_bytes
            row["bound"] = 1 + (min(row["largest_shard_bytes"], model_bytes) + query_split) / model_bytes
            row["within_bound"] = row["ratio"] <= row["bound"]
        result["runs"] = rows
        result["max_ratio"] = max(r["ratio"] for r in rows)
        result["sharded_fp32_ratio"] = rows[0]["ratio"]
        return result
    finally:
        if keep:
            print(f"[bench] kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def table(result: dict) -> str:
    s = result["shape"]
    lines = [f"recipe {result['recipe']} ({result['system']}): d_model {s['d_model']}, {s['n_layers']} layers, "
             f"{s['num_experts']} experts of width {s['expert_width']}, vocab {s['vocab_size']} "
             f"(tokenizer {s['tokenizer_vocab']}, padded); {result['parameters']:,} parameters",
             f"checkpoint model tensors: {result['model_bytes']:,} B ({mib(result['model_bytes'])} MiB, "
             f"{result['model_tensors']} tensors); on disk {mib(result['checkpoint_disk_bytes'])} MiB",
             f"baseline (fresh interpreter, the export's {len(result['baseline_modules'])} top-level imports): "
             f"{mib(result['baseline_rss_bytes'])} MiB",
             "",
             f"{'row':<14} {'dtype':<5} {'max shard':>12} {'shards':>6} {'exported MiB':>12} {'peak RSS MiB':>12} "
             f"{'ratio':>6} {'bound':>6}  {'wall s':>6}",
             ]
    for r in result["runs"]:
        lines.append(f"{r['name']:<14} {r['dtype']:<5} {r['max_shard_size']:>12} {r['shards']:>6} "
                     f"{mib(r['exported_tensor_bytes']):>12} {mib(r['peak_rss_bytes']):>12} {r['ratio']:>6.2f} "
                     f"{r['bound']:>6.2f}{'' if r['within_bound'] else ' !'} {r['wall_s']:>6.1f}")
    lines += ["", "ratio = (peak RSS - baseline) / model bytes; bound = 1 + (largest shard as written + "
              f"query weights split from QKV, {mib(result['query_split_bytes'])} MiB) / model bytes, what "
              "docs/export.md promises ('!' = above it)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="160m", help="a recipe of megatron_triroute.training.recipes (SCALE[-SYSTEM])")
    p.add_argument("--data", type=Path, default=REPO / "data" / "tiny", help="a data_prep output (its tokenizer)")
    p.add_argument("--shards", type=int, default=8, help="sharded rows: --max-shard-size = model bytes / SHARDS")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the scratch dir goes")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and scratch directory")
    p.add_argument("--json", action="store_true", help="print one JSON object to stdout (the table to stderr)")
    p.add_argument("--quick", action="store_true", help="the tiny recipe's shape, in seconds")
    args = p.parse_args(argv)
    recipe = "tiny" if args.quick else args.recipe
    data = args.data.resolve()
    if not (data / "tokenizer" / "token_tables.safetensors").is_file():
        p.error(f"{data} is not a data_prep output (no tokenizer/token_tables.safetensors); pass --data DIR")
    if args.json:  # stdout carries the object only: libraries' log lines (DeepSpeed's go to stdout) -> stderr
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    result = measure(recipe, data, args.shards, args.workdir, args.keep)
    result.update(quick=args.quick, shards_requested=args.shards, torch=torch.__version__,
                  python=platform.python_version(), machine=platform.machine())
    if args.json:
        print(table(result), file=sys.stderr)
        sys.stdout.flush()
        print(json.dumps(result, indent=2), file=json_out, flush=True)
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
