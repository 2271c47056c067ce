// The softmax over a routing axis's few options (megatron_triroute/routing/softmax.py, whose
// written-out tensor ops are the definition), registered as torch.ops.triroute.few_softmax:
//
//   y[r, o] = exp(z[r, o] - max_o z[r, o]) / sum_o exp(z[r, o] - max_o z[r, o])
//
// over the last dimension, in z's dtype (float32 or float64), one pass per row: one call instead of
// the five tensor ops (max, subtract, exp, sum, divide) PyTorch's CPU softmax kernel is avoided for.
//
// And the straight-through Gumbel sample of a routing axis built on it (megatron_triroute/routing/
// gumbel.py, `_StraightThroughPair`, whose tensor ops are the definition), torch.ops.triroute.st_gumbel
// and st_gumbel_backward, for float32 rows:
//
//   y~ = softmax((z + g) / tau),  y = y_cost = onehot(argmax y~),  hard = argmax z
//   d z_model = y~ (d y - d y . y~) / tau,  d z = y~ (d y_cost - d y_cost . y~) / tau
//
// the division by tau as float32's (PyTorch divides a float32 tensor by a Python float rounded to
// float32), the softmax as few_softmax's, each argmax the first maximum (a NaN first, as
// torch.argmax), the dot summed in order from zero (what PyTorch's softmax backward adds for a
// routing axis's few options): one call each way instead of eight ops an axis forward and four
// backward, the same bits.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

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


// The first maximum of n values (a NaN first, as torch.argmax takes it).
inline int64_t first_argmax(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t o = 1; o < n; ++o) {
    if (std::isnan(v[best])) break;
    if (std::isnan(v[o]) || v[o] > v[best]) best = o;
  }
  return best;
}

void check_st(const Tensor& a, const Tensor& b, const char* what) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                  a.sizes() == b.sizes() && a.dim() >= 1 && a.size(-1) >= 1 && a.size(-1) <= kMaxOptions,
              what, ": float32 CPU tensors of one shape with 1 to ", kMaxOptions, " options, got ", a.sizes(), " and ",
              b.sizes());
}

std::tuple<Tensor, Tensor, Tensor, Tensor> st_gumbel_cpu(const Tensor& z, const Tensor& noise, double tau) {
  check_st(z, noise, "st_gumbel");
  const Tensor zc = z.contiguous(), gc = noise.contiguous();
  const int64_t n = zc.size(-1), rows = zc.numel() / n;
  Tensor y_soft = at::empty_like(zc), y = at::empty_like(zc), y_cost = at::empty_like(zc);
  Tensor hard = at::empty(zc.sizes().slice(0, zc.dim() - 1), zc.options().dtype(at::kLong));
  const float t = static_cast<float>(tau);
  const float* zp = zc.data_ptr<float>();
  const float* gp = gc.data_ptr<float>();
  float* sp = y_soft.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* cp = y_cost.data_ptr<float>();
  int64_t* hp = hard.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* zr = zp + r * n;
      const float* gr = gp + r * n;
      float* sr = sp + r * n;
      for (int64_t o = 0; o < n; ++o) sr[o] = (zr[o] + gr[o]) / t;
      softmax_rows<float>(sr, sr, 1, n);
      const int64_t pick = first_argmax(sr, n);
      for (int64_t o = 0; o < n; ++o) yp[r * n + o] = cp[r * n + o] = o == pick ? 1.0f : 0.0f;
      hp[r] = first_argmax(zr, n);
    }
  });
  return {y, y_cost, y_soft, hard};
}

std::tuple<Tensor, Tensor> st_gumbel_backward_cpu(const Tensor& grad_y, const Tensor& grad_y_cost,
                                                  const Tensor& y_soft, double tau) {
  check_st(grad_y, y_soft, "st_gumbel_backward");
  check_st(grad_y_cost, y_soft, "st_gumbel_backward");
  const Tensor g1 = grad_y.contiguous(), g2 = grad_y_cost.contiguous(), ys = y_soft.contiguous();
  const int64_t n = ys.size(-1), rows = ys.numel() / n;
  Tensor d1 = at::empty_like(ys), d2 = at::empty_like(ys);
  const float t = static_cast<float>(tau);
  const float* yp = ys.data_ptr<float>();
  const float* gp[2] = {g1.data_ptr<float>(), g2.data_ptr<float>()};
  float* dp[2] = {d1.data_ptr<float>(), d2.data_ptr<float>()};
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* yr = yp + r * n;
      for (int v = 0; v < 2; ++v) {
        const float* gr = gp[v] + r * n;
        float* dr = dp[v] + r * n;
        float dot = 0.0f;
        for (int64_t o = 0; o < n; ++o) dot = dot + gr[o] * yr[o];
        for (int64_t o = 0; o < n; ++o) dr[o] = (yr[o] * (gr[o] - dot)) / t;
      }
    }
  });
  return {d1, d2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("few_softmax(Tensor z) -> Tensor");
  m.def("st_gumbel(Tensor z, Tensor noise, float tau) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("st_gumbel_backward(Tensor grad_y, Tensor grad_y_cost, Tensor y_soft, float tau) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("few_softmax", &few_softmax_cpu);
  m.impl("st_gumbel", &st_gumbel_cpu);
  m.impl("st_gumbel_backward", &st_gumbel_backward_cpu);
}
