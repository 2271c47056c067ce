// The routing noise's counter hash (megatron_triroute/routing/noise.py, the definition), registered
// as torch.ops.triroute.counter_uniform:
//
//   u[a, b, t, c] = ((h >> 8) + 0.5) / 2^24,   h = mix(mix(mix(prefix[a] ^ sample[b]) ^ position[b, t]) ^ counter[c])
//
// with mix the lowbias32 finaliser on 32-bit words; and torch.ops.triroute.chain_words, the chain word
// of one key field for every key (the per-token words the hash above reads, once per micro-batch):
//
//   word[i] = (mix((key[i] mod 2^32) ^ (0x9E3779B9 (field + 1) mod 2^32)) * 0x85EBCA6B) mod 2^32
//
// Unsigned 32-bit arithmetic wraps by definition, which is what the PyTorch chain computes with its
// multiplications split into 16-bit halves: the same bits, one pass instead of about sixty tensor ops
// per layer (the hash) and twenty-four per field (the words).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

using at::Tensor;

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

Tensor counter_uniform_cpu(const Tensor& prefix, const Tensor& sample_words, const Tensor& position_words,
                           const Tensor& counters) {
  for (const Tensor* t : {&prefix, &sample_words, &position_words, &counters})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(), "counter_uniform takes int64 CPU tensors");
  TORCH_CHECK(prefix.dim() == 1 && sample_words.dim() == 1 && counters.dim() == 1 && position_words.dim() == 2,
              "counter_uniform: prefix (A,), sample_words (B,), position_words (B or 1, T), counters (n,)");
  const int64_t A = prefix.size(0), B = sample_words.size(0), PB = position_words.size(0);
  const int64_t T = position_words.size(1), n = counters.size(0);
  TORCH_CHECK(PB == B || PB == 1, "position_words has ", PB, " rows; give 1 or B=", B);
  const Tensor pc = prefix.contiguous(), sc = sample_words.contiguous(), wc = position_words.contiguous(),
               cc = counters.contiguous();
  const int64_t *pp = pc.data_ptr<int64_t>(), *sp = sc.data_ptr<int64_t>(), *wp = wc.data_ptr<int64_t>(),
                *cp = cc.data_ptr<int64_t>();
  Tensor out = at::empty({A, B, T, n}, prefix.options().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  at::parallel_for(0, A * B * T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t a = i / (B * T), b = (i / T) % B, t = i % T;
      const uint32_t h1 = mix32(static_cast<uint32_t>(pp[a]) ^ static_cast<uint32_t>(sp[b]));
      const uint32_t h2 = mix32(h1 ^ static_cast<uint32_t>(wp[(PB == 1 ? 0 : b) * T + t]));
      double* row = op + i * n;
      for (int64_t c = 0; c < n; ++c)
        row[c] = (static_cast<double>(mix32(h2 ^ static_cast<uint32_t>(cp[c])) >> 8) + 0.5) / 16777216.0;
    }
  });
  return out;
}

Tensor chain_words_cpu(const Tensor& keys, int64_t field) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.device().is_cpu(), "chain_words takes an int64 CPU tensor, got ",
              keys.scalar_type(), " on ", keys.device());
  const Tensor kc = keys.contiguous();
  const int64_t* kp = kc.data_ptr<int64_t>();
  Tensor out = at::empty_like(kc);
  int64_t* op = out.data_ptr<int64_t>();
  const uint32_t salt = static_cast<uint32_t>(0x9E3779B9ull * static_cast<uint64_t>(field + 1));
  at::parallel_for(0, kc.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      op[i] = static_cast<int64_t>(mix32(static_cast<uint32_t>(kp[i]) ^ salt) * 0x85EBCA6Bu);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triroute, m) {
  m.def("counter_uniform(Tensor prefix, Tensor sample_words, Tensor position_words, Tensor counters) -> Tensor");
  m.def("chain_words(Tensor keys, int field) -> Tensor");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("counter_uniform", &counter_uniform_cpu);
  m.impl("chain_words", &chain_words_cpu);
}
