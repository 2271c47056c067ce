// The controller's whitened heads (Eq. whiten), z = gain * (u - mean) / (sqrt(var) + eps) + bias, with
// their gradient, as one kernel call each way (megatron_triroute/routing/whitened_heads.py, whose tensor
// ops are the definition): torch.ops.triroute.whiten_heads and whiten_heads_backward.
//
// u (N, D) holds every head's pre-bias projection laid end to end (head i: d_i columns, D = sum d_i);
// mean and denom (D,) are the heads' running means and sqrt(var) + eps end to end, as
// RunningWhitening.standardisation keeps them (PyTorch's float32 square root on a CPU is not always the
// exact root's rounding, so the divisor is taken, not recomputed); each head brings its gain and bias (float32, d_i) and, in a
// training forward, its accumulator [count, sum(d_i), sum of squares(d_i)] (float64), to which the rows'
// count, column sums and column sums of squares are added (RunningWhitening.whiten_all's).
//
//   forward:   s = (u - mean) / denom,  z = gain * s + bias  -> (z, s)
//   backward:  du = dz * (gain / denom),  d gain = sum_rows dz * s,  d bias = sum_rows dz
//
// The definition's forward is a dozen ops (a float64 copy, two sums, a square, a concatenation, a
// gather, a split and an add into the accumulators; a subtraction, a division, the gains' and biases'
// concatenations, a product and a sum), its backward seven. Every elementwise value is rounded as the definition's op rounds it (no fused
// multiply-add: -ffp-contract=off), so z, s and du are its bits; the column sums run in float64 (the
// statistics, as the definition's) and are rounded once (d gain, d bias: the definition sums in float32,
// in another order, equal to rounding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// The heads' widths d_i and their sum D.
struct Columns {
  std::vector<int64_t> widths;
  int64_t total = 0;
};

Columns head_columns(const std::vector<Tensor>& first, const char* op) {
  TORCH_CHECK(!first.empty(), op, ": needs at least one head");
  Columns c;
  for (const auto& t : first) {
    TORCH_CHECK(t.dim() == 1 && t.numel() > 0, op, ": a head's vectors must be 1-D and non-empty, got ", t.sizes());
    c.widths.push_back(t.numel());
    c.total += t.numel();
  }
  return c;
}

std::vector<float> gather(const std::vector<Tensor>& heads, const Columns& c, const char* name, const char* op) {
  TORCH_CHECK(heads.size() == c.widths.size(), op, ": ", heads.size(), " ", name, " vectors for ", c.widths.size(),
              " heads");
  std::vector<float> out;
  out.reserve(c.total);
  for (size_t i = 0; i < heads.size(); ++i) {
    const Tensor& t = heads[i];
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 1 && t.numel() == c.widths[i] &&
                    t.is_contiguous(),
                op, ": head ", i, "'s ", name, " must be a contiguous float32 CPU vector of ", c.widths[i],
                " values, got ", t.scalar_type(), " ", t.sizes());
    const float* p = t.data_ptr<float>();
    out.insert(out.end(), p, p + c.widths[i]);
  }
  return out;
}

const float* column_vector(const Tensor& t, int64_t D, const char* name, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 1 && t.numel() == D &&
                  t.is_contiguous(),
              op, ": ", name, " must be a contiguous float32 CPU vector of the heads' ", D, " columns, got ",
              t.scalar_type(), " ", t.sizes());
  return t.data_ptr<float>();
}

void check_rows(const Tensor& t, const char* name, int64_t D, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 2 && t.size(1) == D &&
                  (t.size(0) <= 1 || t.stride(0) >= D) && t.stride(1) == 1,
              op, ": ", name, " must be float32 CPU rows (N, ", D, ") with unit stride along a row, got ",
              t.scalar_type(), " ", t.sizes(), " strides ", t.strides());
}

std::tuple<Tensor, Tensor> whiten_heads_cpu(const Tensor& u, const Tensor& mean, const Tensor& denom,
                                            const std::vector<Tensor>& gain, const std::vector<Tensor>& bias,
                                            const std::vector<Tensor>& acc) {
  const char* op = "whiten_heads";
  const Columns c = head_columns(gain, op);
  const int64_t D = c.total, N = u.size(0);
  check_rows(u, "u", D, op);
  const float *m = column_vector(mean, D, "mean", op), *den = column_vector(denom, D, "denom", op);
  const std::vector<float> g = gather(gain, c, "gain", op), b = gather(bias, c, "bias", op);
  TORCH_CHECK(acc.empty() || acc.size() == c.widths.size(), op, ": ", acc.size(), " accumulators for ",
              c.widths.size(), " heads (none: nothing accumulated)");
  for (size_t i = 0; i < acc.size(); ++i)
    TORCH_CHECK(acc[i].scalar_type() == at::kDouble && acc[i].device().is_cpu() && acc[i].is_contiguous() &&
                    acc[i].dim() == 1 && acc[i].numel() == 1 + 2 * c.widths[i],
                op, ": head ", i, "'s accumulator must be a contiguous float64 CPU vector of ", 1 + 2 * c.widths[i],
                " values [count, sums, sums of squares], got ", acc[i].scalar_type(), " ", acc[i].sizes());
  Tensor z = at::empty({N, D}, u.options()), s = at::empty({N, D}, u.options());
  const float* up = u.data_ptr<float>();
  float *zp = z.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int64_t ldu = u.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = up + n * ldu;
      float *zr = zp + n * D, *sr = sp + n * D;
      for (int64_t j = 0; j < D; ++j) {
        const float st = (x[j] - m[j]) / den[j];
        const float scaled = g[j] * st;
        sr[j] = st;
        zr[j] = scaled + b[j];
      }
    }
  });
  if (!acc.empty()) {
    std::vector<double> sum(D, 0.0), sq(D, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      const float* x = up + n * ldu;
      for (int64_t j = 0; j < D; ++j) {
        const double v = static_cast<double>(x[j]);
        sum[j] += v;
        sq[j] += v * v;
      }
    }
    for (size_t i = 0, start = 0; i < acc.size(); start += c.widths[i], ++i) {
      double* a = acc[i].data_ptr<double>();
      const int64_t d = c.widths[i];
      a[0] += static_cast<double>(N);
      for (int64_t l = 0; l < d; ++l) {
        a[1 + l] += sum[start + l];
        a[1 + d + l] += sq[start + l];
      }
    }
  }
  return {z, s};
}

std::tuple<Tensor, std::vector<Tensor>, std::vector<Tensor>> whiten_heads_backward_cpu(
    const Tensor& dz, const Tensor& s, const Tensor& denom, const std::vector<Tensor>& gain) {
  const char* op = "whiten_heads_backward";
  const Columns c = head_columns(gain, op);
  const int64_t D = c.total, N = s.size(0);
  check_rows(dz, "dz", D, op);
  check_rows(s, "s", D, op);
  TORCH_CHECK(dz.size(0) == N, op, ": dz has ", dz.size(0), " rows, s ", N);
  const float* den = column_vector(denom, D, "denom", op);
  const std::vector<float> g = gather(gain, c, "gain", op);
  std::vector<float> ratio(D);
  for (int64_t j = 0; j < D; ++j) ratio[j] = g[j] / den[j];  // the definition's gain / denom
  Tensor du = at::empty({N, D}, dz.options());
  const float *dp = dz.data_ptr<float>(), *spp = s.data_ptr<float>();
  float* dup = du.data_ptr<float>();
  const int64_t ldd = dz.stride(0), lds = s.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* d = dp + n * ldd;
      float* out = dup + n * D;
      for (int64_t j = 0; j < D; ++j) out[j] = d[j] * ratio[j];
    }
  });
  std::vector<double> dg(D, 0.0), db(D, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const float *d = dp + n * ldd, *st = spp + n * lds;
    for (int64_t j = 0; j < D; ++j) {
      dg[j] += static_cast<double>(d[j] * st[j]);  // each product rounded, as the definition's `mul`
      db[j] += static_cast<double>(d[j]);
    }
  }
  std::vector<Tensor> d_gain, d_bias;
  for (size_t i = 0, start = 0; i < c.widths.size(); start += c.widths[i], ++i) {
    Tensor a = at::empty({c.widths[i]}, dz.options()), bb = at::empty({c.widths[i]}, dz.options());
    float *ap = a.data_ptr<float>(), *bp = bb.data_ptr<float>();
    for (int64_t l = 0; l < c.widths[i]; ++l) {
      ap[l] = static_cast<float>(dg[start + l]);
      bp[l] = static_cast<float>(db[start + l]);
    }
    d_gain.push_back(a);
    d_bias.push_back(bb);
  }
  return {du, d_gain, d_bias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def(
      "whiten_heads(Tensor u, Tensor mean, Tensor denom, Tensor[] gain, Tensor[] bias, Tensor(a!)[] acc) -> "
      "(Tensor, Tensor)");
  m.def("whiten_heads_backward(Tensor dz, Tensor s, Tensor denom, Tensor[] gain) -> (Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("whiten_heads", &whiten_heads_cpu);
  m.impl("whiten_heads_backward", &whiten_heads_backward_cpu);
}
