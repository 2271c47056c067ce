// The relaxed K/V write's values at every width (megatron_triroute/routing/quant.py,
// `quantized_values_torch`, the definition), registered as torch.ops.triroute.quantized_values:
//
//   out[b, t, w, :] = Q_{bits[w]}(x[b, t, :, :]),   x float32 (B, T, H_kv, d_h), out (B, T, |bits|, H_kv * d_h),
//
// per group of `group_size` channels of one head: scale = half((max - min) / (2^b - 1)),
// zero = half(min), code = min(max(round((x - zero) / s), 0), 2^b - 1) with s the scale or 1 where
// it is 0, value = code * scale, then + zero (two roundings: built with -ffp-contract=off); 16 bits:
// half(x). The same float32 operations as the tensor chain, in its order: the same bits, one pass
// over x instead of about twenty tensor ops per call.
//
// And the write itself, its sum over widths and that sum's gradient to the bit head (quant.py,
// `_RelaxedWrite`, whose batched matmuls are the definition), torch.ops.triroute.relaxed_write and
// relaxed_write_backward:
//
//   written[b, t, :] = sum_w y[b, t, w] * values[b, t, w, :]   (x's shape),
//   d y[b, t, w] = sum_i values[b, t, w, i] * grad[b, t, i],
//
// one call and one pass each way where the definition reshapes, expands, copies a strided
// gradient and calls a batched matmul. The widths' terms are added in order (the first product,
// then a fused multiply-add each): on straight-through one-hots every term is exact, so the written
// values are the chosen width's bit for bit; d y sums each row in eight running sums, then their
// tree (the matmul adds in another order: equal to rounding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "decode_ops.h"

namespace {

using at::Half;
using at::Tensor;

// A group holding a NaN has NaN statistics (group_range), hence NaN values at every width below 16.
inline void quantized_group(const float* x, int64_t gs, int levels_i, float* out) {
  const float levels = static_cast<float>(levels_i);
  float mn, mx;
  Half sh, zh;
  triroute_format::group_range(x, gs, &mn, &mx);
  triroute_format::group_scale_zero(mn, mx, levels_i, &sh, &zh);
  const float s = static_cast<float>(sh), z = static_cast<float>(zh);
  const float safe = s > 0.f ? s : 1.f;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vz = _mm256_set1_ps(z), vs = _mm256_set1_ps(s), vsafe = _mm256_set1_ps(safe);
  const __m256 vlev = _mm256_set1_ps(levels), vzero = _mm256_setzero_ps();
  for (; i + 8 <= gs; i += 8) {  // division, rounding, multiply and add each rounded as the scalar loop's
    __m256 q = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vz), vsafe);
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, vzero), vlev);
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(q, vs), vz));
  }
#endif
  for (; i < gs; ++i) {
    float q = std::rint((x[i] - z) / safe);  // round half to even (the default rounding mode)
    q = q < 0.f ? 0.f : q;  // a NaN stays NaN, as in the chain's clamp
    q = q > levels ? levels : q;
    out[i] = q * s + z;
  }
}

inline void half_rounded(const float* x, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(Half(x[i]));
}

Tensor quantized_values_cpu(const Tensor& x, at::IntArrayRef bits, int64_t group_size) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 4,
              "quantized_values takes a float32 CPU tensor (B, T, H_kv, d_h), got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(!bits.empty(), "quantized_values: no widths");
  const int64_t B = x.size(0), T = x.size(1), d_h = x.size(3), D = x.size(2) * d_h;
  TORCH_CHECK(group_size > 0 && d_h % group_size == 0, "group_size=", group_size, " must divide the head dim ", d_h);
  for (int64_t b : bits) TORCH_CHECK(b == 2 || b == 4 || b == 8 || b >= 16, "quantized_values: width ", b);
  const std::vector<int64_t> widths(bits.begin(), bits.end());
  const int64_t nb = static_cast<int64_t>(widths.size());
  const Tensor xc = x.contiguous();
  Tensor out = at::empty({B, T, nb, D}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = xp + n * D;
      for (int64_t w = 0; w < nb; ++w) {
        float* o = op + (n * nb + w) * D;
        if (widths[w] >= 16) {
          half_rounded(row, D, o);
          continue;
        }
        const int levels = (1 << widths[w]) - 1;
        for (int64_t g0 = 0; g0 < D; g0 += group_size) quantized_group(row + g0, group_size, levels, o + g0);
      }
    }
  });
  return out;
}


void check_written(const Tensor& values, const Tensor& weights) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kFloat && values.dim() == 4 &&
                  values.is_contiguous(),
              "relaxed_write: values must be contiguous float32 (B, T, widths, D), got ", values.sizes());
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 3 && weights.size(0) == values.size(0) &&
                  weights.size(1) == values.size(1) && weights.size(2) == values.size(2),
              "relaxed_write: weights must be float32 (B, T, widths) of values' (B, T, widths)");
}

Tensor relaxed_write_cpu(const Tensor& values, const Tensor& weights_in, at::IntArrayRef shape) {
  check_written(values, weights_in);
  const Tensor weights = weights_in.contiguous();
  const int64_t B = values.size(0), T = values.size(1), nb = values.size(2), D = values.size(3);
  Tensor out = at::empty(shape, values.options());
  TORCH_CHECK(out.numel() == B * T * D && shape.size() >= 2 && shape[0] == B && shape[1] == T,
              "relaxed_write: shape ", shape, " does not hold (B, T, D) = (", B, ", ", T, ", ", D, ")");
  const float* v = values.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* on = o + n * D;
      const float* vn = v + n * nb * D;
      const float w0 = w[n * nb];
      for (int64_t i = 0; i < D; ++i) on[i] = vn[i] * w0;
      for (int64_t b = 1; b < nb; ++b) {
        const float wb = w[n * nb + b];
        const float* vb = vn + b * D;
        for (int64_t i = 0; i < D; ++i) on[i] = std::fma(vb[i], wb, on[i]);
      }
    }
  });
  return out;
}

Tensor relaxed_write_backward_cpu(const Tensor& values, const Tensor& grad_in) {
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kFloat && values.dim() == 4 &&
                  values.is_contiguous(),
              "relaxed_write_backward: values must be contiguous float32 (B, T, widths, D)");
  const int64_t B = values.size(0), T = values.size(1), nb = values.size(2), D = values.size(3);
  TORCH_CHECK(grad_in.scalar_type() == at::kFloat && grad_in.numel() == B * T * D && grad_in.dim() >= 2 &&
                  grad_in.size(0) == B && grad_in.size(1) == T,
              "relaxed_write_backward: grad must be float32 of the written values' shape");
  const Tensor grad = grad_in.contiguous();
  Tensor d_w = at::empty({B, T, nb}, values.options());
  const float* v = values.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* dw = d_w.data_ptr<float>();
  at::parallel_for(0, B * T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) dw[n * nb + b] = triroute_sums::dot8(v + (n * nb + b) * D, g + n * D, D);
  });
  return d_w;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("quantized_values(Tensor x, int[] bits, int group_size) -> Tensor");
  m.def("relaxed_write(Tensor values, Tensor weights, int[] shape) -> Tensor");
  m.def("relaxed_write_backward(Tensor values, Tensor grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("quantized_values", &quantized_values_cpu);
  m.impl("relaxed_write", &relaxed_write_cpu);
  m.impl("relaxed_write_backward", &relaxed_write_backward_cpu);
}
