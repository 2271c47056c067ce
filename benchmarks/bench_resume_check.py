"""What verifying a checkpoint costs a resume, per rank: every file's checksum on every rank three
times (the store's earlier resume path) against once per file over all ranks (`find_resume_checkpoint`).

    python benchmarks/bench_resume_check.py [--params 162e6] [--ranks 2] [--repeats 3] [--json]

Writes one checkpoint of fp32 parameters and two AdamW moments for `--params` parameters (the 160m
recipe's size by default) split over `--ranks` shard files, then times, interleaved and repeated:
- `before`: three full verifications (sizes and sha256 of every file), as `latest_valid_checkpoint`
  and the two `load_shards` calls of a resume each did, on every rank;
- `after`: one rank's share of the checksums (`verify_checkpoint(share=(0, ranks))`, the largest
  share) plus the two later looks, which find the directory unchanged and read no byte.
Prints median and spread of each and their ratio; and, from the bytes, what a resume of a
checkpoint of `--scale-bytes` (default 44e9: the 1p3b recipe's parameters and moments) reads in all
at `--scale-ranks` ranks before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(root: Path, params: int, ranks: int) -> Path:
    """One committed checkpoint, its `ranks` shards written by threads of this process."""
    import threading

    from megatron_triroute.checkpoint.store import save_checkpoint

    rows = params // ranks // 1024
    trees = {r: {name: torch.randn(rows, 1024) for name in ("param", "exp_avg", "exp_avg_sq")} for r in range(ranks)}
    barrier = threading.Barrier(ranks)
    threads = [threading.Thread(target=save_checkpoint, args=(root, 1, trees[r], {"step": 1}),
                                kwargs=dict(rank=r, world_size=ranks, barrier=barrier.wait)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return root / "step_00000001"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    from megatron_triroute.checkpoint import store

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=162e6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale-bytes", type=float, default=44e9)
    parser.add_argument("--scale-ranks", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_resume_check_") as tmp:
        path = build(Path(tmp), int(args.params), args.ranks)
        total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

        def before():
            for _ in range(3):
                store._VERIFIED.clear()
                assert store.verify_checkpoint(path, 1)[0] is None

        def after():
            store._VERIFIED.clear()
            assert store.verify_checkpoint(path, 1, share=(0, args.ranks))[0] is None
            store.trust_verified(path)
            for _ in range(2):
                assert store.verify_checkpoint(path, 1)[0] is None

        times = {"before": [], "after": []}
        for i in range(args.repeats):
            print(f"[bench_resume_check] repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
            for name, fn in (("before", before), ("after", after)) if i % 2 == 0 else (("after", after),
                                                                                       ("before", before)):
                times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "checkpoint_bytes": total, "ranks": args.ranks,
        "before_s": {"median": med["before"], "min": min(times["before"]), "max": max(times["before"])},
        "after_s": {"median": med["after"], "min": min(times["after"]), "max": max(times["after"])},
        "after_over_before": med["after"] / med["before"],
        "scaled": {"bytes": args.scale_bytes, "ranks": args.scale_ranks,
                   "bytes_read_before": 3 * args.scale_bytes * args.scale_ranks,
                   "bytes_read_after": args.scale_bytes},
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(f"checkpoint {total / 1e9:.2f} GB in {args.ranks} shards; per-rank verification time "
              f"before {med['before']:.2f} s [{min(times['before']):.2f}, {max(times['before']):.2f}], "
              f"after {med['after']:.2f} s [{min(times['after']):.2f}, {max(times['after']):.2f}]: "
              f"{report['after_over_before']:.3f}x")
        print(f"a resume of {args.scale_bytes / 1e9:.0f} GB at {args.scale_ranks} ranks reads "
              f"{report['scaled']['bytes_read_before'] / 1e12:.1f} TB for checksums before, "
              f"{args.scale_bytes / 1e9:.0f} GB after (each byte once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
