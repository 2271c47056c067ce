"""What the GPU compiler makes of the all-pools Triton attention, without a GPU (not run in CI).

    python benchmarks/triton_resources.py [--arch 90] [key=value ...] [--json]

Compiles `triton_paged._paged_attention_kernel` ahead of time for a CUDA architecture (default
sm_90, the H100 and H200) with the ptxas that Triton ships, at the 160m shape (12 query heads,
3 KV heads, d 64, page 16, group 32, the 2/4/8/16-bit pools) and the module's knob defaults, and
prints the compiled kernel's resources: registers per thread, stack (spilled registers), shared
memory, warps, pipeline stages, the programs one multiprocessor can hold by registers (65,536 per SM
on Hopper), and the vector loads in its PTX. Every tensor argument is taken as 16-byte aligned, as a
launch specialises it (torch's allocations are), so loads vectorise as they do on the device. `key=value` overrides a compile-time constant (PB=2, NPOOLS=1,
BITS0=16, PREC=ieee, DOT=0, CODES=1, EARLY=1, ...) or an option (num_warps=2, num_stages=1,
maxnreg=128).

Why: decode attention on a GPU is bound by how many programs each multiprocessor keeps in flight
(docs/gpu.md); a variant's registers and spills are its device-independent proxy, read here for
free before GPU time is spent timing it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from triroute_kernels import triton_paged  # noqa: E402

REGISTERS_PER_SM = 65_536
SHAPE_160M = dict(H_Q=12, H_KV=3, G=4, GP=16, D=64, P=16, GROUP=32, NPOOLS=4, BITS0=2, BITS1=4, BITS2=8, BITS3=16)
OPTIONS = ("num_warps", "num_stages", "maxnreg")


def _arg_type(name: str) -> str:
    """The runtime argument types `paged_attention_triton` passes."""
    if name in ("R", "M", "pages_per_split") or name.startswith("rb"):
        return "i32"
    if name == "sm_scale":
        return "fp32"
    if name.startswith("pos") or name == "used_ptr":
        return "*i32"
    if name.startswith(("dk", "dv")):
        return "*u8"
    if name.startswith(("sk", "zk", "sv", "zv")):
        return "*fp16"
    if name in ("q_ptr", "out_ptr", "lse_ptr"):
        return "*fp32"
    return "*i64"


def defaults() -> dict:
    return SHAPE_160M | dict(PB=triton_paged.PAGES_PER_BLOCK, DOT=triton_paged.DOT, SKIP=triton_paged.SKIP_UNREAD,
                             PREC=triton_paged.PRECISION, PACKED=triton_paged.PACKED, EARLY=triton_paged.EARLY, CODES=triton_paged.CODES,
                             num_warps=triton_paged.NUM_WARPS)


def compile_report(arch: int = 90, **overrides) -> dict:
    """Compile the kernel for sm_`arch` at `defaults()` | overrides; its resources."""
    knobs = defaults() | overrides
    fn = triton_paged._paged_attention_kernel
    constants = {k: v for k, v in knobs.items() if k not in OPTIONS}
    unknown = set(constants) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"not compile-time constants of the kernel: {sorted(unknown)}")
    signature = {n: "constexpr" if n in constants else _arg_type(n) for n in fn.arg_names}
    # as a launch specialises them: every tensor argument 16-byte aligned (torch's allocations are)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")}
    options = {k: v for k, v in knobs.items() if k in OPTIONS}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=aligned),
                            target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    regs, warps = int(fields["REG"]), kernel.metadata.num_warps
    return {"knobs": {k: knobs[k] for k in sorted(knobs)}, "arch": f"sm_{arch}", "registers": regs,
            "stack_bytes": int(fields["STACK"]), "shared_bytes": kernel.metadata.shared, "num_warps": warps,
            "num_stages": kernel.metadata.num_stages,
            "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[248]\.", kernel.asm["ptx"])),
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (regs * 32 * warps)}


def _value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("overrides", nargs="*", help="KEY=VALUE compile-time constants or options")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    overrides = {k: _value(v) for k, v in (item.split("=", 1) for item in a.overrides)}
    report = compile_report(a.arch, **overrides)
    if a.json:
        print(json.dumps(report))
    else:
        print(f"{report['arch']}: {report['registers']} registers/thread, {report['stack_bytes']} B stack, "
              f"{report['shared_bytes']} B shared, {report['num_warps']} warps, {report['num_stages']} stages; "
              f"{report['programs_per_sm_by_registers']} programs per SM by registers, {report['vector_loads']} vector loads  "
              f"({a.overrides or 'defaults'})")
    return report


if __name__ == "__main__":
    main()
