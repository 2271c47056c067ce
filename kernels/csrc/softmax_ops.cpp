// The softmax over a routing axis's few options (megatron_triroute/routing/softmax.py, whose
// written-out tensor ops are the definition), registered as torch.ops.triroute.few_softmax:
//
//   y[r, o] = exp(z[r, o] - max_o z[r, o]) / sum_o exp(z[r, o] - max_o z[r, o])
//
// over the last dimension, in z's dtype (float32 or float64), one pass per row: one call instead of
// the five tensor ops (max, subtract, exp, sum, divide) PyTorch's CPU softmax kernel is avoided for.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace {

using at::Tensor;

constexpr int64_t kMaxOptions = 16;

template <typename T>
void softmax_rows(const T* z, T* y, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* zr = z + r * n;
      T* yr = y + r * n;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t o = 0; o < n; ++o) m = std::max(m, zr[o]);
      T s = 0;
      for (int64_t o = 0; o < n; ++o) {
        yr[o] = std::exp(zr[o] - m);
        s += yr[o];
      }
      for (int64_t o = 0; o < n; ++o) yr[o] /= s;
    }
  });
}

Tensor few_softmax_cpu(const Tensor& z) {
  TORCH_CHECK(z.device().is_cpu() && (z.scalar_type() == at::kFloat || z.scalar_type() == at::kDouble),
              "few_softmax takes a float32 or float64 CPU tensor");
  TORCH_CHECK(z.dim() >= 1 && z.size(-1) >= 1 && z.size(-1) <= kMaxOptions, "few_softmax: the last dimension has ",
              z.dim() ? z.size(-1) : 0, " options; it takes 1 to ", kMaxOptions);
  const Tensor zc = z.contiguous();
  Tensor y = at::empty_like(zc);
  const int64_t n = zc.size(-1), rows = zc.numel() / n;
  AT_DISPATCH_FLOATING_TYPES(zc.scalar_type(), "few_softmax", [&] {
    softmax_rows<scalar_t>(zc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) { m.def("few_softmax(Tensor z) -> Tensor"); }

TORCH_LIBRARY_IMPL(triroute, CPU, m) { m.impl("few_softmax", &few_softmax_cpu); }
