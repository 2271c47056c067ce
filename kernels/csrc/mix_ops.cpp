// The relaxed attention's mix of its reading modes (megatron_triroute/model/attention.py, `_ModeMix`,
// whose tensor ops are the definition), registered as torch.ops.triroute.mode_mix and
// mode_mix_backward:
//
//   out[b, t, h, :] = sum_m modes[b, t, h, c_m] * attn_m[b, t, h, :]
//   d attn_m = grad * modes[..., c_m, None],   d modes[..., c_m] = sum_d grad * attn_m  (0 elsewhere)
//
// for float32 tensors, one pass over the rows each way: the definition's forward is a product and a
// multiply-add per mode (each an activation-sized pass), its backward a product and a product-and-sum
// per mode, a zero column, a stack and a cast. The forward's terms are added in the modes' order: the
// first mode's product, then each other mode's by a fused multiply-add (PyTorch's vectorised
// `addcmul` fuses it: the same bits; on straight-through one-hots every product is exact anyway);
// d attn is the same product;
// d modes sums each row in eight running sums, then their tree (the definition's `sum` adds in
// another order: equal to rounding). Any strides with the channels contiguous; the output is laid out
// token-major ([t, b, h, :] contiguous), the layout the output projection reads [T, B, H d] in,
// and each d attn_m as attn_m is laid out.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

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

// (b, t, h) of row r of B x T x H, row-major.
struct Rows {
  int64_t B, T, H;
  void split(int64_t r, int64_t& b, int64_t& t, int64_t& h) const {
    h = r % H;
    t = (r / H) % T;
    b = r / (H * T);
  }
};

inline int64_t at4(const Tensor& x, int64_t b, int64_t t, int64_t h) {
  return b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
}

// sum_i g[i] * a[i] over n channels: eight running sums (lane j adds i = j, j + 8, ...), then
// ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)), then the channels past the last eight in order.
inline float dot_rows(const float* g, const float* a, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += g[i + j] * a[i + j];
  float total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) total += g[i] * a[i];
  return total;
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
  const Rows rows{B, T, H};
  const int64_t wc = modes.stride(3);
  at::parallel_for(0, B * T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t b, t, h;
      rows.split(r, b, t, h);
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
  const Rows rows{B, T, H};
  const int64_t wc = modes.stride(3);
  at::parallel_for(0, B * T * H, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t b, t, h;
      rows.split(r, b, t, h);
      const float* wr = w + at4(modes, b, t, h);
      const float* gr = g + at4(grad, b, t, h);
      for (int64_t m = 0; m < M; ++m) {
        const float wm = wr[columns[m] * wc];
        const float* am = attn[m].data_ptr<float>() + at4(attn[m], b, t, h);
        float* da = d_attn[m].data_ptr<float>() + at4(d_attn[m], b, t, h);
        for (int64_t i = 0; i < d; ++i) da[i] = gr[i] * wm;
        dw[r * n_modes + columns[m]] = dot_rows(gr, am, d);
      }
    }
  });
  return {d_modes, d_attn};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("mode_mix(Tensor modes, Tensor[] attn, int[] columns) -> Tensor");
  m.def("mode_mix_backward(Tensor grad, Tensor modes, Tensor[] attn, int[] columns) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("mode_mix", &mode_mix_cpu);
  m.impl("mode_mix_backward", &mode_mix_backward_cpu);
}
