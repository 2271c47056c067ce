// Small fused ops of one decode layer for a decode step's few float32 rows, registered as
// torch.ops.triroute.*. Each replaces a chain of tensor ops (and their allocations and dispatches,
// which at one token per request cost more than the arithmetic); each equals its definition up
// to the order of the sums, or bit for bit where stated:
//
// - controller_logits (megatron_triroute/routing/controller.py, `TriRouteController._logits` with
//   the heads folded, is the definition):
//     a = [rms_norm(x) * g_in ; side],  h = rms_norm(W2 gelu(W1 a + b1) + b2) * g_trunk,  z = Wh h + bh
//   with the exact (erf) GELU; each weight read once for all rows (decode_linear's kernel).
// - rms_norm: x * rsqrt(mean(x^2) + eps) * g per row, as torch.nn.functional.rms_norm.
// - rms_norm_rstd, rms_norm_backward (training; megatron_triroute/routing/trunk_grad.py, `_rms_norm`
//   and `_rms_norm_torch_backward`, are the definitions): RMSNorm's forward with its reciprocal RMS
//   kept, and its backward, one pass over the rows each, for any number of rows.
// - decode_qkv (megatron_triroute/inference/attention.py, `attend`'s projections and `apply_rope`):
//   q = rope(x Wq^T), k = rope(x Wk^T), v = x Wv^T, each row of heads of width d rotated by the
//   row's (cos, sin) table as x * cos + rotate_half(x) * sin, in the same float32 operations as
//   apply_rope (bit for bit on the same projections). With `read` (a flag per query head), the Q
//   rows of the flagged heads only (the others zero, their weights not read): decode_layer passes
//   the heads some row reads.
//
// - decode_decisions (megatron_triroute/routing/controller.py, `decode_decisions`, is the caller;
//   the definitions: the controller's eval `_categorical` and `gating.top_k_gating`, with prices
//   `pricing._priced_axis` and `pricing._priced_experts`, and `controller.decision_features`):
//   per row, each attention head's mode and the bit-width as the first argmax of the logits less
//   their price shift (float64), one-hot; the experts' option probabilities p = softmax(z); the
//   top-k options of softmax(float32(z - shift)) (of p without prices), ties to the lower option;
//   gates p over the chosen set's sum of p; and psi's decision block of the row. Decisions bit for
//   bit; probabilities and gates up to exp's rounding and the order of the softmax's sum.
// - decode_layer (megatron_triroute/inference/model.py, `InferenceLayer.forward`, is the
//   definition): a decode layer's ops after its decisions (the norms, decode_qkv, cache_append,
//   paged_attention, the O projection, routed_experts, the residual adds) in one call, calling the
//   kernels above and decode_ops.cpp's directly: bit for bit the ops one by one.
//
// Built with -ffp-contract=off (cpu_ops.CFLAGS): no multiply-add is fused unless written so.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "decode_ops.h"

namespace {

using at::Tensor;

// out <- v * r * g, r = rsqrt(mean(v^2) + eps), over d values (out may be v); returns r. The squares
// are summed in Acc: float for the decode ops, double for training's rms_norm_rstd.
template <typename Acc = float>
inline float rms_norm_row(const float* v, const float* g, int64_t d, float eps, float* out) {
  Acc ss = 0;
  for (int64_t i = 0; i < d; ++i) ss += static_cast<Acc>(v[i]) * v[i];
  const float r = 1.f / std::sqrt(static_cast<float>(ss / static_cast<Acc>(d)) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = v[i] * r * g[i];
  return r;
}

void check_f32(const Tensor& t, const char* name, int64_t dim, const char* op = "controller_logits") {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous() && t.device().is_cpu(),
              op, ": ", name, " must be a contiguous float32 CPU tensor of ", dim, " dimensions, got ",
              t.scalar_type(), " ", t.sizes());
}

Tensor controller_logits_cpu(const Tensor& x, const Tensor& side, const Tensor& g_in, double eps_in, const Tensor& w1,
                             const Tensor& b1, const Tensor& w2, const Tensor& b2, const Tensor& g_trunk,
                             double eps_trunk, const Tensor& wh, const Tensor& bh) {
  check_f32(x, "x", 2);
  check_f32(side, "side", 2);
  for (const auto& [t, name] : {std::pair{&g_in, "g_in"}, {&b1, "b1"}, {&b2, "b2"}, {&g_trunk, "g_trunk"}, {&bh, "bh"}})
    check_f32(*t, name, 1);
  for (const auto& [t, name] : {std::pair{&w1, "w1"}, {&w2, "w2"}, {&wh, "wh"}}) check_f32(*t, name, 2);
  const int64_t M = x.size(0), D = x.size(1), S = side.size(1), R = w1.size(0), O = wh.size(0), K1 = D + S;
  TORCH_CHECK(side.size(0) == M && g_in.size(0) == D && w1.size(1) == K1 && b1.size(0) == R && w2.size(0) == R &&
                  w2.size(1) == R && b2.size(0) == R && g_trunk.size(0) == R && wh.size(1) == R && bh.size(0) == O,
              "controller_logits: shapes do not chain: x ", x.sizes(), ", side ", side.sizes(), ", w1 ", w1.sizes(),
              ", w2 ", w2.sizes(), ", wh ", wh.sizes());
  std::vector<float> a(M * K1), h1(M * R), h2(M * R);
  const float *xp = x.data_ptr<float>(), *sp = side.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* am = a.data() + m * K1;
    std::copy(xp + m * D, xp + (m + 1) * D, am);
    rms_norm_row(am, g_in.data_ptr<float>(), D, static_cast<float>(eps_in), am);
    std::copy(sp + m * S, sp + (m + 1) * S, am + D);
  }
  triroute_linear::rows(w1.data_ptr<float>(), a.data(), M, R, K1, h1.data());
  const float* b1p = b1.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      const float u = h1[m * R + r] + b1p[r];
      h1[m * R + r] = 0.5f * u * (1.f + std::erf(u * static_cast<float>(M_SQRT1_2)));
    }
  triroute_linear::rows(w2.data_ptr<float>(), h1.data(), M, R, R, h2.data());
  const float* b2p = b2.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < R; ++r) h2[m * R + r] += b2p[r];
    rms_norm_row(h2.data() + m * R, g_trunk.data_ptr<float>(), R, static_cast<float>(eps_trunk), h2.data() + m * R);
  }
  Tensor z = at::empty({M, O}, x.options());
  float* zp = z.data_ptr<float>();
  triroute_linear::rows(wh.data_ptr<float>(), h2.data(), M, O, R, zp);
  const float* bhp = bh.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t o = 0; o < O; ++o) zp[m * O + o] += bhp[o];
  return z;
}

Tensor rms_norm_cpu(const Tensor& x, const Tensor& g, double eps) {
  check_f32(x, "x", 2, "rms_norm");
  check_f32(g, "weight", 1, "rms_norm");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(g.size(0) == D, "rms_norm: weight has ", g.size(0), " values for rows of ", D);
  Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *gp = g.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) rms_norm_row(xp + m * D, gp, D, static_cast<float>(eps), yp + m * D);
  return y;
}

// rms_norm_rstd: (x * rstd * g, rstd) of rows x (M, D), rstd = 1 / sqrt(mean(x^2) + eps) (M, 1):
// `aten::_fused_rms_norm`'s outputs (a CPU has no kernel for it: six tensor ops): rms_norm_row with
// the squares summed in float64, the mean and rstd rounded to float32 as the tensor ops round them.
std::tuple<Tensor, Tensor> rms_norm_rstd_cpu(const Tensor& x, const Tensor& g, double eps) {
  check_f32(x, "x", 2, "rms_norm_rstd");
  check_f32(g, "weight", 1, "rms_norm_rstd");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(g.size(0) == D, "rms_norm_rstd: weight has ", g.size(0), " values for rows of ", D);
  Tensor y = at::empty_like(x), rstd = at::empty({M, 1}, x.options());
  const float *xp = x.data_ptr<float>(), *gp = g.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) rp[m] = rms_norm_row<double>(xp + m * D, gp, D, e, yp + m * D);
  });
  return {y, rstd};
}

// rms_norm_backward: (dx, dweight) of y = weight * x rstd over rows (`aten::_fused_rms_norm_backward`'s
// outputs, which a CPU has no kernel for; the formula is `trunk_grad._rms_norm_backward`'s):
//   x_hat = x rstd,  g = dy * weight,  dx = rstd (g - x_hat mean(g * x_hat)),  dweight = sum_rows dy * x_hat.
// dy may be a column slice (rows of any stride, unit stride along a row). The row means and the
// column sums are accumulated in float64.
std::tuple<Tensor, Tensor> rms_norm_backward_cpu(const Tensor& dy, const Tensor& x, const Tensor& rstd,
                                                 const Tensor& g) {
  check_f32(x, "x", 2, "rms_norm_backward");
  check_f32(g, "weight", 1, "rms_norm_backward");
  const int64_t M = x.size(0), D = x.size(1);
  TORCH_CHECK(dy.scalar_type() == at::kFloat && dy.dim() == 2 && dy.size(0) == M && dy.size(1) == D &&
                  dy.stride(1) == 1 && dy.device().is_cpu(),
              "rms_norm_backward: dy must be a float32 CPU tensor of x's shape ", x.sizes(),
              " with rows of unit stride, got ", dy.scalar_type(), " ", dy.sizes(), " strides ", dy.strides());
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == M && rstd.is_contiguous(),
              "rms_norm_backward: rstd must hold one contiguous float32 value per row of x, got ", rstd.sizes());
  TORCH_CHECK(g.size(0) == D, "rms_norm_backward: weight has ", g.size(0), " values for rows of ", D);
  Tensor dx = at::empty_like(x), dw = at::empty({D}, x.options());
  const float *dyp = dy.data_ptr<float>(), *xp = x.data_ptr<float>(), *rp = rstd.data_ptr<float>(),
              *gp = g.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *dwp = dw.data_ptr<float>();
  const int64_t lds = dy.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float *d = dyp + m * lds, *v = xp + m * D;
      const float r = rp[m];
      double s = 0.0;
      for (int64_t i = 0; i < D; ++i) s += static_cast<double>(d[i] * gp[i]) * (v[i] * r);
      const float mean = static_cast<float>(s / static_cast<double>(D));
      float* out = dxp + m * D;
      for (int64_t i = 0; i < D; ++i) out[i] = r * (d[i] * gp[i] - (v[i] * r) * mean);
    }
  });
  std::vector<double> acc(D, 0.0);
  for (int64_t m = 0; m < M; ++m) {
    const float *d = dyp + m * lds, *v = xp + m * D;
    const float r = rp[m];
    for (int64_t i = 0; i < D; ++i) acc[i] += static_cast<double>(d[i] * (v[i] * r));
  }
  for (int64_t i = 0; i < D; ++i) dwp[i] = static_cast<float>(acc[i]);
  return {dx, dw};
}

// Heads of width d in place: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
inline void rope_heads(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t h2 = d / 2;
  for (int64_t h = 0; h < heads; ++h, x += d)
    for (int64_t i = 0; i < h2; ++i) {
      const float x1 = x[i], x2 = x[i + h2];
      x[i] = x1 * cos[i] + (-x2) * sin[i];
      x[i + h2] = x2 * cos[i + h2] + x1 * sin[i + h2];
    }
}

// decode_qkv; with `read` (one flag per query head), the Q rows of only the heads whose flag is set,
// the others' left zero (a head no row reads: its weights are not read either). Each computed row of
// q has the bits it has without `read` (the same blocks of eight rows of wq, whole heads of them).
std::tuple<Tensor, Tensor, Tensor> decode_qkv_heads(const Tensor& x, const Tensor& wq, const Tensor& wk,
                                                    const Tensor& wv, const Tensor& cos, const Tensor& sin,
                                                    const std::vector<uint8_t>* read) {
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&wq, "wq"}, {&wk, "wk"}, {&wv, "wv"}, {&cos, "cos"}, {&sin, "sin"}})
    check_f32(*t, name, 2, "decode_qkv");
  const int64_t M = x.size(0), K = x.size(1), d = cos.size(1);
  TORCH_CHECK(d > 0 && d % 2 == 0 && sin.sizes() == cos.sizes() && cos.size(0) == M && wq.size(1) == K &&
                  wk.size(1) == K && wv.sizes() == wk.sizes() && wq.size(0) % d == 0 && wk.size(0) % d == 0,
              "decode_qkv: x [M, K], wq [H d, K], wk and wv [H_kv d, K], cos and sin [M, d] (d even), got x ",
              x.sizes(), ", wq ", wq.sizes(), ", wk ", wk.sizes(), ", wv ", wv.sizes(), ", cos ", cos.sizes());
  const int64_t H = wq.size(0) / d, Hk = wk.size(0) / d;
  TORCH_CHECK(read == nullptr || static_cast<int64_t>(read->size()) == H, "decode_qkv: one read flag per head");
  const bool every = read == nullptr || std::all_of(read->begin(), read->end(), [](uint8_t r) { return r != 0; });
  Tensor q = every ? at::empty({M, H, d}, x.options()) : at::zeros({M, H, d}, x.options()),
         k = at::empty({M, Hk, d}, x.options()), v = at::empty({M, Hk, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto is_read = [&](int64_t h) { return every || (*read)[h] != 0; };
  for (int64_t h0 = 0; h0 < H;) {  // each run of heads read (every head: one run), as one block of rows of wq
    if (!is_read(h0)) { ++h0; continue; }
    int64_t h1 = h0 + 1;
    while (h1 < H && is_read(h1)) ++h1;
    triroute_linear::rows(wq.data_ptr<float>() + h0 * d * K, xp, M, (h1 - h0) * d, K, q.data_ptr<float>() + h0 * d,
                          H * d);
    h0 = h1;
  }
  triroute_linear::rows(wk.data_ptr<float>(), xp, M, Hk * d, K, k.data_ptr<float>());
  triroute_linear::rows(wv.data_ptr<float>(), xp, M, Hk * d, K, v.data_ptr<float>());
  for (int64_t m = 0; m < M; ++m) {
    const float *c = cos.data_ptr<float>() + m * d, *s = sin.data_ptr<float>() + m * d;
    rope_heads(q.data_ptr<float>() + m * H * d, H, d, c, s);
    rope_heads(k.data_ptr<float>() + m * Hk * d, Hk, d, c, s);
  }
  return {q, k, v};
}

std::tuple<Tensor, Tensor, Tensor> decode_qkv_cpu(const Tensor& x, const Tensor& wq, const Tensor& wk,
                                                  const Tensor& wv, const Tensor& cos, const Tensor& sin,
                                                  const c10::optional<Tensor>& read) {
  if (!read) return decode_qkv_heads(x, wq, wk, wv, cos, sin, nullptr);
  TORCH_CHECK(read->scalar_type() == at::kBool && read->dim() == 1 && read->device().is_cpu(),
              "decode_qkv: read must be a bool CPU tensor [H] (one flag per query head), got ", read->scalar_type(),
              " ", read->sizes());
  const Tensor rc = read->contiguous();
  std::vector<uint8_t> flags(rc.data_ptr<bool>(), rc.data_ptr<bool>() + rc.numel());
  return decode_qkv_heads(x, wq, wk, wv, cos, sin, &flags);
}

// out <- softmax(v) over n float32 values: exp(v - max) times the reciprocal of their sum.
inline void softmax_row(const float* v, int64_t n, float* out) {
  float mx = v[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, v[i]);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(v[i] - mx));
  const float r = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) out[i] *= r;
}

// Row (b, t)'s values of a price shift (B or 1, T or 1, [1,] n) float64 with contiguous last
// dimension; null without a shift.
inline const double* shift_row(const c10::optional<Tensor>& s, int64_t b, int64_t t) {
  if (!s) return nullptr;
  return s->data_ptr<double>() + (s->size(0) == 1 ? 0 : b * s->stride(0)) + (s->size(1) == 1 ? 0 : t * s->stride(1));
}

void check_shift(const c10::optional<Tensor>& shift, int64_t B, int64_t T, int64_t n, int64_t dim, const char* name) {
  if (!shift) return;
  const Tensor& s = *shift;
  TORCH_CHECK(s.scalar_type() == at::kDouble && s.device().is_cpu() && s.dim() == dim && s.size(-1) == n &&
                  s.stride(-1) == 1 && (s.size(0) == B || s.size(0) == 1) && (s.size(1) == T || s.size(1) == 1) &&
                  (dim == 3 || s.size(2) == 1),
              "decode_decisions: ", name, " must be a float64 CPU tensor [B or 1, T or 1, ", dim == 4 ? "1, " : "", n,
              "] (B = ", B, ", T = ", T, ") with a contiguous last dimension, got ", s.scalar_type(), " ", s.sizes(),
              " strides ", s.strides());
}

// Logits (B, T, [H_a,] n) float32 on the CPU, each row's last dimensions contiguous.
void check_logits(const Tensor& z, int64_t dim, const char* name) {
  TORCH_CHECK(z.scalar_type() == at::kFloat && z.dim() == dim && z.device().is_cpu() && z.stride(-1) == 1 &&
                  (dim == 3 || z.stride(2) == z.size(3)),
              "decode_decisions: ", name, " must be float32 CPU logits of ", dim,
              " dimensions with contiguous rows, got ", z.scalar_type(), " ", z.sizes(), " strides ", z.strides());
}

std::vector<Tensor> decode_decisions_cpu(const Tensor& attn_z, const Tensor& expert_z, const Tensor& bits_z,
                                         const c10::optional<Tensor>& attn_shift,
                                         const c10::optional<Tensor>& expert_shift,
                                         const c10::optional<Tensor>& bits_shift, int64_t top_k, bool null_expert) {
  check_logits(attn_z, 4, "attn_z");
  check_logits(expert_z, 3, "expert_z");
  check_logits(bits_z, 3, "bits_z");
  const int64_t B = attn_z.size(0), T = attn_z.size(1), Ha = attn_z.size(2), M = attn_z.size(3),
                E = expert_z.size(2), nb = bits_z.size(2);
  TORCH_CHECK(expert_z.size(0) == B && expert_z.size(1) == T && bits_z.size(0) == B && bits_z.size(1) == T && M > 0 &&
                  nb > 0 && top_k >= 1 && top_k <= E,
              "decode_decisions: attn_z ", attn_z.sizes(), ", expert_z ", expert_z.sizes(), ", bits_z ", bits_z.sizes(),
              " and top_k ", top_k, " do not fit (the same B and T, 1 <= top_k <= options)");
  check_shift(attn_shift, B, T, M, 4, "attn_shift");
  check_shift(expert_shift, B, T, E, 3, "expert_shift");
  check_shift(bits_shift, B, T, nb, 3, "bits_shift");
  const auto f32 = attn_z.options(), i64 = f32.dtype(at::kLong);
  Tensor attn_hard = at::empty({B, T, Ha}, i64), attn_y = at::zeros({B, T, Ha, M}, f32),
         bits_hard = at::empty({B, T}, i64), bits_y = at::zeros({B, T, nb}, f32), probs = at::empty({B, T, E}, f32),
         option = at::empty({B, T, top_k}, i64), index = at::empty({B, T, top_k}, i64),
         weight = at::empty({B, T, top_k}, f32), features = at::empty({B, T, M + 1 + nb}, f32);
  std::vector<float> q(E), shifted(E);
  std::vector<int64_t> counts(M);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = b * T + t;  // the outputs' row
      float* feat = features.data_ptr<float>() + n * (M + 1 + nb);
      std::fill(counts.begin(), counts.end(), 0);
      const float* az = attn_z.data_ptr<float>() + b * attn_z.stride(0) + t * attn_z.stride(1);
      const double* as = shift_row(attn_shift, b, t);
      for (int64_t h = 0; h < Ha; ++h) {
        const int64_t mode = triroute_choice::priced_argmax(az + h * M, as, M);
        attn_hard.data_ptr<int64_t>()[n * Ha + h] = mode;
        attn_y.data_ptr<float>()[(n * Ha + h) * M + mode] = 1.f;
        ++counts[mode];
      }
      for (int64_t i = 0; i < M; ++i) feat[i] = static_cast<float>(counts[i]) / static_cast<float>(Ha);
      const float* ez = expert_z.data_ptr<float>() + b * expert_z.stride(0) + t * expert_z.stride(1);
      float* p = probs.data_ptr<float>() + n * E;
      softmax_row(ez, E, p);
      const float* sel = p;
      if (const double* es = shift_row(expert_shift, b, t)) {
        for (int64_t i = 0; i < E; ++i) shifted[i] = static_cast<float>(static_cast<double>(ez[i]) - es[i]);
        softmax_row(shifted.data(), E, q.data());
        sel = q.data();
      }
      int64_t* opt = option.data_ptr<int64_t>() + n * top_k;
      float chosen = 0.f;
      int64_t real = 0;
      for (int64_t j = 0; j < top_k; ++j) {  // the j-th largest, ties to the lower option
        int64_t best = -1;
        for (int64_t i = 0; i < E; ++i) {
          bool taken = false;
          for (int64_t l = 0; l < j; ++l) taken = taken || opt[l] == i;
          if (!taken && (best < 0 || sel[i] > sel[best])) best = i;
        }
        opt[j] = best;
        chosen += p[best];
        const int64_t e = null_expert ? best - 1 : best;
        index.data_ptr<int64_t>()[n * top_k + j] = e;
        real += e >= 0;
      }
      chosen = std::max(chosen, 1e-20f);
      for (int64_t j = 0; j < top_k; ++j) weight.data_ptr<float>()[n * top_k + j] = p[opt[j]] / chosen;
      feat[M] = static_cast<float>(real) / static_cast<float>(top_k);
      const float* bz = bits_z.data_ptr<float>() + b * bits_z.stride(0) + t * bits_z.stride(1);
      const int64_t width = triroute_choice::priced_argmax(bz, shift_row(bits_shift, b, t), nb);
      bits_hard.data_ptr<int64_t>()[n] = width;
      bits_y.data_ptr<float>()[n * nb + width] = 1.f;
      for (int64_t i = 0; i < nb; ++i) feat[M + 1 + i] = i == width ? 1.f : 0.f;
    }
  return {attn_hard, attn_y, bits_hard, bits_y, probs, option, index, weight, features};
}

// The first key each (row, head) reads: max(0, t[n] - reach[mode[n, h]]), as modes.read_start
// computes it (reach: skip -1, so an empty range from t + 1; local the window; full past 0).
Tensor read_start(const Tensor& t, const Tensor& mode, at::IntArrayRef reach) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && mode.dim() == 2 && mode.size(0) == t.size(0) &&
                  mode.scalar_type() == at::kLong,
              "decode_layer: positions int64 [N] and mode int64 [N, H], got ", t.sizes(), " and ", mode.sizes());
  const int64_t N = mode.size(0), H = mode.size(1), M = static_cast<int64_t>(reach.size());
  const Tensor tc = t.contiguous(), mc = mode.contiguous();
  const int64_t *tp = tc.data_ptr<int64_t>(), *mp = mc.data_ptr<int64_t>();
  Tensor lo = at::empty({N, H}, t.options());
  int64_t* lp = lo.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * H; ++i) {
    TORCH_CHECK(mp[i] >= 0 && mp[i] < M, "decode_layer: mode ", mp[i], " is not one of the ", M, " modes");
    lp[i] = std::max<int64_t>(0, tp[i / H] - reach[mp[i]]);
  }
  return lo;
}

// One decode layer (one token per request, every token valid, routed experts) after its decisions,
// as InferenceLayer.forward runs it (megatron_triroute/inference/model.py: `attend`, `_ffn`; the
// definition) with the same kernels on the same values, so the same bits:
//   lo = read_start(t, mode);  h = rms_norm(x);  q, k, v = decode_qkv(h);  cache_append(k, v);
//   x1 = x + decode_linear(paged_attention(q, lo, t), wo);  out = x1 + routed_experts(rms_norm(x1)).
// In one call, without the Python between the ops (at one token per request a decode layer's host
// work is a sizeable part of its time).
Tensor decode_layer_cpu(const Tensor& x, const Tensor& attn_norm, double attn_eps, const Tensor& wq, const Tensor& wk,
                        const Tensor& wv, const Tensor& wo, const Tensor& cos, const Tensor& sin, const Tensor& mode,
                        at::IntArrayRef reach, const Tensor& option, const Tensor& rows, const Tensor& positions,
                        const Tensor& counts, const Tensor& tables, int64_t page_size, at::TensorList k_data,
                        at::TensorList k_scale, at::TensorList k_zero, at::TensorList v_data, at::TensorList v_scale,
                        at::TensorList v_zero, at::TensorList token_pos, at::IntArrayRef bits, int64_t group_size,
                        double sm_scale, const Tensor& counters, const Tensor& ffn_norm, double ffn_eps,
                        const Tensor& expert_index, const Tensor& expert_weight, at::TensorList w1, at::TensorList w3,
                        at::TensorList w2) {
  check_f32(x, "x", 2, "decode_layer");
  const int64_t N = x.size(0), d = cos.size(-1);
  const Tensor lo = read_start(positions, mode, reach);  // checked before anything is written
  // The query heads some row reads (a key range lo..t not empty): only their Q rows are computed. A
  // head no row reads has an empty range for every row, so its context is zero whatever its query.
  const int64_t H = mode.size(1);
  std::vector<uint8_t> read(H, 0);
  {
    const Tensor tc = positions.contiguous();
    const int64_t *lp = lo.data_ptr<int64_t>(), *tp = tc.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hh = 0; hh < H; ++hh) read[hh] |= lp[n * H + hh] <= tp[n];
  }
  // Each kernel under its op's name for the profiler (a no-op when none is recording).
  const auto norm = [&](const Tensor& y, const Tensor& g, double eps) {
    RECORD_FUNCTION("triroute::rms_norm", std::vector<c10::IValue>());
    return rms_norm_cpu(y, g, eps);
  };
  const Tensor h = norm(x, attn_norm, attn_eps);
  Tensor q, k, v;
  {
    RECORD_FUNCTION("triroute::decode_qkv", std::vector<c10::IValue>());
    std::tie(q, k, v) = decode_qkv_heads(h, wq, wk, wv, cos.reshape({N, d}).contiguous(),
                                         sin.reshape({N, d}).contiguous(),
                                         wq.size(0) == H * d ? &read : nullptr);
  }
  {
    RECORD_FUNCTION("triroute::cache_append", std::vector<c10::IValue>());
    triroute_decode::cache_append(k, v, option, rows, positions, counts, tables, page_size, k_data, k_scale, k_zero,
                                  v_data, v_scale, v_zero, token_pos, bits, group_size);
  }
  Tensor context, attn;
  {
    RECORD_FUNCTION("triroute::paged_attention", std::vector<c10::IValue>());
    context = triroute_decode::paged_attention(q, k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits,
                                               group_size, tables, rows, lo, positions, sm_scale, counters);
  }
  {
    RECORD_FUNCTION("triroute::decode_linear", std::vector<c10::IValue>());
    attn = triroute_decode::decode_linear(context.view({N, -1}), wo);
  }
  const Tensor x1 = x + attn;
  const Tensor h2 = norm(x1, ffn_norm, ffn_eps);
  Tensor y;
  {
    RECORD_FUNCTION("triroute::routed_experts", std::vector<c10::IValue>());
    y = triroute_decode::routed_experts(h2, expert_index, expert_weight, w1, w3, w2);
  }
  return x1 + y;
}

// The controller's heads folded into one affine map, as TriRouteController._folded_heads (with
// RouterHead.folded, the definition) stacks them: per head (n_i rows of width R) its projection and
// bias; whitened, gain, mean and var as well: a = gain / (sqrt(var) + eps), W a (row by row),
// bias - a mean, each a float32 operation as the tensor ops round it (the square root by at::sqrt,
// PyTorch's own kernel: bit for bit). Made into `w` and `b` again only when `key` (each input's
// address and version counter, as routing/versions.py's version_key) no longer matches them.
void folded_heads(const Tensor* head, int64_t n_heads, bool whitened, double eps, Tensor& w, Tensor& b, Tensor& key) {
  const int64_t per = whitened ? 5 : 2;
  bool fresh = key.numel() == 2 * n_heads * per && key.scalar_type() == at::kLong && key.is_contiguous();
  std::vector<int64_t> now(2 * n_heads * per);
  for (int64_t i = 0; i < n_heads * per; ++i) {
    const Tensor& t = head[i];
    if (t.is_inference()) fresh = false;  // no version counter: made again at every call
    now[2 * i] = reinterpret_cast<int64_t>(t.data_ptr());
    now[2 * i + 1] = t.is_inference() ? -1 : static_cast<int64_t>(t._version());
  }
  if (fresh && std::equal(now.begin(), now.end(), key.data_ptr<int64_t>())) return;
  int64_t O = 0, R = -1;
  for (int64_t i = 0; i < n_heads; ++i) {
    const Tensor* t = head + i * per;  // proj, bias[, gain, mean, var]
    check_f32(t[0], "a head's projection", 2, "decode_layers");
    for (int64_t j = 1; j < per; ++j) check_f32(t[j], "a head's bias, gain or statistics", 1, "decode_layers");
    TORCH_CHECK((R < 0 || t[0].size(1) == R) && t[1].size(0) == t[0].size(0) &&
                    (!whitened || (t[2].size(0) == t[0].size(0) && t[3].size(0) == t[0].size(0) &&
                                   t[4].size(0) == t[0].size(0))),
                "decode_layers: a controller head's projection ", t[0].sizes(), " and its vectors do not match");
    R = t[0].size(1);
    O += t[0].size(0);
  }
  w.resize_({O, R});
  b.resize_({O});
  float *wp = w.data_ptr<float>(), *bp = b.data_ptr<float>();
  for (int64_t i = 0; i < n_heads; ++i) {
    const Tensor* t = head + i * per;
    const float *pw = t[0].data_ptr<float>(), *pb = t[1].data_ptr<float>();
    const Tensor root = whitened ? at::sqrt(t[4]) : Tensor();  // sqrt(var), PyTorch's kernel
    for (int64_t o = 0; o < t[0].size(0); ++o, ++bp, wp += R) {
      if (!whitened) {
        std::copy(pw + o * R, pw + (o + 1) * R, wp);
        *bp = pb[o];
        continue;
      }
      const float a = t[2].data_ptr<float>()[o] / (root.data_ptr<float>()[o] + static_cast<float>(eps));
      for (int64_t r = 0; r < R; ++r) wp[r] = pw[o * R + r] * a;
      *bp = pb[o] - a * t[3].data_ptr<float>()[o];
    }
  }
  key.resize_({static_cast<int64_t>(now.size())});
  std::copy(now.begin(), now.end(), key.data_ptr<int64_t>());
}

// Per layer, decode_layers' `weights` (the model's) are: the attention norm, wq [H, d, D], wk and wv
// [H_kv, d, D], wo [D, H, d], the FFN norm; the controller's input norm, fc1's weight and bias, fc2's
// weight and bias, its trunk norm (these kLayerWeights); per head (attention, experts, bits) its
// projection and bias, whitened its gain, mean and var; then every expert's w1, every w3, every w2.
constexpr int64_t kLayerWeights = 12;
// Per layer, `folds` (the model's, written here) holds the folded heads' cache: weight, bias, key
// (folded_heads).
constexpr int64_t kLayerFolds = 3;
// The cache's tensors per layer in decode_layers' `state` before its 7 pool lists: counts, executed,
// the page tables.
constexpr int64_t kLayerState = 3;

// A decode step's layers (one token per request, every token valid, routed experts) in one call, as
// InferenceModel.forward_step runs them (megatron_triroute/inference/model.py, the definition): per
// layer, the controller's logits of [x; side, the previous layer's decision block] with its heads
// folded (controller_logits), the (priced) decisions (decode_decisions with the step's shifts), then
// the layer after them (decode_layer); the same kernels on the same values, so the same bits. With
// `given` (five tensors per layer: modes [N, H] or one per token [N], widths [N], expert index and
// gates [N, k] (each in any integer or float dtype, any shape of those elements), decision block
// [B, 1, F]), the layer runs those decisions instead of its controller's (which still runs):
// decisions drawn elsewhere, replayed. Returns x after the last layer, then per layer its
// controller's logits [N, sum of sizes] and decode_decisions' nine outputs of them.
std::vector<Tensor> decode_layers_cpu(const Tensor& x, const Tensor& side, const Tensor& cos, const Tensor& sin,
                                      const Tensor& rows, const Tensor& positions,
                                      const c10::optional<Tensor>& attn_shift,
                                      const c10::optional<Tensor>& expert_shift,
                                      const c10::optional<Tensor>& bits_shift, at::TensorList weights,
                                      at::TensorList folds, at::TensorList state, at::TensorList given,
                                      int64_t n_layers, int64_t n_experts,
                                      int64_t n_pools, at::IntArrayRef sizes, bool whitened, at::ArrayRef<double> eps,
                                      at::IntArrayRef reach, at::IntArrayRef bits, int64_t group_size,
                                      int64_t page_size, double sm_scale, int64_t top_k, bool null_expert) {
  check_f32(x, "x", 2, "decode_layers");
  TORCH_CHECK(side.dim() == 3 && side.scalar_type() == at::kFloat && side.size(1) == 1,
              "decode_layers: side must be float32 [B, 1, F], got ", side.scalar_type(), " ", side.sizes());
  TORCH_CHECK(sizes.size() == 3, "decode_layers: the controller's three axes' logit sizes, got ", sizes.size());
  const int64_t N = x.size(0), B = side.size(0);
  const int64_t n_head_tensors = 3 * (whitened ? 5 : 2);
  const int64_t per_layer = kLayerWeights + n_head_tensors + 3 * n_experts, per_state = kLayerState + 7 * n_pools;
  TORCH_CHECK(N == B && n_layers > 0 && static_cast<int64_t>(weights.size()) == n_layers * per_layer &&
                  static_cast<int64_t>(state.size()) == n_layers * per_state &&
                  static_cast<int64_t>(folds.size()) == n_layers * kLayerFolds &&
                  static_cast<int64_t>(eps.size()) == 5 * n_layers &&
                  (given.empty() || static_cast<int64_t>(given.size()) == 5 * n_layers),
              "decode_layers: ", n_layers, " layers of ", per_layer, " weights, ", kLayerFolds, " folds, ", per_state,
              " state tensors, 5 eps (and 5 given decisions) each, one row per request; got ", weights.size(),
              " weights, ", folds.size(), " folds, ", state.size(), " state tensors, ", eps.size(), " eps, ",
              given.size(), " given, ", N,
              " rows for ", B, " requests");
  const int64_t Ha = sizes[0] / static_cast<int64_t>(reach.size()), M = static_cast<int64_t>(reach.size());
  TORCH_CHECK(Ha * M == sizes[0], "decode_layers: attention logits ", sizes[0], " are not heads x ", M, " modes");
  Tensor h = x.contiguous(), block = at::zeros({B, 1, M + 1 + static_cast<int64_t>(sizes[2])}, x.options());
  const Tensor side2 = side.reshape({B, side.size(2)});
  std::vector<Tensor> out(1 + 10 * n_layers);
  for (int64_t l = 0; l < n_layers; ++l) {
    const Tensor* w = weights.data() + l * per_layer;
    const Tensor* st = state.data() + l * per_state;
    const double* e = eps.data() + 5 * l;  // attn norm, ffn norm, input norm, trunk norm, whitening
    std::vector<Tensor> decided;
    Tensor z;
    {
      RECORD_FUNCTION("triroute::controller_logits", std::vector<c10::IValue>());
      Tensor wh = folds[kLayerFolds * l], bh = folds[kLayerFolds * l + 1], fold_key = folds[kLayerFolds * l + 2];
      folded_heads(w + kLayerWeights, 3, whitened, e[4], wh, bh, fold_key);
      z = controller_logits_cpu(h, at::cat({side2, block.reshape({B, -1})}, 1), w[6], e[2], w[7], w[8], w[9], w[10],
                                w[11], e[3], wh, bh);
      TORCH_CHECK(z.size(1) == sizes[0] + sizes[1] + sizes[2], "decode_layers: layer ", l, "'s heads give ",
                  z.size(1), " logits, not ", sizes[0], " + ", sizes[1], " + ", sizes[2]);
    }
    {
      RECORD_FUNCTION("triroute::decode_decisions", std::vector<c10::IValue>());
      decided = decode_decisions_cpu(z.narrow(1, 0, sizes[0]).view({B, 1, Ha, M}),
                                     z.narrow(1, sizes[0], sizes[1]).view({B, 1, sizes[1]}),
                                     z.narrow(1, sizes[0] + sizes[1], sizes[2]).view({B, 1, sizes[2]}), attn_shift,
                                     expert_shift, bits_shift, top_k, null_expert);
    }
    const int64_t H = w[1].numel() / w[1].size(-1) / cos.size(-1);  // wq [H, d, D]
    TORCH_CHECK(Ha == 1 || Ha == H, "decode_layers: ", Ha, " attention decisions per token for ", H, " heads");
    Tensor mode, option, index, gate;
    if (given.empty()) {
      mode = decided[0].reshape({N, Ha}).expand({N, H}).contiguous();  // token-granular: every head
      option = decided[2].reshape({N});
      index = decided[6].reshape({N, top_k});
      gate = decided[7].reshape({N, top_k});
      block = decided[8];
    } else {
      const Tensor* g = given.data() + 5 * l;  // in the layouts and dtypes the layer takes (one mode: every head's)
      mode = g[0].reshape({N, -1}).expand({N, H}).to(at::kLong).contiguous();
      option = g[1].reshape({N}).to(at::kLong).contiguous();
      index = g[2].reshape({N, -1}).to(at::kLong).contiguous();
      gate = g[3].reshape({N, -1}).to(x.scalar_type()).contiguous(), block = g[4];
    }
    const Tensor* pools = st + kLayerState;
    const auto list = [&](int64_t j) { return at::TensorList(pools + j * n_pools, n_pools); };
    const int64_t D = w[1].size(-1);  // the projections as the layer loop takes them (attention.projection_views)
    h = decode_layer_cpu(h, w[0], e[0], w[1].reshape({-1, D}), w[2].reshape({-1, D}), w[3].reshape({-1, D}),
                         w[4].reshape({D, -1}), cos, sin, mode, reach, option, rows, positions, st[0],
                         st[2], page_size, list(0), list(1), list(2), list(3), list(4), list(5), list(6), bits,
                         group_size, sm_scale, st[1], w[5], e[1], index, gate,
                         at::TensorList(w + per_layer - 3 * n_experts, n_experts),
                         at::TensorList(w + per_layer - 2 * n_experts, n_experts),
                         at::TensorList(w + per_layer - n_experts, n_experts));
    out[1 + 10 * l] = z;
    for (int64_t j = 0; j < 9; ++j) out[2 + 10 * l + j] = std::move(decided[j]);
  }
  out[0] = h;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def(
      "controller_logits(Tensor x, Tensor side, Tensor g_in, float eps_in, Tensor w1, Tensor b1, Tensor w2, "
      "Tensor b2, Tensor g_trunk, float eps_trunk, Tensor wh, Tensor bh) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_rstd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor rstd, Tensor weight) -> (Tensor, Tensor)");
  m.def(
      "decode_qkv(Tensor x, Tensor wq, Tensor wk, Tensor wv, Tensor cos, Tensor sin, Tensor? read=None) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "decode_decisions(Tensor attn_z, Tensor expert_z, Tensor bits_z, Tensor? attn_shift, Tensor? expert_shift, "
      "Tensor? bits_shift, int top_k, bool null_expert) -> Tensor[]");
  m.def(
      "decode_layer(Tensor x, Tensor attn_norm, float attn_eps, Tensor wq, Tensor wk, Tensor wv, Tensor wo, "
      "Tensor cos, Tensor sin, Tensor mode, int[] reach, Tensor option, Tensor rows, Tensor positions, "
      "Tensor(a!) counts, Tensor tables, int page_size, Tensor(b!)[] k_data, Tensor(c!)[] k_scale, "
      "Tensor(d!)[] k_zero, Tensor(e!)[] v_data, Tensor(f!)[] v_scale, Tensor(g!)[] v_zero, Tensor(h!)[] token_pos, "
      "int[] bits, int group_size, float sm_scale, Tensor(i!) counters, Tensor ffn_norm, float ffn_eps, "
      "Tensor expert_index, Tensor expert_weight, Tensor[] w1, Tensor[] w3, Tensor[] w2) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor side, Tensor cos, Tensor sin, Tensor rows, Tensor positions, "
      "Tensor? attn_shift, Tensor? expert_shift, Tensor? bits_shift, Tensor[] weights, Tensor(a!)[] folds, "
      "Tensor(b!)[] state, Tensor[] given, int n_layers, int n_experts, int n_pools, int[] sizes, bool whitened, "
      "float[] eps, int[] reach, int[] bits, int group_size, int page_size, float sm_scale, int top_k, "
      "bool null_expert) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("controller_logits", &controller_logits_cpu);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_rstd", &rms_norm_rstd_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("decode_qkv", &decode_qkv_cpu);
  m.impl("decode_decisions", &decode_decisions_cpu);
  m.impl("decode_layer", &decode_layer_cpu);
  m.impl("decode_layers", &decode_layers_cpu);
}
