// A layer's routes sorted by expert, as one kernel call (megatron_triroute/experts/routes.py, whose tensor
// ops are the definition): torch.ops.triroute.sort_routes.
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("sort_routes(Tensor index, int num_experts) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("sort_routes", &sort_routes_cpu);
}
