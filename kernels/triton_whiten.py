"""The controller's whitened heads as one Triton launch each way (and a fixed-order sum of the
launch's partial column sums), on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1): the values
of `megatron_triroute.routing.whitened_heads`' tensor ops (the definition), as the C++ kernels
`torch.ops.triroute.whiten_heads` / `whiten_heads_backward` compute them on a CPU:

    s = (u - mean) / denom,   z = gain * s + bias,
    du = dz * (gain / denom),   d gain = sum_rows dz * s,   d bias = sum_rows dz

for u (N, D) holding up to MAX_HEADS heads' columns end to end, mean and denom (D,) the heads' end to
end (as `RunningWhitening.standardisation` keeps them), each head's gain and bias its own tensors.
Each program takes ROWS rows and every column: z, s and du rounded as the definition's ops round them
(true division, no fused multiply-add: their bits); its rows' column sums go to one
row of partial sums, which one `sum` over the programs adds in a fixed order (no atomics: the same
bits every run). A training forward's partials are laid out as the heads' accumulators end to end
([count, sums(d_i), sums of squares(d_i)] each, float64, the statistics' precision), added to them by
one multi-tensor add; the backward's (d gain, d bias) in float32, as the definition sums.

And the step's commit of the whitening statistics (`RunningWhitening.commit_torch`, the definition):
`whitening_commit_triton`, one program per module computing its new mean and var in float64 (no fused
multiply-add: the definition's bits), then multi-tensor copies into the modules' buffers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_HEADS = 3
"""Heads one launch takes (the controller's: attention, experts, bits)."""

MAX_COLUMNS = 256
"""Columns (all the heads' options) one program holds."""

ROWS = 32
"""Rows a program takes."""


@triton.jit
def _per_column(p0, p1, p2, c, d0, d1, D):
    """Each column's value of its head's vector (head 0: columns [0, d0), 1: [d0, d0 + d1), 2: the rest)."""
    in0 = c < d0
    in1 = (c >= d0) & (c < d0 + d1)
    in2 = (c >= d0 + d1) & (c < D)
    a = tl.load(p0 + c, mask=in0, other=0.0)
    b = tl.load(p1 + (c - d0), mask=in1, other=0.0)
    e = tl.load(p2 + (c - d0 - d1), mask=in2, other=0.0)
    return tl.where(in0, a, tl.where(in1, b, e))


@triton.jit
def _rows_block(pid, rows, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program pid's ROWS rows and every column (BLOCK_D of them, D real), with their masks."""
    r = pid * ROWS + tl.arange(0, ROWS)
    live = r < rows
    c = tl.arange(0, BLOCK_D)
    cm = c < D
    return r, live, c, cm, live[:, None] & cm[None, :]


@triton.jit
def _whiten_forward(u_ptr, mean_ptr, den_ptr, g0, g1, g2, b0, b1, b2, z_ptr, s_ptr, part_ptr,
                    rows, ldu, d0, d1, D, L, n_heads,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    r, live, c, cm, m2d = _rows_block(pid, rows, D, ROWS, BLOCK_D)
    u = tl.load(u_ptr + r.to(tl.int64)[:, None] * ldu + c[None, :], mask=m2d, other=0.0)
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    den = tl.load(den_ptr + c, mask=cm, other=1.0)
    st = tl.div_rn(u - mean[None, :], den[None, :])
    z = _per_column(g0, g1, g2, c, d0, d1, D)[None, :] * st + _per_column(b0, b1, b2, c, d0, d1, D)[None, :]
    at = r.to(tl.int64)[:, None] * D + c[None, :]
    tl.store(s_ptr + at, st, mask=m2d)
    tl.store(z_ptr + at, z, mask=m2d)
    if ACC:
        x = tl.where(m2d, u, 0.0).to(tl.float64)
        head = tl.where(c < d0, 0, tl.where(c < d0 + d1, 1, 2))
        start = tl.where(head == 0, 0, tl.where(head == 1, d0, d0 + d1))
        width = tl.where(head == 0, d0, tl.where(head == 1, d1, D - d0 - d1))
        first = start * 2 + head  # the head's accumulator's first entry (its count)
        row = part_ptr + pid.to(tl.int64) * L
        tl.store(row + first + 1 + (c - start), tl.sum(x, axis=0), mask=cm)
        tl.store(row + first + 1 + width + (c - start), tl.sum(x * x, axis=0), mask=cm)
        k = tl.arange(0, 4)
        count_at = tl.where(k == 0, 0, tl.where(k == 1, 1 + 2 * d0, 2 + 2 * (d0 + d1)))
        count = tl.zeros([4], dtype=tl.float64) + tl.sum(live.to(tl.float64), axis=0)
        tl.store(row + count_at, count, mask=k < n_heads)


@triton.jit
def _whiten_backward(dz_ptr, s_ptr, den_ptr, g0, g1, g2, du_ptr, part_ptr, rows, ldd, lds, d0, d1, D,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    r, live, c, cm, m2d = _rows_block(pid, rows, D, ROWS, BLOCK_D)
    dz = tl.load(dz_ptr + r.to(tl.int64)[:, None] * ldd + c[None, :], mask=m2d, other=0.0)
    st = tl.load(s_ptr + r.to(tl.int64)[:, None] * lds + c[None, :], mask=m2d, other=0.0)
    den = tl.load(den_ptr + c, mask=cm, other=1.0)
    ratio = tl.div_rn(_per_column(g0, g1, g2, c, d0, d1, D), den)
    tl.store(du_ptr + r.to(tl.int64)[:, None] * D + c[None, :], dz * ratio[None, :], mask=m2d)
    row = part_ptr + pid.to(tl.int64) * 2 * D
    tl.store(row + c, tl.sum(dz * st, axis=0), mask=cm)
    tl.store(row + D + c, tl.sum(dz, axis=0), mask=cm)


def fits(widths: tuple[int, ...]) -> bool:
    """Whether heads of these widths are the kernels' layout: 1 to MAX_HEADS heads, MAX_COLUMNS
    columns in all."""
    return 0 < len(widths) <= MAX_HEADS and 0 < sum(widths) <= MAX_COLUMNS and min(widths) > 0


def _three(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The heads' vectors as MAX_HEADS pointers (the missing ones the first's, never read)."""
    return [*tensors, *[tensors[0]] * (MAX_HEADS - len(tensors))]


def _widths(tensors: list[torch.Tensor]) -> tuple[int, int, int]:
    w = [t.shape[0] for t in tensors]
    return w[0], (w[1] if len(w) > 1 else 0), sum(w)


def whiten_heads_triton(u: torch.Tensor, mean: torch.Tensor, denom: torch.Tensor, gain: list[torch.Tensor],
                        bias: list[torch.Tensor], acc: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, s), each (N, D) contiguous; with `acc` (one float64 accumulator per head, else empty), the
    rows' count, column sums and sums of squares added to each."""
    d0, d1, D = _widths(gain)
    N = u.shape[0]
    z, s = torch.empty(N, D, dtype=u.dtype, device=u.device), torch.empty(N, D, dtype=u.dtype, device=u.device)
    programs = triton.cdiv(N, ROWS)
    L = D * 2 + len(gain)
    part = torch.empty(programs, L, dtype=torch.float64, device=u.device) if acc else z
    if N:
        _whiten_forward[(programs,)](u, mean, denom, *_three(gain), *_three(bias), z, s, part,
                                     N, u.stride(0), d0, d1, D, L, len(gain), ROWS=ROWS,
                                     BLOCK_D=triton.next_power_of_2(D), ACC=bool(acc), enable_fp_fusion=False)
    if acc and N:
        torch._foreach_add_(acc, list(part.sum(0).split([1 + 2 * g.shape[0] for g in gain])))
    return z, s


def whiten_heads_backward_triton(dz: torch.Tensor, s: torch.Tensor, denom: torch.Tensor, gain: list[torch.Tensor]
                                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(du (N, D) contiguous, [d gain_i], [d bias_i])."""
    d0, d1, D = _widths(gain)
    N = s.shape[0]
    du = torch.empty(N, D, dtype=dz.dtype, device=dz.device)
    programs = max(triton.cdiv(N, ROWS), 1)
    part = torch.zeros(programs, 2, D, dtype=torch.float32, device=dz.device)
    if N:
        _whiten_backward[(programs,)](dz, s, denom, *_three(gain), du, part, N, dz.stride(0), s.stride(0),
                                      d0, d1, D, ROWS=ROWS, BLOCK_D=triton.next_power_of_2(D),
                                      enable_fp_fusion=False)
    sums = part.sum(0)  # (2, D): [d gain; d bias]
    sizes = [g.shape[0] for g in gain]
    return du, list(sums[0].split(sizes)), list(sums[1].split(sizes))


@triton.jit
def _commit(flat_ptr, table_ptr, moments_ptr, old_mean_ptr, old_var_ptr, new_mean_ptr, new_var_ptr, seen_ptr,
            BLOCK: tl.constexpr):
    i = tl.program_id(0)
    at = tl.load(table_ptr + 3 * i)  # the module's accumulator [count, sums(d), squares(d)] in flat
    d = tl.load(table_ptr + 3 * i + 1)
    out = tl.load(table_ptr + 3 * i + 2)  # its first feature among all the modules' statistics
    keep = tl.load(moments_ptr)
    take = tl.load(moments_ptr + 1)
    count = tl.load(flat_ptr + at)
    seen = count > 0.0
    c = tl.where(count < 1.0, 1.0, count)
    for start in range(0, d, BLOCK):
        l = start + tl.arange(0, BLOCK)
        live = l < d
        bm = tl.load(flat_ptr + at + 1 + l, mask=live, other=0.0) / c
        bv = tl.load(flat_ptr + at + 1 + d + l, mask=live, other=0.0) / c - bm * bm
        bv = tl.where(bv < 0.0, 0.0, bv)
        om = tl.load(old_mean_ptr + out + l, mask=live, other=0.0)
        ov = tl.load(old_var_ptr + out + l, mask=live, other=0.0)
        nm = (keep * om.to(tl.float64) + take * bm).to(tl.float32)
        nv = (keep * ov.to(tl.float64) + take * bv).to(tl.float32)
        tl.store(new_mean_ptr + out + l, tl.where(seen, nm, om), mask=live)
        tl.store(new_var_ptr + out + l, tl.where(seen, nv, ov), mask=live)
    tl.store(seen_ptr + i, seen.to(tl.int64))


@functools.lru_cache(maxsize=None)
def _commit_tables(widths: tuple[int, ...], momentum: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per module (accumulator offset, features, first feature) as int64, and (m, 1 - m) as float64,
    made once per layout, momentum and device."""
    table, at, out = [], 0, 0
    for d in widths:
        table += [at, d, out]
        at, out = at + 1 + 2 * d, out + d
    made = (torch.tensor(table, dtype=torch.int64), torch.tensor([momentum, 1 - momentum], dtype=torch.float64))
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in made)
    return tuple(t.to(device) for t in made)


def whitening_commit_triton(reduced: list[torch.Tensor], mean: list[torch.Tensor], var: list[torch.Tensor],
                            steps: list[torch.Tensor], acc: list[torch.Tensor], momentum: float) -> None:
    """Each module's mean and var updated from its reduced accumulator (float64 [count, sums, squares]),
    its step count advanced where it saw tokens, its accumulator zeroed."""
    widths = tuple(m.numel() for m in mean)
    table, moments = _commit_tables(widths, float(momentum), mean[0].device)
    flat = torch.cat(reduced)
    old_mean, old_var = torch.cat(mean), torch.cat(var)
    new_mean, new_var = torch.empty_like(old_mean), torch.empty_like(old_var)
    seen = torch.empty(len(widths), dtype=torch.int64, device=old_mean.device)
    _commit[(len(widths),)](flat, table, moments, old_mean, old_var, new_mean, new_var, seen,
                            BLOCK=min(triton.next_power_of_2(max(widths)), 256), enable_fp_fusion=False)
    torch._foreach_copy_(mean, list(new_mean.split(widths)))
    torch._foreach_copy_(var, list(new_var.split(widths)))
    torch._foreach_add_(steps, list(seen.unbind()))
    torch._foreach_zero_(acc)
