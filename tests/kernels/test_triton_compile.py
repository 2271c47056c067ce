"""The training path's Triton kernels compiled for a GPU (sm_90, the H100 and H200) with the
compiler Triton ships, without a GPU: what the interpreter cannot show (the NVIDIA backend's type
rules, its lowering to PTX and ptxas) fails here before a GPU run does. Each kernel at the dtypes a
bf16 or fp32 step launches it with, every tensor argument 16-byte aligned as a launch specialises it."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from triroute_kernels import triton_gumbel, triton_mix, triton_quant, triton_routes, triton_whiten


def _compile(fn, types: dict, constants: dict, **options):
    signature = {n: "constexpr" if n in constants else types[n] for n in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], fn.__name__


def _strides(*names: str) -> dict:
    return {f"{n}_{axis}": "i64" for n in names for axis in ("b", "t", "h")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_mix_combine_and_write_kernels_compile_for_sm90(dtype):
    p = "*" + dtype
    _compile(triton_mix._mix_forward, dict(modes_ptr="*fp32", a0_ptr=p, a1_ptr=p, out_ptr=p, T="i32", H="i32", rows="i32",
                                           w_c="i64", c0="i64", c1="i64", **_strides("w", "a0", "a1", "o")),
             dict(D=64, M=2, ROWS=triton_mix.ROWS), enable_fp_fusion=False)
    _compile(triton_mix._mix_backward, dict(grad_ptr=p, modes_ptr="*fp32", a0_ptr=p, a1_ptr=p, da0_ptr=p, da1_ptr=p,
                                            dw_ptr="*fp32", T="i32", H="i32", rows="i32", n_modes="i32", w_c="i64",
                                            c0="i64", c1="i64", **_strides("g", "w", "a0", "a1", "d0", "d1")),
             dict(D=64, M=2, ROWS=triton_mix.ROWS), enable_fp_fusion=False)
    for weighted in (True, False):
        _compile(triton_mix._combine_forward, dict(y_ptr=p, inverse_ptr="*i64", index_ptr="*i64", weight_ptr="*fp32",
                                                   out_ptr=p, N="i32", D="i32"),
                 dict(K=2, ROWS=triton_mix.ROWS, BLOCK_D=triton_mix.BLOCK_D, WEIGHTED=weighted), enable_fp_fusion=False)
    _compile(triton_mix._combine_backward, dict(grad_ptr=p, y_ptr=p, order_ptr="*i64", index_ptr="*i64",
                                                weight_ptr="*fp32", dy_ptr=p, dw_ptr="*fp32", R="i32", D="i32"),
             dict(K=2, ROWS=triton_mix.ROWS, BLOCK_D=triton_mix.BLOCK_D), enable_fp_fusion=False)
    _compile(triton_quant._relaxed_write_kernel, dict(values_ptr=p, weights_ptr="*fp32", out_ptr=p, rows="i32", D="i32"),
             dict(NB=4, BLOCK=512, ROWS=8), enable_fp_fusion=False)
    _compile(triton_quant._relaxed_write_backward_kernel, dict(values_ptr=p, grad_ptr=p, dw_ptr="*fp32", rows="i32",
                                                               D="i32"),
             dict(NB=4, BLOCK=512, ROWS=8), enable_fp_fusion=False)


def test_the_sample_and_gate_kernels_compile_for_sm90():
    f32 = "*fp32"
    _compile(triton_gumbel._st_forward, dict(z_ptr=f32, g_ptr=f32, y_ptr=f32, c_ptr=f32, s_ptr=f32, rows="i32",
                                             n="i32", tau="fp32"), dict(N=4, ROWS=triton_gumbel.ROWS))
    _compile(triton_gumbel._st_backward, dict(g1_ptr=f32, g2_ptr=f32, s_ptr=f32, d1_ptr=f32, d2_ptr=f32, rows="i32",
                                              n="i32", tau="fp32"), dict(N=4, ROWS=triton_gumbel.ROWS))
    _compile(triton_gumbel._gates_forward, dict(p_ptr=f32, option_ptr="*i64", weight_ptr=f32, total_ptr=f32, rows="i32",
                                                n="i32"), dict(K=2, N=8, ROWS=triton_gumbel.ROWS))
    _compile(triton_gumbel._gates_backward, dict(g_ptr=f32, option_ptr="*i64", p_ptr=f32, total_ptr=f32, d_ptr=f32,
                                                 rows="i32", n="i32"), dict(K=3, KP=4, ROWS=triton_gumbel.ROWS))


def test_the_whitened_heads_kernels_compile_for_sm90():
    f32 = "*fp32"
    heads = {f"{p}{i}": f32 for p in "gb" for i in range(3)}
    for accumulate in (True, False):
        _compile(triton_whiten._whiten_forward, dict(u_ptr=f32, mean_ptr=f32, den_ptr=f32, **heads, z_ptr=f32,
                                                     s_ptr=f32, part_ptr="*fp64", rows="i32", ldu="i64", d0="i32",
                                                     d1="i32", D="i32", L="i32", n_heads="i32"),
                 dict(ROWS=triton_whiten.ROWS, BLOCK_D=64, ACC=accumulate), enable_fp_fusion=False)
    _compile(triton_whiten._whiten_backward, dict(dz_ptr=f32, s_ptr=f32, den_ptr=f32, **{k: f32 for k in heads if k[0] == "g"},
                                                  du_ptr=f32, part_ptr=f32, rows="i32", ldd="i64", lds="i64", d0="i32",
                                                  d1="i32", D="i32"),
             dict(ROWS=triton_whiten.ROWS, BLOCK_D=64), enable_fp_fusion=False)
    _compile(triton_whiten._commit, dict(flat_ptr="*fp64", table_ptr="*i64", moments_ptr="*fp64", old_mean_ptr=f32,
                                         old_var_ptr=f32, new_mean_ptr=f32, new_var_ptr=f32, seen_ptr="*i64"),
             dict(BLOCK=64), enable_fp_fusion=False)


def test_the_routes_sort_and_swap_margin_compile_for_sm90():
    _compile(triton_routes._sort_routes, dict(index_ptr="*i64", order_ptr="*i64", inverse_ptr="*i64",
                                              offsets_ptr="*i32", token_ptr="*i64", n="i32", k="i32", E="i32"),
             dict(BLOCK=triton_routes.BLOCK))
    for z in ("*fp32", "*fp64"):
        _compile(triton_routes._swap_forward, dict(z_ptr=z, index_ptr="*i64", runs_ptr="*fp64", slope_ptr="*fp64",
                                                   weakest_ptr="*i64", n="i32", E="i32"),
                 dict(K=2, ROWS=triton_routes.SWAP_ROWS))
        _compile(triton_routes._swap_backward, dict(grad_ptr="*fp64", slope_ptr="*fp64", weakest_ptr="*i64", dz_ptr=z,
                                                    n="i32", E="i32"),
                 dict(ROWS=triton_routes.SWAP_ROWS, BLOCK_E=8))
