// The controller's whitening (Eq. whiten) in one kernel call where a chain of tensor ops defines it:
//
// - its heads, z = gain * (u - mean) / (sqrt(var) + eps) + bias, with their gradient
//   (megatron_triroute/routing/whitened_heads.py, whose tensor ops are the definition):
//   torch.ops.triroute.whiten_heads and whiten_heads_backward;
// - the step's commit of every whitening module's statistics (RunningWhitening.commit_all's tensor
//   ops, the definition): torch.ops.triroute.whitening_commit, below.
//
// u (N, D) holds every head's pre-bias projection laid end to end (head i: d_i columns, D = sum d_i);
// mean and denom (D,) are the heads' running means and sqrt(var) + eps end to end, as
// RunningWhitening.standardisation keeps them (PyTorch's float32 square root on a CPU is not always
// the exact root's rounding, so the divisor is taken, not recomputed); each head brings its gain and
// bias (float32, d_i) and, in a training forward, its accumulator [count, sum(d_i), sum of squares(d_i)]
// (float64), to which the rows' count, column sums and column sums of squares are added
// (RunningWhitening.whiten_all's).
//
//   forward:   s = (u - mean) / denom,  z = gain * s + bias  -> (z, s)
//   backward:  du = dz * (gain / denom),  d gain = sum_rows dz * s,  d bias = sum_rows dz
//
// The definition's forward is a dozen ops (a float64 copy, two sums, a square, a concatenation, a
// gather, a split and an add into the accumulators; a subtraction, a division, the gains' and biases'
// concatenations, a product and a sum), its backward seven. Every elementwise value is rounded as the
// definition's op rounds it (no fused multiply-add: -ffp-contract=off), so z, s and du are its bits;
// the column sums run in float64 (the statistics, as the definition's) and are rounded once (d gain,
// d bias: the definition sums in float32, in another order, equal to rounding).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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
      acc[i].unsafeGetTensorImpl()->bump_version();  // written in place, as an in-place op's
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

// whitening_commit: for each module i, from its reduced accumulator r = [count, sums(d), sums of squares(d)]
// (float64, the global batch's), with momentum m, in float64 rounded to float32 once:
//   batch mean = sums / max(count, 1),  batch var = max(squares / max(count, 1) - batch mean^2, 0),
//   mean <- m mean + (1 - m) batch mean,  var <- m var + (1 - m) batch var   (kept where count <= 0),
//   steps += (count > 0),  accumulator <- 0.
// The definition's thirty-odd ops (gathers of the counts, sums and squares, the arithmetic, the
// statistics' concatenations, selects, splits and multi-tensor copies) as one call; every value is
// rounded as its op rounds it (no fused multiply-add), so the statistics are its bits.
void whitening_commit_cpu(const std::vector<Tensor>& reduced, const std::vector<Tensor>& mean,
                          const std::vector<Tensor>& var, const std::vector<Tensor>& steps,
                          const std::vector<Tensor>& acc, double momentum) {
  const char* op = "whitening_commit";
  const size_t M = reduced.size();
  TORCH_CHECK(mean.size() == M && var.size() == M && steps.size() == M && acc.size() == M, op,
              ": one reduced accumulator, mean, var, step count and accumulator per module, got ", M, ", ",
              mean.size(), ", ", var.size(), ", ", steps.size(), ", ", acc.size());
  for (size_t i = 0; i < M; ++i) {
    const int64_t d = mean[i].numel();
    for (const auto& [t, name, type, n] :
         {std::tuple{&reduced[i], "reduced", at::kDouble, 1 + 2 * d}, {&acc[i], "acc", at::kDouble, 1 + 2 * d},
          {&mean[i], "mean", at::kFloat, d}, {&var[i], "var", at::kFloat, d}, {&steps[i], "steps", at::kLong, 1}})
      TORCH_CHECK(t->scalar_type() == type && t->device().is_cpu() && t->is_contiguous() && t->numel() == n, op,
                  ": module ", i, "'s ", name, " must be a contiguous ", c10::toString(type), " CPU tensor of ", n,
                  " values, got ", t->scalar_type(), " ", t->sizes());
  }
  const double keep = momentum, take = 1.0 - momentum;
  for (size_t i = 0; i < M; ++i) {
    const int64_t d = mean[i].numel();
    const double* r = reduced[i].data_ptr<double>();
    const double count = r[0];
    if (count > 0.0) {
      const double c = count < 1.0 ? 1.0 : count;  // clamp_min(1): the count of a module that saw tokens
      float *mp = mean[i].data_ptr<float>(), *vp = var[i].data_ptr<float>();
      for (int64_t l = 0; l < d; ++l) {
        const double bm = r[1 + l] / c;
        const double sq = bm * bm;
        double bv = r[1 + d + l] / c - sq;
        bv = bv < 0.0 ? 0.0 : bv;
        const double old_m = keep * static_cast<double>(mp[l]), new_m = take * bm;
        const double old_v = keep * static_cast<double>(vp[l]), new_v = take * bv;
        mp[l] = static_cast<float>(old_m + new_m);
        vp[l] = static_cast<float>(old_v + new_v);
      }
      steps[i].data_ptr<int64_t>()[0] += 1;
    }
    double* a = acc[i].data_ptr<double>();
    std::fill(a, a + acc[i].numel(), 0.0);
  }
  // written in place: each tensor's version moves, as an in-place op's does (what is kept under
  // `version_key` of the statistics, the standardisation, is made again)
  for (const auto* list : {&mean, &var, &steps, &acc})
    for (const auto& t : *list) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def(
      "whitening_commit(Tensor[] reduced, Tensor(a!)[] mean, Tensor(b!)[] var, Tensor(c!)[] steps, "
      "Tensor(d!)[] acc, float momentum) -> ()");
  m.def(
      "whiten_heads(Tensor u, Tensor mean, Tensor denom, Tensor[] gain, Tensor[] bias, Tensor(a!)[] acc) -> "
      "(Tensor, Tensor)");
  m.def("whiten_heads_backward(Tensor dz, Tensor s, Tensor denom, Tensor[] gain) -> (Tensor, Tensor[], Tensor[])");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("whiten_heads", &whiten_heads_cpu);
  m.impl("whiten_heads_backward", &whiten_heads_backward_cpu);
  m.impl("whitening_commit", &whitening_commit_cpu);
}
