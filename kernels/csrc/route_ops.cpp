// The experts' routes in one kernel call where a chain of tensor ops defines them:
//
// - a layer's routes sorted by expert (megatron_triroute/experts/routes.py, whose tensor ops are the
//   definition): torch.ops.triroute.sort_routes, below;
// - the straight-through count of the real experts a token runs (megatron_triroute/routing/cost.py's
//   `_NullSwapMargin`, the definition): torch.ops.triroute.null_swap_margin and
//   null_swap_margin_backward, further below.
//
// index (N, k) int64, each token's experts, a negative id the null expert; E experts. The routes are
// taken token-major (route r = n k + j), keyed by their expert (the null one keyed E), and sorted stably
// by key:
//   order (N k,): the routes by key, each key's in route order;  inverse (N k,): each route's place in order;
//   offsets (E,) int32: the end of each expert's rows (the null routes' rows after the last);
//   token (N k,): each sorted route's token, order // k.
// The definition is a select, a stable argsort, a scatter-add of ones, a scatter of a range, a cumulative
// sum and a floor division (about a dozen ops); a counting sort gives the same four tensors exactly.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

std::tuple<Tensor, Tensor, Tensor, Tensor> sort_routes_cpu(const Tensor& index, int64_t num_experts) {
  TORCH_CHECK(index.scalar_type() == at::kLong && index.device().is_cpu() && index.dim() == 2 && index.is_contiguous(),
              "sort_routes: index must be a contiguous int64 CPU tensor (N, k), got ", index.scalar_type(), " ",
              index.sizes());
  TORCH_CHECK(num_experts > 0, "sort_routes: needs at least one expert, got ", num_experts);
  const int64_t n = index.numel(), k = index.size(1), E = num_experts;
  const int64_t* idx = index.data_ptr<int64_t>();
  std::vector<int64_t> next(E + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t key = idx[r] >= 0 ? idx[r] : E;
    TORCH_CHECK(key <= E, "sort_routes: route ", r, " names expert ", idx[r], " of ", E,
                ". Fix: expert ids lie in [0, ", E, "), a negative id the null expert");
    ++next[key];
  }
  auto ints = index.options();
  Tensor offsets = at::empty({E}, ints.dtype(at::kInt));
  int32_t* off = offsets.data_ptr<int32_t>();
  int64_t start = 0;
  for (int64_t e = 0; e <= E; ++e) {  // counts -> each key's first place
    const int64_t count = next[e];
    next[e] = start;
    start += count;
    if (e < E) off[e] = static_cast<int32_t>(start);
  }
  Tensor order = at::empty({n}, ints), inverse = at::empty({n}, ints), token = at::empty({n}, ints);
  int64_t *op = order.data_ptr<int64_t>(), *ip = inverse.data_ptr<int64_t>(), *tp = token.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t p = next[idx[r] >= 0 ? idx[r] : E]++;
    op[p] = r;
    ip[r] = p;
    tp[p] = r / k;
  }
  return {order, inverse, offsets, token};
}

// null_swap_margin: per token (a row of logits z (…, E'), option 0 the null expert, and of index (…, k),
// its selected experts, a negative id the null): runs = the real experts selected; the weakest
// selected real expert w (its option id, the first of equal logits); slope = q (1 - q) with
// q = sigmoid(z_w - z_0) in float64, 0 where the selection holds the null (then w is the null's 0).
// backward: dz = 0 but g at w and -g at 0, g = grad * slope, in the logits' dtype. The definition's
// two dozen ops (a cast, gathers, a masked fill, a minimum, selects, the sigmoid, a sum) as one call;
// the sigmoid is 1 / (1 + exp(-x)) in float64 (PyTorch's own may differ in the last bit of a double:
// equal to rounding), the rest the definition's values exactly.
template <typename T>
void null_swap_margin_rows(const T* zp, const int64_t* ip, int64_t n, int64_t E, int64_t k, double* rp, double* sp,
                           int64_t* wp) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = zp + t * E;
    const int64_t* sel = ip + t * k;
    int64_t real = 0, first = 0;  // first: the slot of the least logit among the real experts (slot 0 if none)
    double least = INFINITY;
    for (int64_t j = 0; j < k; ++j) {
      if (sel[j] < 0) continue;
      TORCH_CHECK(sel[j] + 1 < E, "null_swap_margin: token ", t, " selects expert ", sel[j], " of ", E - 1);
      ++real;
      const double v = static_cast<double>(row[sel[j] + 1]);
      if (v < least) least = v, first = j;
    }
    const bool has_null = real < k;
    const double x = (has_null ? 0.0 : least) - static_cast<double>(row[0]);
    const double q = 1.0 / (1.0 + std::exp(-x));
    rp[t] = static_cast<double>(real);
    sp[t] = has_null ? 0.0 : q * (1.0 - q);
    wp[t] = sel[first] + 1;
  }
}

std::tuple<Tensor, Tensor, Tensor> null_swap_margin_cpu(const Tensor& logits, const Tensor& index) {
  TORCH_CHECK(logits.device().is_cpu() && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble) &&
                  logits.is_contiguous() && index.scalar_type() == at::kLong && index.device().is_cpu() &&
                  index.is_contiguous() && logits.dim() == index.dim() && logits.dim() >= 1 &&
                  logits.sizes().slice(0, logits.dim() - 1).equals(index.sizes().slice(0, index.dim() - 1)),
              "null_swap_margin: contiguous logits (..., E') float32 or float64 and index (..., k) int64 on the "
              "CPU, the same leading dims, got ", logits.scalar_type(), " ", logits.sizes(), " and ",
              index.scalar_type(), " ", index.sizes());
  const int64_t E = logits.size(-1), k = index.size(-1), n = index.numel() / std::max<int64_t>(k, 1);
  auto lead = index.sizes().slice(0, index.dim() - 1);
  auto f64 = logits.options().dtype(at::kDouble);
  Tensor runs = at::empty(lead, f64), slope = at::empty(lead, f64);
  std::vector<int64_t> weakest_shape(lead.begin(), lead.end());
  weakest_shape.push_back(1);
  Tensor weakest = at::empty(weakest_shape, index.options());
  double *rp = runs.data_ptr<double>(), *sp = slope.data_ptr<double>();
  int64_t* wp = weakest.data_ptr<int64_t>();
  if (logits.scalar_type() == at::kFloat)
    null_swap_margin_rows(logits.data_ptr<float>(), index.data_ptr<int64_t>(), n, E, k, rp, sp, wp);
  else
    null_swap_margin_rows(logits.data_ptr<double>(), index.data_ptr<int64_t>(), n, E, k, rp, sp, wp);
  return {runs, slope, weakest};
}

template <typename T>
void null_swap_margin_grad_rows(const double* gp, const double* sp, const int64_t* wp, int64_t n, int64_t E, T* dp) {
  for (int64_t t = 0; t < n; ++t) {
    const double v = gp[t] * sp[t];
    T* row = dp + t * E;
    std::fill(row, row + E, T(0));
    // the definition's float64 row: v at the weakest (a scatter), then minus v at the null; then its cast
    const double at0 = (wp[t] == 0 ? v : 0.0) - v;
    row[wp[t]] = static_cast<T>(v);
    row[0] = static_cast<T>(at0);
  }
}

Tensor null_swap_margin_backward_cpu(const Tensor& grad, const Tensor& slope, const Tensor& weakest, int64_t options,
                                     at::ScalarType dtype) {
  TORCH_CHECK(grad.scalar_type() == at::kDouble && slope.scalar_type() == at::kDouble && grad.sizes() == slope.sizes() &&
                  grad.is_contiguous() && slope.is_contiguous() && weakest.is_contiguous() &&
                  weakest.scalar_type() == at::kLong && weakest.numel() == slope.numel() && grad.device().is_cpu() &&
                  options > 0 && (dtype == at::kFloat || dtype == at::kDouble),
              "null_swap_margin_backward: contiguous grad and slope float64 of one shape, weakest int64 (…, 1), "
              "a float32 or float64 result, got ", grad.sizes(), " ", slope.sizes(), " ", weakest.sizes(), " ", dtype);
  std::vector<int64_t> shape(slope.sizes().begin(), slope.sizes().end());
  shape.push_back(options);
  Tensor dz = at::empty(shape, slope.options().dtype(dtype));
  const int64_t n = slope.numel();
  const int64_t* wp = weakest.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(wp[t] >= 0 && wp[t] < options, "null_swap_margin_backward: option ", wp[t], " of ", options);
  if (dtype == at::kFloat)
    null_swap_margin_grad_rows(grad.data_ptr<double>(), slope.data_ptr<double>(), wp, n, options, dz.data_ptr<float>());
  else
    null_swap_margin_grad_rows(grad.data_ptr<double>(), slope.data_ptr<double>(), wp, n, options, dz.data_ptr<double>());
  return dz;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("sort_routes(Tensor index, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("null_swap_margin(Tensor logits, Tensor index) -> (Tensor, Tensor, Tensor)");
  m.def("null_swap_margin_backward(Tensor grad, Tensor slope, Tensor weakest, int options, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("sort_routes", &sort_routes_cpu);
  m.impl("null_swap_margin", &null_swap_margin_cpu);
  m.impl("null_swap_margin_backward", &null_swap_margin_backward_cpu);
}
