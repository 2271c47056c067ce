// The functions decode_ops.cpp defines for the library's other sources (one declaration each):
// the number format's group statistics (quant_ops.cpp), a dot product's one order and the first
// argmax (every source), the weight-row matmul (layer_ops.cpp), and
// the CPU kernels of paged_attention, cache_append, decode_linear and routed_experts, which the ops
// dispatch to and decode_layer (layer_ops.cpp) calls directly.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace triroute_format {
// The minimum and maximum of a group of gs float32 values as the tensor chain's amin and amax give
// them: NaN where the group holds a NaN; in any order otherwise, exactly.
void group_range(const float* x, int64_t gs, float* min_out, float* max_out);
// scale = half((max - min) / levels), a true division (not a reciprocal multiply), zero = half(min).
void group_scale_zero(float mn, float mx, int levels, at::Half* scale, at::Half* zero);
}  // namespace triroute_format

namespace triroute_sums {
// sum_i a[i] * b[i] over n floats: eight running sums (lane j adds i = j, j + 8, ...), then their tree
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the products past the last eight in order.
// The one order of such a dot in the library (the attention's scalar scores, the training kernels'
// gradients to the routing decisions).
inline float dot8(const float* a, const float* b, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}
}  // namespace triroute_sums

namespace triroute_choice {
// The first index of the largest of n values z[i] - shift[i] (float64; shift null: 0), NaN largest:
// torch.argmax's choice (the decode step's priced decisions, training's straight-through samples).
inline int64_t priced_argmax(const float* z, const double* shift, int64_t n) {
  int64_t best = 0;
  double top = static_cast<double>(z[0]) - (shift ? shift[0] : 0.0);
  for (int64_t i = 1; i < n; ++i) {
    const double v = static_cast<double>(z[i]) - (shift ? shift[i] : 0.0);
    if (v > top || (std::isnan(v) && !std::isnan(top))) top = v, best = i;
  }
  return best;
}
}  // namespace triroute_choice

namespace triroute_linear {
// y [M, N] = x [M, K] w^T, w [N, K], float32, row-major: decode_linear's kernel (each block of eight
// rows of w read from memory once for every row of x, blocks spread over the threads), also for the
// small matmuls inside the fused ops of layer_ops.cpp; without AVX2 and FMA, at::mm, as decode_linear's
// fallback at::linear computes it.
// y's rows ldy floats apart (negative: N, y [M, N] contiguous).
void rows(const float* w, const float* x, int64_t M, int64_t N, int64_t K, float* y, int64_t ldy = -1);
}  // namespace triroute_linear

namespace triroute_decode {
at::Tensor paged_attention(const at::Tensor& q, at::TensorList k_data, at::TensorList k_scale,
                           at::TensorList k_zero, at::TensorList v_data, at::TensorList v_scale,
                           at::TensorList v_zero, at::TensorList token_pos, at::IntArrayRef bits, int64_t group_size,
                           const at::Tensor& page_tables, const at::Tensor& request, const at::Tensor& lo,
                           const at::Tensor& hi, double sm_scale, const at::Tensor& counters);
void cache_append(const at::Tensor& k, const at::Tensor& v, const at::Tensor& option, const at::Tensor& rows,
                  const at::Tensor& positions, const at::Tensor& counts, const at::Tensor& tables, int64_t page_size,
                  at::TensorList k_data, at::TensorList k_scale, at::TensorList k_zero, at::TensorList v_data,
                  at::TensorList v_scale, at::TensorList v_zero, at::TensorList token_pos, at::IntArrayRef bits,
                  int64_t group_size);
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weight, at::TensorList w1,
                          at::TensorList w3, at::TensorList w2);
}  // namespace triroute_decode
