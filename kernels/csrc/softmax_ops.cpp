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
//   y~ = softmax((z + g) / tau),  y = y_cost = onehot(argmax y~)
//   d z_model = y~ (d y - d y . y~) / tau,  d z = y~ (d y_cost - d y_cost . y~) / tau
//
// the division by tau as float32's (PyTorch divides a float32 tensor by a Python float rounded to
// float32), the softmax as few_softmax's, each argmax the first maximum (a NaN first, as
// torch.argmax), the dot summed in order from zero (what PyTorch's softmax backward adds for a
// routing axis's few options): one call each way instead of eight ops an axis forward and four
// backward, the same bits.
//
// And the expert gates (megatron_triroute/routing/gating.py, `top_k_gating` and `_RenormalisedGates`,
// the definition), torch.ops.triroute.top_k_gates and top_k_gates_backward, for float32 rows:
//
//   S = the k largest options (a stable descending sort's first k: ties to the lower option),
//   w = p_S / max(sum p_S, 1e-20),   d p_S = (d w - d w . w) / max(sum p_S, 1e-20),  d p = 0 off S
//
// the sums added in order from zero: one call each way instead of six ops forward and six backward.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "decode_ops.h"

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


void check_st(const Tensor& a, const Tensor& b, const char* what) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
                  a.sizes() == b.sizes() && a.dim() >= 1 && a.size(-1) >= 1 && a.size(-1) <= kMaxOptions,
              what, ": float32 CPU tensors of one shape with 1 to ", kMaxOptions, " options, got ", a.sizes(), " and ",
              b.sizes());
}

std::tuple<Tensor, Tensor, Tensor> st_gumbel_cpu(const Tensor& z, const Tensor& noise, double tau) {
  check_st(z, noise, "st_gumbel");
  const Tensor zc = z.contiguous(), gc = noise.contiguous();
  const int64_t n = zc.size(-1), rows = zc.numel() / n;
  Tensor y_soft = at::empty_like(zc), y = at::empty_like(zc), y_cost = at::empty_like(zc);
  const float t = static_cast<float>(tau);
  const float* zp = zc.data_ptr<float>();
  const float* gp = gc.data_ptr<float>();
  float* sp = y_soft.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* cp = y_cost.data_ptr<float>();
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* zr = zp + r * n;
      const float* gr = gp + r * n;
      float* sr = sp + r * n;
      for (int64_t o = 0; o < n; ++o) sr[o] = (zr[o] + gr[o]) / t;
      softmax_rows<float>(sr, sr, 1, n);
      const int64_t pick = triroute_choice::priced_argmax(sr, nullptr, n);
      for (int64_t o = 0; o < n; ++o) yp[r * n + o] = cp[r * n + o] = o == pick ? 1.0f : 0.0f;
    }
  });
  return {y, y_cost, y_soft};
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


// The k options of a row in a stable descending sort's order (a NaN first, as torch.sort's).
inline void top_options(const float* p, int64_t n, int64_t k, int64_t* out) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t o = 0; o < n; ++o) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || out[i] == o;
      if (taken) continue;
      if (best < 0 || (!std::isnan(p[best]) && (std::isnan(p[o]) || p[o] > p[best]))) best = o;
    }
    out[j] = best;
  }
}

std::tuple<Tensor, Tensor, Tensor> top_k_gates_cpu(const Tensor& probs, int64_t k) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.dim() >= 1 &&
                  probs.size(-1) >= 1 && probs.size(-1) <= kMaxOptions,
              "top_k_gates: float32 CPU probabilities of 1 to ", kMaxOptions, " options, got ", probs.sizes());
  const int64_t n = probs.size(-1);
  TORCH_CHECK(k >= 1 && k <= n, "top_k_gates: k=", k, " must be in [1, ", n, "]");
  const Tensor pc = probs.contiguous();
  const int64_t rows = pc.numel() / n;
  std::vector<int64_t> shape(pc.sizes().begin(), pc.sizes().end());
  shape.back() = k;
  Tensor option = at::empty(shape, pc.options().dtype(at::kLong));
  Tensor weight = at::empty(shape, pc.options());
  shape.back() = 1;
  Tensor total = at::empty(shape, pc.options());
  const float* pp = pc.data_ptr<float>();
  int64_t* op = option.data_ptr<int64_t>();
  float* wp = weight.data_ptr<float>();
  float* tp = total.data_ptr<float>();
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* pr = pp + r * n;
      int64_t* sel = op + r * k;
      top_options(pr, n, k, sel);
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum = sum + pr[sel[j]];
      sum = std::isnan(sum) ? sum : std::max(sum, 1e-20f);
      tp[r] = sum;
      for (int64_t j = 0; j < k; ++j) wp[r * k + j] = pr[sel[j]] / sum;
    }
  });
  return {option, weight, total};
}

Tensor top_k_gates_backward_cpu(const Tensor& grad, const Tensor& option, const Tensor& probs, const Tensor& total) {
  TORCH_CHECK(grad.scalar_type() == at::kFloat && probs.scalar_type() == at::kFloat &&
                  option.scalar_type() == at::kLong && grad.sizes() == option.sizes() && probs.dim() == grad.dim() &&
                  total.numel() * grad.size(-1) == grad.numel() && probs.numel() / probs.size(-1) == total.numel(),
              "top_k_gates_backward: grad float32 and option int64 of one shape (..., k), probs float32 (..., n), "
              "total (..., 1)");
  const Tensor g = grad.contiguous(), o = option.contiguous(), p = probs.contiguous(), t = total.contiguous();
  const int64_t k = g.size(-1), n = p.size(-1), rows = g.numel() / k;
  Tensor d = at::zeros(p.sizes(), p.options());
  const float* gp = g.data_ptr<float>();
  const int64_t* opp = o.data_ptr<int64_t>();
  const float* pp = p.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  float* dp = d.data_ptr<float>();
  for (int64_t i = 0; i < rows * k; ++i)
    TORCH_CHECK(opp[i] >= 0 && opp[i] < n, "top_k_gates_backward: option ", opp[i], " is not one of ", n);
  at::parallel_for(0, rows, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* sel = opp + r * k;
      float dot = 0.0f;  // d w . w, the gates recomputed as the forward made them
      for (int64_t j = 0; j < k; ++j) dot = dot + gp[r * k + j] * (pp[r * n + sel[j]] / tp[r]);
      for (int64_t j = 0; j < k; ++j) dp[r * n + sel[j]] = (gp[r * k + j] - dot) / tp[r];
    }
  });
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("few_softmax(Tensor z) -> Tensor");
  m.def("st_gumbel(Tensor z, Tensor noise, float tau) -> (Tensor, Tensor, Tensor)");
  m.def("st_gumbel_backward(Tensor grad_y, Tensor grad_y_cost, Tensor y_soft, float tau) -> (Tensor, Tensor)");
  m.def("top_k_gates(Tensor probs, int k) -> (Tensor, Tensor, Tensor)");
  m.def("top_k_gates_backward(Tensor grad, Tensor option, Tensor probs, Tensor total) -> Tensor");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("few_softmax", &few_softmax_cpu);
  m.impl("st_gumbel", &st_gumbel_cpu);
  m.impl("st_gumbel_backward", &st_gumbel_backward_cpu);
  m.impl("top_k_gates", &top_k_gates_cpu);
  m.impl("top_k_gates_backward", &top_k_gates_backward_cpu);
}
