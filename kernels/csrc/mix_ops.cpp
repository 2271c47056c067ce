// Weighted sums of each token's candidates, with their gradients, as one kernel call each way:
//
// - The relaxed attention's mix of its reading modes (megatron_triroute/model/mode_mix.py, whose
//   tensor ops are the definition), torch.ops.triroute.mode_mix and mode_mix_backward:
//
//     out[b, t, h, :] = sum_m modes[b, t, h, c_m] * attn_m[b, t, h, :]
//     d attn_m = grad * modes[..., c_m, None],   d modes[..., c_m] = sum_d grad * attn_m  (0 elsewhere)
//
//   The definition's forward is a product and a multiply-add per mode (each an activation-sized
//   pass), its backward a product and a product-and-sum per mode, a zero column, a stack and a cast.
//   The forward's terms are added in the modes' order: the first mode's product, then each other
//   mode's by a fused multiply-add (PyTorch's vectorised `addcmul` fuses it: the same bits; on
//   straight-through one-hots every product is exact anyway); d attn is the same product. Any
//   strides with the channels contiguous; the output is laid out token-major ([t, b, h, :]
//   contiguous), the layout the output projection reads [T, B, H d] in, and each d attn_m as attn_m.
//
// - The experts' combine (megatron_triroute/experts/combine.py, the definition),
//   torch.ops.triroute.combine_routes and combine_routes_backward:
//
//     out[n] = sum_j weight[n, j] * (y[inverse[n k + j]] if index[n, j] >= 0 else 0)
//     d y[r] = grad[n] * weight[n, j] for the route n k + j = order[r],
//     d weight[n, j] = sum_d grad[n] * y[r]  (0 for a null route, whose row is never read)
//
//   The definition's forward is a gather, a select, a product and a sum; its backward an expand,
//   two products, a sum, a select and a gather. Each product is rounded, then the routes are added
//   in order from the first (the definition's `mul` then `sum(1)`), so out and d y are its bits.
//   Without weights (every weight 1, no product) combine_routes is the gradient of the tokens'
//   gather into expert order: each token's routes' rows summed, the null routes' left out.
//
// Float32 tensors; each d modes or d weight row summed in eight running sums, then their tree (the
// definition's `sum` adds in another order: equal to rounding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace {

using at::Tensor;

constexpr int64_t kMaxModes = 4;

void check_mix_args(const Tensor& modes, at::TensorList attn, at::IntArrayRef columns) {
  TORCH_CHECK(modes.device().is_cpu() && modes.scalar_type() == at::kFloat && modes.dim() == 4,
              "mode_mix: modes must be a float32 CPU tensor (B, T, H, n_modes), got ", modes.sizes());
  TORCH_CHECK(!attn.empty() && attn.size() <= static_cast<size_t>(kMaxModes) && attn.size() == columns.size(),
              "mode_mix: one modes column per attention output (1 to ", kMaxModes, "), got ", attn.size(),
              " outputs and ", columns.size(), " columns");
  for (size_t m = 0; m < attn.size(); ++m) {
    const Tensor& a = attn[m];
    TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == 4 && a.stride(3) == 1,
                "mode_mix: attention output ", m, " must be float32 (B, T, H, d) with contiguous channels");
    TORCH_CHECK(a.sizes() == attn[0].sizes(), "mode_mix: attention outputs of different shapes");
    TORCH_CHECK(a.size(0) == modes.size(0) && a.size(1) == modes.size(1) && a.size(2) == modes.size(2),
                "mode_mix: modes ", modes.sizes(), " do not match the attention outputs ", a.sizes());
    TORCH_CHECK(columns[m] >= 0 && columns[m] < modes.size(3), "mode_mix: column ", columns[m], " is not a mode");
  }
}

// fn(r, b, t, h) for every row r = (b, t, h) of B x T x H (row-major), the rows spread over the threads.
template <class F>
void for_each_row(int64_t B, int64_t T, int64_t H, F&& fn) {
  at::parallel_for(0, B * T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r, r / (H * T), (r / H) % T, r % H);
  });
}

inline int64_t at4(const Tensor& x, int64_t b, int64_t t, int64_t h) {
  return b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
}

Tensor mode_mix_cpu(const Tensor& modes, at::TensorList attn, at::IntArrayRef columns) {
  check_mix_args(modes, attn, columns);
  const int64_t B = attn[0].size(0), T = attn[0].size(1), H = attn[0].size(2), d = attn[0].size(3);
  const int64_t M = static_cast<int64_t>(attn.size());
  Tensor out = at::empty({T, B, H, d}, attn[0].options()).transpose(0, 1);  // token-major
  const float* w = modes.data_ptr<float>();
  const float* src[kMaxModes];
  for (int64_t m = 0; m < M; ++m) src[m] = attn[m].data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t wc = modes.stride(3);
  for_each_row(B, T, H, [&](int64_t, int64_t b, int64_t t, int64_t h) {
    const float* wr = w + at4(modes, b, t, h);
    float* o = dst + at4(out, b, t, h);
    const float w0 = wr[columns[0] * wc];
    const float* a0 = src[0] + at4(attn[0], b, t, h);
    for (int64_t i = 0; i < d; ++i) o[i] = a0[i] * w0;
    for (int64_t m = 1; m < M; ++m) {
      const float wm = wr[columns[m] * wc];
      const float* am = src[m] + at4(attn[m], b, t, h);
      for (int64_t i = 0; i < d; ++i) o[i] = std::fma(am[i], wm, o[i]);
    }
  });
  return out;
}

std::tuple<Tensor, std::vector<Tensor>> mode_mix_backward_cpu(const Tensor& grad, const Tensor& modes,
                                                              at::TensorList attn, at::IntArrayRef columns) {
  check_mix_args(modes, attn, columns);
  TORCH_CHECK(grad.device().is_cpu() && grad.scalar_type() == at::kFloat && grad.sizes() == attn[0].sizes() &&
                  grad.stride(3) == 1,
              "mode_mix_backward: grad must be float32 like the attention outputs, with contiguous channels");
  const int64_t B = attn[0].size(0), T = attn[0].size(1), H = attn[0].size(2), d = attn[0].size(3);
  const int64_t M = static_cast<int64_t>(attn.size()), n_modes = modes.size(3);
  Tensor d_modes = at::zeros({B, T, H, n_modes}, modes.options());
  std::vector<Tensor> d_attn;
  for (int64_t m = 0; m < M; ++m) d_attn.push_back(at::empty_like(attn[m]));  // attn_m's layout
  const float* w = modes.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* dw = d_modes.data_ptr<float>();
  const int64_t wc = modes.stride(3);
  for_each_row(B, T, H, [&](int64_t r, int64_t b, int64_t t, int64_t h) {
    const float* wr = w + at4(modes, b, t, h);
    const float* gr = g + at4(grad, b, t, h);
    for (int64_t m = 0; m < M; ++m) {
      const float wm = wr[columns[m] * wc];
      const float* am = attn[m].data_ptr<float>() + at4(attn[m], b, t, h);
      float* da = d_attn[m].data_ptr<float>() + at4(d_attn[m], b, t, h);
      for (int64_t i = 0; i < d; ++i) da[i] = gr[i] * wm;
      dw[r * n_modes + columns[m]] = triroute_sums::dot8(gr, am, d);
    }
  });
  return {d_modes, d_attn};
}


void check_combine_args(const Tensor& y, const Tensor& inverse, const Tensor& index, const Tensor& weight) {
  // weight undefined: every weight 1 (the tokens' gather's gradient: each token's routes summed)
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2,
              "combine_routes: y must be a float32 CPU tensor (routes, D), got ", y.sizes());
  TORCH_CHECK(index.dim() == 2 && index.scalar_type() == at::kLong, "combine_routes: index must be int64 (N, k)");
  TORCH_CHECK(!weight.defined() || (weight.sizes() == index.sizes() && weight.scalar_type() == at::kFloat),
              "combine_routes: weight must be float32 of index's shape ", index.sizes());
  TORCH_CHECK(inverse.dim() == 1 && inverse.scalar_type() == at::kLong && inverse.numel() == index.numel() &&
                  y.size(0) == index.numel(),
              "combine_routes: inverse (N k) and y's rows must number N k = ", index.numel());
}

Tensor combine_routes_cpu(const Tensor& y_in, const Tensor& inverse_in, const Tensor& index_in,
                          const c10::optional<Tensor>& weight_in) {
  const Tensor weight = weight_in.has_value() && weight_in->defined() ? weight_in->contiguous() : Tensor();
  check_combine_args(y_in, inverse_in, index_in, weight);
  const Tensor y = y_in.contiguous(), inverse = inverse_in.contiguous(), index = index_in.contiguous();
  const int64_t N = index.size(0), k = index.size(1), D = y.size(1), R = y.size(0);
  Tensor out = at::empty({N, D}, y.options());
  const float* yp = y.data_ptr<float>();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  const int64_t* idx = index.data_ptr<int64_t>();
  const float* w = weight.defined() ? weight.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < N * k; ++i)
    TORCH_CHECK(idx[i] < 0 || (inv[i] >= 0 && inv[i] < R), "combine_routes: inverse[", i, "]=", inv[i],
                " is not a row of y");
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* o = op + n * D;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t route = n * k + j;
        const float wj = w != nullptr ? w[route] : 1.0f;  // a product by 1 is the row itself, exactly
        const float* row = idx[route] >= 0 ? yp + inv[route] * D : nullptr;  // a null route's row is never read
        for (int64_t i = 0; i < D; ++i) {
          const float term = (row != nullptr ? row[i] : 0.0f) * wj;
          o[i] = j == 0 ? term : o[i] + term;
        }
      }
    }
  });
  return out;
}

std::tuple<Tensor, Tensor> combine_routes_backward_cpu(const Tensor& grad_in, const Tensor& y_in,
                                                       const Tensor& order_in, const Tensor& inverse_in,
                                                       const Tensor& index_in, const Tensor& weight_in) {
  TORCH_CHECK(weight_in.defined(), "combine_routes_backward: weight is needed");
  check_combine_args(y_in, inverse_in, index_in, weight_in);
  const Tensor grad = grad_in.contiguous(), y = y_in.contiguous(), order = order_in.contiguous(),
               index = index_in.contiguous(), weight = weight_in.contiguous();
  const int64_t N = index.size(0), k = index.size(1), D = y.size(1), R = y.size(0);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.size(0) == N && grad.size(1) == D,
              "combine_routes_backward: grad must be float32 (N=", N, ", D=", D, ")");
  TORCH_CHECK(order.dim() == 1 && order.scalar_type() == at::kLong && order.numel() == R,
              "combine_routes_backward: order must be int64 (N k)");
  Tensor d_y = at::empty({R, D}, y.options());
  Tensor d_weight = at::empty({N, k}, weight.options());
  const float* g = grad.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t* idx = index.data_ptr<int64_t>();
  const float* w = weight.data_ptr<float>();
  float* dy = d_y.data_ptr<float>();
  float* dw = d_weight.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ord[r] >= 0 && ord[r] < R, "combine_routes_backward: order[", r, "]=", ord[r], " is not a route");
  at::parallel_for(0, R, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t route = ord[r], n = route / k;
      const float* gr = g + n * D;
      const float wj = w[route];
      float* out = dy + r * D;
      for (int64_t i = 0; i < D; ++i) out[i] = gr[i] * wj;
      dw[route] = idx[route] >= 0 ? triroute_sums::dot8(gr, yp + r * D, D) : 0.0f;
    }
  });
  return {d_y, d_weight};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("mode_mix(Tensor modes, Tensor[] attn, int[] columns) -> Tensor");
  m.def("mode_mix_backward(Tensor grad, Tensor modes, Tensor[] attn, int[] columns) -> (Tensor, Tensor[])");
  m.def("combine_routes(Tensor y, Tensor inverse, Tensor index, Tensor? weight) -> Tensor");
  m.def(
      "combine_routes_backward(Tensor grad, Tensor y, Tensor order, Tensor inverse, Tensor index, Tensor weight) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("mode_mix", &mode_mix_cpu);
  m.impl("mode_mix_backward", &mode_mix_backward_cpu);
  m.impl("combine_routes", &combine_routes_cpu);
  m.impl("combine_routes_backward", &combine_routes_backward_cpu);
}
