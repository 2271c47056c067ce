// CPU kernels of one decode step, registered as torch.ops.triroute.*:
//
// - paged_attention: one query row per token over ALL precision pools with one online softmax
//   (no per-pool partials; with few items for the threads, split-K parts of each item's page list
//   merged once). Work item = (up to 32 consecutive rows of one request, kv head) with the group's
//   query heads: each slot row of K is unpacked and dequantised once into
//   a buffer and scored for every (row, query head) of the item whose range holds it; each V row is
//   unpacked once for all of them (a decode step has one row per request; a prefill shares each page
//   among the rows of a chunk), and loaded once for the heads of a row that read the same keys. A
//   chunk of one row (a decode step's) with AVX-512 at d 64 or 128 dequantises each K and V row into
//   registers instead, once for the heads that read the same keys: the same values, sums and bits.
// - cache_write: every token quantised into its own width's pool in one call (bit-identical to
//   triroute_kernels.quant.quantize_groups + pack_codes); cache_append: a decode step's write with
//   each token's slot taken from the decode state's counts and page tables in the same call.
// - routed_experts: the top-k SwiGLU experts of each token, routes grouped by expert (counting
//   sort), three GEMMs per expert that some token chose (decode_linear's kernel at up to 16 routes).
// - decode_linear: x w^T for a decode step's few rows of x, each weight read from memory once.
//
// The number format is the one of triroute_kernels/quant.py: per group of g channels of one
// (token, kv head), scale = half((max - min) / levels), zero = half(min), a value dequantised as
// float(code) * float(scale) + float(zero) in float32; code i of a byte at bit i * bits.
// Build with -ffp-contract=off: a fused multiply-add rounds differently from two operations in
// general; the vector dequantisations take one by name where it rounds the same (GroupValues16).
// With AVX2 and FMA (-march=native on x86-64) the attention's inner loops are vectorised by hand:
// eight codes unpacked by one variable shift, dequantised by a fused multiply-add (the same value as
// the multiply, then add: the product is exact); the scores and the P.V accumulation by fused
// multiply-adds (attention is compared within a tolerance, the dequantised values and the cache write
// bit for bit). With AVX-512 as well, sixteen: the unpacking and dequantisation (the same values),
// the scores' multiply-adds, P.V over 64 channels and decode_linear's row streams; a 2- or 4-bit
// group's values (code * scale + zero for each of its 2^bits codes) computed once into a register and
// each channel's looked up by its code. Other builds run the scalar loops below.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_ops.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TRIROUTE_AVX2 1
#endif
#if defined(TRIROUTE_AVX2) && defined(__AVX512F__)
#define TRIROUTE_AVX512 1  // 16-lane paths for the attention's dequantisation, scores and sums
#endif

namespace triroute_format {

// The number format's group statistics, one definition for the cache write here and the relaxed K/V
// write's values (quant_ops.cpp). The minimum and maximum of a group of gs float32 values as the
// tensor chain's amin and amax give them: NaN where the group holds a NaN (the vector and scalar
// min/max drop a NaN operand, so NaNs are looked for apart); in any order otherwise, exactly.
void group_range(const float* x, int64_t gs, float* min_out, float* max_out) {
  float mn = x[0], mx = x[0];
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__)
  if (gs >= 8) {
    __m256 vmn = _mm256_loadu_ps(x), vmx = vmn, vnan = _mm256_cmp_ps(vmn, vmn, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= gs; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vmn = _mm256_min_ps(vmn, v);
      vmx = _mm256_max_ps(vmx, v);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 lo = _mm_min_ps(_mm256_castps256_ps128(vmn), _mm256_extractf128_ps(vmn, 1));
    lo = _mm_min_ps(lo, _mm_movehl_ps(lo, lo));
    mn = _mm_cvtss_f32(_mm_min_ss(lo, _mm_shuffle_ps(lo, lo, 1)));
    __m128 hi = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
    hi = _mm_max_ps(hi, _mm_movehl_ps(hi, hi));
    mx = _mm_cvtss_f32(_mm_max_ss(hi, _mm_shuffle_ps(hi, hi, 1)));
    nan = _mm256_movemask_ps(vnan) != 0;
  }
#endif
  for (; i < gs; ++i) {
    nan |= std::isnan(x[i]);
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  if (nan) mn = mx = std::numeric_limits<float>::quiet_NaN();
  *min_out = mn;
  *max_out = mx;
}

// scale = half((max - min) / levels), a true division (not a reciprocal multiply), zero = half(min).
void group_scale_zero(float mn, float mx, int levels, at::Half* scale, at::Half* zero) {
  volatile float levels_f = static_cast<float>(levels);
  *scale = at::Half((mx - mn) / levels_f);
  *zero = at::Half(mn);
}

}  // namespace triroute_format

namespace {

using at::Half;
using at::Tensor;

constexpr int64_t kMaxHeadDim = 1024;

#if defined(TRIROUTE_AVX2)
// Channels i..i+7 of a packed row as float32: 8 codes of BITS bits fill BITS bytes, code k at bit
// k * BITS of their little-endian word; one variable shift puts each in its own lane.
template <int BITS>
inline __m256 codes8(const uint8_t* codes, int64_t i) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
  } else {
    uint32_t word = 0;
    std::memcpy(&word, codes + i * BITS / 8, BITS);
    const __m256i shifts = BITS == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i lanes = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32((1 << BITS) - 1)));
  }
}
#endif

#if defined(TRIROUTE_AVX512)
// The codes of channels i..i+15 of a packed row, one per 32-bit lane (codes8's layout, 16 lanes):
// the codes' 16 * BITS bits as one or two 32-bit words, each lane shifted to its code. At 2 and 4
// bits a lane's code is its lowest BITS bits and the bits above it are the next codes' (not masked
// off: GroupValues16's lookup reads a lane's lowest four bits only, and its 2-bit table repeats).
template <int BITS>
inline __m512i code_lanes16(const uint8_t* codes, int64_t i) {
  if constexpr (BITS == 8) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
  } else if constexpr (BITS == 4) {
    uint64_t word = 0;
    std::memcpy(&word, codes + i / 2, 8);
    const __m512i words = _mm512_permutexvar_epi32(  // lanes 0-7: the low 32 bits, 8-15: the high
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_set1_epi64(static_cast<int64_t>(word)));
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    return _mm512_srlv_epi32(words, shifts);
  } else {
    uint32_t word = 0;
    std::memcpy(&word, codes + i / 4, 4);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int32_t>(word)), shifts);
  }
}
#endif

#if defined(TRIROUTE_AVX512)
// One quantisation group's values 16 channels at a time: code * scale + zero in float32 by one fused
// multiply-add, which rounds as the format's two operations do: a code (at most 8 bits) times a
// float16 scale (11 significant bits) is exact in float32, so the product's rounding is no rounding
// and the add's is the only one. At 2 and 4 bits the group's 2^BITS values are computed once into
// one register (at 2 bits four times over: entry e holds code e % 4's value), then each channel's
// looked up by the lowest four bits of its lane (code_lanes16). The one 16-lane dequantisation of
// dequant_row and row_vectors.
template <int BITS>
struct GroupValues16 {
  __m512 sc, z, table;
  GroupValues16(Half scale, Half zero)
      : GroupValues16(_mm512_set1_ps(static_cast<float>(scale)), _mm512_set1_ps(static_cast<float>(zero))) {}
  // From the scale and zero already in every lane.
  GroupValues16(__m512 scale, __m512 zero) : sc(scale), z(zero) {
    if constexpr (BITS == 4)
      table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), sc, z);
    if constexpr (BITS == 2)
      table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), sc, z);
  }
  // Channels i..i+15 of the packed row `codes` (all in this group).
  __m512 operator()(const uint8_t* codes, int64_t i) const {
    if constexpr (BITS <= 4) return _mm512_permutexvar_ps(code_lanes16<BITS>(codes, i), table);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(code_lanes16<BITS>(codes, i)), sc, z);
  }
};
#endif

// Dequantise one packed (slot, kv head) row of d channels: code * scale + zero, float32. With the
// head dim and group size known at compile time (D, GS > 0: the shapes dequant_rows_any names), the
// loops over groups and channels unroll into straight code: a quarter of the time per row at d = 64.
template <int BITS, int64_t D = 0, int64_t GS = 0>
inline void dequant_row(const uint8_t* codes, const Half* scale, const Half* zero, int64_t d_arg, int64_t gs_arg,
                        float* out) {
  const int64_t d = D > 0 ? D : d_arg, gs = GS > 0 ? GS : gs_arg;
  constexpr int per_byte = 8 / BITS;
  constexpr int mask = (1 << BITS) - 1;
#if defined(TRIROUTE_AVX512)
  if (gs % 16 == 0) {  // the values below, 16 channels at a time
    for (int64_t g0 = 0, k = 0; g0 < d; g0 += gs, ++k) {  // k = g0 / gs, without a division
      const GroupValues16<BITS> values(scale[k], zero[k]);
      for (int64_t i = g0; i < g0 + gs; i += 16) _mm512_storeu_ps(out + i, values(codes, i));
    }
    return;
  }
#endif
#if defined(TRIROUTE_AVX2)
  if (gs % 8 == 0) {  // the values below, by one fused multiply-add (exact product: GroupValues16)
    for (int64_t g0 = 0, k = 0; g0 < d; g0 += gs, ++k) {
      const __m256 sc = _mm256_set1_ps(static_cast<float>(scale[k]));
      const __m256 z = _mm256_set1_ps(static_cast<float>(zero[k]));
      for (int64_t i = g0; i < g0 + gs; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(codes8<BITS>(codes, i), sc, z));
    }
    return;
  }
#endif
  for (int64_t b = 0; b < d / per_byte; ++b) {  // unpack: code k of byte b at bit k * BITS
    const int byte = codes[b];
    for (int k = 0; k < per_byte; ++k) out[b * per_byte + k] = static_cast<float>((byte >> (k * BITS)) & mask);
  }
  for (int64_t g0 = 0, k = 0; g0 < d; g0 += gs, ++k) {  // code * scale, then + zero, each rounded in float32
    const float sc = static_cast<float>(scale[k]);
    const float z = static_cast<float>(zero[k]);
    for (int64_t i = g0; i < g0 + gs; ++i) out[i] = out[i] * sc;
    for (int64_t i = g0; i < g0 + gs; ++i) out[i] = out[i] + z;
  }
}

// Dequantise the c (slot, kv head) rows `rows` of one pool into out (row t at out + t * d).
template <int BITS, int64_t D = 0, int64_t GS = 0>
void dequant_rows(const uint8_t* codes, const Half* scale, const Half* zero, const int64_t* rows, int64_t c,
                  int64_t row_bytes, int64_t n_groups, int64_t d, int64_t gs, float* out) {
  for (int64_t t = 0; t < c; ++t)
    dequant_row<BITS, D, GS>(codes + rows[t] * row_bytes, scale + rows[t] * n_groups, zero + rows[t] * n_groups, d,
                             gs, out + t * d);
}

// f(std::integral_constant<int64_t, D>{}) with D = d where d is a head dim of the model configs (32,
// 64, 128), so the kernels' loops over channels compile for it; D = 0 (d read at run time) otherwise.
template <class F>
inline decltype(auto) with_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 32: return f(std::integral_constant<int64_t, 32>{});
    case 64: return f(std::integral_constant<int64_t, 64>{});
    case 128: return f(std::integral_constant<int64_t, 128>{});
    default: return f(std::integral_constant<int64_t, 0>{});
  }
}

// dequant_rows with (d, gs) fixed at compile time where they are the shapes of the model configs
// (with_head_dim's head dims, group size 32), at run time otherwise: the same arithmetic either way.
template <int BITS>
void dequant_rows_any(const uint8_t* codes, const Half* scale, const Half* zero, const int64_t* rows, int64_t c,
                      int64_t row_bytes, int64_t n_groups, int64_t d, int64_t gs, float* out) {
  if (gs != 32) return dequant_rows<BITS>(codes, scale, zero, rows, c, row_bytes, n_groups, d, gs, out);
  with_head_dim(d, [&](auto D) {
    dequant_rows<BITS, D(), (D() > 0 ? 32 : 0)>(codes, scale, zero, rows, c, row_bytes, n_groups, d, gs, out);
  });
}

inline void f16_rows(const Half* values, const int64_t* rows, int64_t c, int64_t d, float* out) {
  for (int64_t t = 0; t < c; ++t) {
    const Half* src = values + rows[t] * d;
    float* dst = out + t * d;
    int64_t i = 0;
#if defined(TRIROUTE_AVX512)
    for (; i + 16 <= d; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#if defined(__F16C__)
    for (; i + 8 <= d; i += 8)  // float16 -> float32 is exact: the same values, 8 at a time
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// exp(x) for x <= 0 (the online softmax's arguments), vectorisable and branch-free: Cody-Waite
// range reduction to r in [-ln2/2, ln2/2], Cephes' degree-6 polynomial (relative error ~1e-7),
// then the power of two put in the exponent bits; x below -87 (and -inf) gives exactly 0. One
// definition for one float (E = ExpScalar) and for 8 or 16 lanes (Lanes8, Lanes16): the same
// operations in the same order, so every lane's value is the scalar's bit for bit.
template <class E>
inline typename E::V exp_nonpositive_v(typename E::V x) {
  using V = typename E::V;
  const V lowest = E::set1(-87.f);
  const V xc = E::max(x, lowest);
  const V n = E::floor(E::add(E::mul(xc, E::set1(1.44269504088896341f)), E::set1(0.5f)));
  V r = E::sub(xc, E::mul(n, E::set1(0.693359375f)));
  r = E::add(r, E::mul(n, E::set1(2.12194440e-4f)));
  V p = E::set1(1.9875691500e-4f);
  p = E::add(E::mul(p, r), E::set1(1.3981999507e-3f));
  p = E::add(E::mul(p, r), E::set1(8.3334519073e-3f));
  p = E::add(E::mul(p, r), E::set1(4.1665795894e-2f));
  p = E::add(E::mul(p, r), E::set1(1.6666665459e-1f));
  p = E::add(E::mul(p, r), E::set1(5.0000001201e-1f));
  p = E::add(E::add(E::mul(p, E::mul(r, r)), r), E::set1(1.f));
  return E::zero_below(x, lowest, E::mul(p, E::pow2(n)));
}

struct ExpScalar {
  using V = float;
  static V set1(float a) { return a; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V max(V x, V lowest) { return x < lowest ? lowest : x; }
  static V floor(V a) { return std::floor(a); }
  static V pow2(V n) {  // 2^n for an integral n, put in the exponent bits
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  static V zero_below(V x, V lowest, V value) { return x < lowest ? 0.f : value; }
};

inline float exp_nonpositive(float x) { return exp_nonpositive_v<ExpScalar>(x); }

#if defined(TRIROUTE_AVX2)
// One vector width's operations, for code written once over 8 and 16 lanes (the exponential above,
// P.V's accumulation below).
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t n = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V x, V lowest) { return _mm256_max_ps(x, lowest); }
  static V floor(V a) { return _mm256_floor_ps(a); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V lowest, V value) {  // -inf too
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lowest, _CMP_LT_OQ), value);
  }
};

inline __m256 exp_nonpositive8(__m256 x) { return exp_nonpositive_v<Lanes8>(x); }
#endif

#if defined(TRIROUTE_AVX512)
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t n = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V x, V lowest) { return _mm512_max_ps(x, lowest); }
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, V lowest, V value) {  // -inf too
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ)), value);
  }
};

inline __m512 exp_nonpositive16(__m512 x) { return exp_nonpositive_v<Lanes16>(x); }
#endif

// s[t] = exp(s[t] - m) for t < c (arguments <= 0); returns their sum. The sum is one order on every
// build with AVX2: eight lanes, lane j adding s[j], s[j + 8], ... in turn, then one tree over the lanes.
inline float exp_shifted(float* s, int64_t c, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(TRIROUTE_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
#if defined(TRIROUTE_AVX512)
  const __m512 mw = _mm512_set1_ps(m);
  for (; t + 16 <= c; t += 16) {  // sixteen at a time, added into the eight lanes as two halves in turn
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mw));
    _mm512_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
#endif
  for (; t + 8 <= c; t += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
  for (; t < c; ++t) {
    s[t] = exp_nonpositive(s[t] - m);  // -inf -> 0
    sum += s[t];
  }
  return sum;
}

#if defined(TRIROUTE_AVX2)
// The lane sums of eight 8-lane accumulators, one per dot product, by one tree: lane j of the result
// is ((a_j[0] + a_j[1]) + (a_j[2] + a_j[3])) + ((a_j[4] + a_j[5]) + (a_j[6] + a_j[7])). The one
// reduction of the attention's scores and of the weight matmuls (gemv_rows8, gemm_rows8 and
// score_rows sum the same way, so their results do not depend on which of them ran).
inline __m256 sums8(const __m256 a[8]) {
  // lanes 0-3 of h0: a_0..a_3's low halves, 4-7 their high halves (h1: a_4..a_7)
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

#if defined(TRIROUTE_AVX512)
// A 16-lane accumulator folded into 8 lanes: lane j + lane j + 8.
inline __m256 fold16(__m512 b) {
  return _mm256_add_ps(_mm512_castps512_ps256(b), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(b), 1)));
}
#endif

// s[t] = (q . k_t) * scale for the c rows of kbuf (row t at kbuf + t * d); returns max(m, s[0..c)).
// The maximum is taken from the registers the scores are stored from: reading them back at once
// would wait on the stores (and a wide load over two narrower stores is not forwarded).
// D > 0: the head dim fixed at compile time (score_rows_any), the loops over channels unrolled.
template <int64_t D = 0>
inline float score_rows(const float* q, const float* kbuf, int64_t c, int64_t d_arg, float scale, float* s, float m) {
  const int64_t d = D > 0 ? D : d_arg;
  int64_t t = 0;
#if defined(TRIROUTE_AVX2)
  if (d % 8 == 0) {
    __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= c; t += 8) {  // eight keys at once: q read once, eight independent chains
      const float* k0 = kbuf + t * d;
      __m256 a[8];
#if defined(TRIROUTE_AVX512)
      if (d % 16 == 0) {  // 16 channels a step; each key's two halves then summed into 8 lanes
        __m512 w[8];
        for (int j = 0; j < 8; ++j) w[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
          const __m512 qv = _mm512_loadu_ps(q + i);
          for (int j = 0; j < 8; ++j) w[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + j * d + i), w[j]);
        }
        for (int j = 0; j < 8; ++j) a[j] = fold16(w[j]);
      } else
#endif
      {
        for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
          const __m256 qv = _mm256_loadu_ps(q + i);
          for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j * d + i), a[j]);
        }
      }
      const __m256 sums = _mm256_mul_ps(sums8(a), _mm256_set1_ps(scale));
      _mm256_storeu_ps(s + t, sums);
      mv = _mm256_max_ps(mv, sums);
    }
    __m128 mq = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    for (; t + 4 <= c; t += 4) {  // four keys at once, the same sums
      const float* k0 = kbuf + t * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * d + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * d + i), a3);
      }
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      const __m128 sums = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_set1_ps(scale));
      _mm_storeu_ps(s + t, sums);
      mq = _mm_max_ps(mq, sums);
    }
    float lanes[4];
    _mm_storeu_ps(lanes, mq);
    m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
  }
#endif
  for (; t < c; ++t) {
    s[t] = triroute_sums::dot8(q, kbuf + t * d, d) * scale;
    m = std::max(m, s[t]);
  }
  return m;
}

// score_rows with the head dims of the model configs (with_head_dim's) fixed at compile time.
inline float score_rows_any(const float* q, const float* kbuf, int64_t c, int64_t d, float scale, float* s, float m) {
  return with_head_dim(d, [&](auto D) { return score_rows<D()>(q, kbuf, c, d, scale, s, m); });
}

#if defined(TRIROUTE_AVX2)
// For each of NH heads h: acc[h][i..i + 4 L) += sum_t p[h][t] * v_t[i..i + 4 L), for each step of
// 4 L channels from i while they fit d: 4 NH vectors of L lanes in registers across all c rows, each
// V row loaded once for the NH heads (and NH x 4 independent chains of multiply-adds instead of 4: one
// head's chains wait on the multiply-add's latency). Lane by lane each head's sum runs over t in
// order, as with one head. Returns the first channel left.
template <class L, int NH>
inline int64_t accumulate_wide(float* const* acc, const float* const* p, const float* vbuf, int64_t c, int64_t d,
                               int64_t i) {
  for (; i + 4 * L::n <= d; i += 4 * L::n) {
    typename L::V a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) a[h][u] = L::load(acc[h] + i + u * L::n);
    for (int64_t t = 0; t < c; ++t) {
      const float* vr = vbuf + t * d + i;
      typename L::V v[4];
      for (int u = 0; u < 4; ++u) v[u] = L::load(vr + u * L::n);
      for (int h = 0; h < NH; ++h) {
        const typename L::V pt = L::set1(p[h][t]);
        for (int u = 0; u < 4; ++u) a[h][u] = L::fmadd(pt, v[u], a[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) L::store(acc[h] + i + u * L::n, a[h][u]);
  }
  return i;
}

template <class L>
inline int64_t accumulate_wide_heads(float* const* acc, const float* const* p, int nh, const float* vbuf, int64_t c,
                                     int64_t d, int64_t i) {
  switch (nh) {
    case 1: return accumulate_wide<L, 1>(acc, p, vbuf, c, d, i);
    case 2: return accumulate_wide<L, 2>(acc, p, vbuf, c, d, i);
#if defined(TRIROUTE_AVX512)
    case 3: return accumulate_wide<L, 3>(acc, p, vbuf, c, d, i);
    case 4: return accumulate_wide<L, 4>(acc, p, vbuf, c, d, i);
#endif
    default: TORCH_CHECK(false, "accumulate_rows: ", nh, " heads at once"); return i;
  }
}
#endif

// Heads accumulated together: 4 NH accumulators in registers (32 vector registers with AVX-512, 16
// without).
#if defined(TRIROUTE_AVX512)
constexpr int kMaxJointHeads = 4;
#else
constexpr int kMaxJointHeads = 2;
#endif

// acc[h] += sum_t p[h][t] * v_t over the c rows of vbuf, for nh <= kMaxJointHeads heads that read the
// same rows.
inline void accumulate_rows(float* const* acc, const float* const* p, int nh, const float* vbuf, int64_t c,
                            int64_t d) {
  int64_t i = 0;
#if defined(TRIROUTE_AVX512)
  i = accumulate_wide_heads<Lanes16>(acc, p, nh, vbuf, c, d, i);  // 64 channels a step (the same sums, lane by lane)
#endif
#if defined(TRIROUTE_AVX2)
  i = accumulate_wide_heads<Lanes8>(acc, p, nh, vbuf, c, d, i);  // 32 channels a step
#endif
  for (int h = 0; h < nh; ++h) {
    int64_t k0 = i;
#if defined(TRIROUTE_AVX2)
    for (; k0 + 8 <= d; k0 += 8) {
      __m256 a = _mm256_loadu_ps(acc[h] + k0);
      for (int64_t t = 0; t < c; ++t)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[h][t]), _mm256_loadu_ps(vbuf + t * d + k0), a);
      _mm256_storeu_ps(acc[h] + k0, a);
    }
#endif
    for (int64_t t = 0; t < c && k0 < d; ++t) {  // row by row: the compiler vectorises over channels
      const float pt = p[h][t];
      const float* vr = vbuf + t * d;
      for (int64_t k = k0; k < d; ++k) acc[h][k] += pt * vr[k];
    }
  }
}

// n floats whose first one starts a 64-byte cache line, not initialised (every user writes before
// it reads).
class CacheLineFloats {
 public:
  explicit CacheLineFloats(int64_t n) : storage_(new float[n + 16]) {
    const auto address = reinterpret_cast<uintptr_t>(storage_.get());
    data_ = storage_.get() + ((64 - address % 64) % 64) / sizeof(float);
  }
  CacheLineFloats(const CacheLineFloats&) = delete;  // data_ points into storage_
  CacheLineFloats& operator=(const CacheLineFloats&) = delete;
  float* data() { return data_; }

 private:
  std::unique_ptr<float[]> storage_;
  float* data_;
};

// One pool's tensors as raw pointers (all contiguous, checked by the caller).
struct PoolView {
  int bits;
  int64_t pages, P, H_kv, row_bytes, n_groups;  // row_bytes: packed codes (or f16 values) per (slot, head)
  const uint8_t *k_codes, *v_codes;
  const Half *k_scale, *k_zero, *v_scale, *v_zero, *k_values, *v_values;
  const int32_t* token_pos;
  int64_t kv_bytes;  // K + V bytes read for one (slot, kv head): codes + scale + zero, or the f16 values
};

// K (or V) of the c (slot, kv head) rows `rows` of one pool, as float32, row t at out + t * d.
inline void load_rows(const PoolView& pv, bool v, const int64_t* rows, int64_t c, int64_t d, int64_t gs, float* out) {
  const uint8_t* codes = v ? pv.v_codes : pv.k_codes;
  const Half* scale = v ? pv.v_scale : pv.k_scale;
  const Half* zero = v ? pv.v_zero : pv.k_zero;
  switch (pv.bits) {
    case 2: dequant_rows_any<2>(codes, scale, zero, rows, c, pv.row_bytes, pv.n_groups, d, gs, out); break;
    case 4: dequant_rows_any<4>(codes, scale, zero, rows, c, pv.row_bytes, pv.n_groups, d, gs, out); break;
    case 8: dequant_rows_any<8>(codes, scale, zero, rows, c, pv.row_bytes, pv.n_groups, d, gs, out); break;
    default: f16_rows(v ? pv.v_values : pv.k_values, rows, c, d, out);
  }
}

#if defined(TRIROUTE_AVX512)
// A decode step's keys without the round trip through kbuf and vbuf: each K or V row is dequantised
// into registers (NV vectors of 16 channels) and used there by every head that reads it. The values
// are dequant_row's and f16_rows', and the scores and sums below are
// score_rows' and accumulate_wide's (the same operations in the same order), so the op's outputs
// are the same bits either way; only the stores and loads of the buffers go.

// The float32 values of n <= 4 consecutive float16s (a row's scales or zeros of a slice), lane e the
// e-th (one load and one conversion for all of them).
template <int N>
inline __m128 halves(const Half* h) {
  static_assert(N >= 1 && N <= 4, "at most four halves");
  uint64_t bits = 0;
  std::memcpy(&bits, h, 2 * N);
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(bits)));
}

// Lane e of x in every lane.
inline __m512 lane_everywhere(__m128 x, int e) {
  return _mm512_permutexvar_ps(_mm512_set1_epi32(e), _mm512_castps128_ps512(x));
}

// Channels [c0, c0 + 16 NV) of the (slot, kv head) row `row` of pool pv (K, or V with v), GS
// channels a quantisation group (c0 and 16 NV multiples of GS), D the head dim.
template <int BITS, int64_t D, int64_t GS, int NV>
inline void row_vectors(const PoolView& pv, bool v, int64_t row, int64_t c0, __m512* out) {
  static_assert(GS % 16 == 0 && (16 * NV) % GS == 0 && D % GS == 0, "whole groups of whole vectors");
  if constexpr (BITS == 16) {
    const Half* src = (v ? pv.v_values : pv.k_values) + row * D + c0;
    for (int u = 0; u < NV; ++u)
      out[u] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * u)));
  } else {
    // the row's strides known at compile time; the slice's scales and zeros loaded and converted at once
    constexpr int64_t kRowBytes = D * BITS / 8, kGroups = D / GS, kSliceGroups = 16 * NV / GS;
    static_assert(kSliceGroups <= 4, "a slice's scales and zeros in one 4-lane conversion (with_fused_shape's shapes)");
    const uint8_t* codes = (v ? pv.v_codes : pv.k_codes) + row * kRowBytes;
    const int64_t g0 = row * kGroups + c0 / GS;
    const __m128 scales = halves<kSliceGroups>((v ? pv.v_scale : pv.k_scale) + g0);
    const __m128 zeros = halves<kSliceGroups>((v ? pv.v_zero : pv.k_zero) + g0);
    for (int u = 0, e = 0; u < NV; u += GS / 16, ++e) {
      const GroupValues16<BITS> values(lane_everywhere(scales, e), lane_everywhere(zeros, e));
      for (int f = 0; f < GS / 16; ++f) out[u + f] = values(codes, c0 + 16 * (u + f));
    }
  }
}

// score_rows<D> for NH heads that read the same c keys (rows) of pool pv: s[h][t] = (q[h] . k_t) *
// scale, m[h] = max(m[h], s[h][0..c)). Eight keys at a time as score_rows: each key's row into
// registers once, each head's 16-lane sum folded to 8 lanes, the eight keys' lanes summed by sums8.
// The last c % 8 keys go through kbuf and score_rows itself (its four-key and one-key loops).
template <int BITS, int64_t D, int NH>
void score_keys(const PoolView& pv, const int64_t* rows, int64_t c, float scale, const float* const* q, float* const* s,
                float* m, float* kbuf) {
  constexpr int NV = D / 16;
  int64_t t = 0;
  __m256 mv[NH];
  for (int h = 0; h < NH; ++h) mv[h] = _mm256_set1_ps(m[h]);
  __m256 folded[NH][8];
  for (; t + 8 <= c; t += 8) {
    for (int j = 0; j < 8; ++j) {
      __m512 k[NV];
      row_vectors<BITS, D, 32, NV>(pv, false, rows[t + j], 0, k);
      for (int h = 0; h < NH; ++h) {
        __m512 w = _mm512_setzero_ps();
        for (int u = 0; u < NV; ++u) w = _mm512_fmadd_ps(_mm512_loadu_ps(q[h] + 16 * u), k[u], w);
        folded[h][j] = fold16(w);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 sums = _mm256_mul_ps(sums8(folded[h]), _mm256_set1_ps(scale));
      _mm256_storeu_ps(s[h] + t, sums);
      mv[h] = _mm256_max_ps(mv[h], sums);
    }
  }
  for (int h = 0; h < NH; ++h) {
    float lanes[8];
    _mm256_storeu_ps(lanes, mv[h]);
    m[h] = *std::max_element(lanes, lanes + 8);
  }
  if (t == c) return;
  load_rows(pv, false, rows + t, c - t, D, 32, kbuf);
  for (int h = 0; h < NH; ++h) m[h] = score_rows<D>(q[h], kbuf, c - t, D, scale, s[h] + t, m[h]);
}

// accumulate_wide<Lanes16, NH> over the c rows `rows` of pool pv's V: acc[h] += sum_t p[h][t] v_t,
// 64 channels a step, each row's 64 channels into registers once for the NH heads.
template <int BITS, int64_t D, int NH>
void accumulate_keys(const PoolView& pv, const int64_t* rows, int64_t c, float* const* acc, const float* const* p) {
  static_assert(D % 64 == 0, "64 channels a step");
  for (int64_t i = 0; i < D; i += 64) {
    __m512 a[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) a[h][u] = _mm512_loadu_ps(acc[h] + i + 16 * u);
    for (int64_t t = 0; t < c; ++t) {
      __m512 v[4];
      row_vectors<BITS, D, 32, 4>(pv, true, rows[t], i, v);
      for (int h = 0; h < NH; ++h) {
        const __m512 pt = _mm512_set1_ps(p[h][t]);
        for (int u = 0; u < 4; ++u) a[h][u] = _mm512_fmadd_ps(pt, v[u], a[h][u]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc[h] + i + 16 * u, a[h][u]);
  }
}

// f(bits, D, NH as compile-time constants) for a pool width, a head dim the fused loops compile for
// (64, 128) and 1..4 heads.
template <class F>
inline void with_fused_shape(int bits, int64_t d, int nh, F&& f) {
  auto heads = [&](auto B, auto D) {
    switch (nh) {
      case 1: return f(B, D, std::integral_constant<int, 1>{});
      case 2: return f(B, D, std::integral_constant<int, 2>{});
      case 3: return f(B, D, std::integral_constant<int, 3>{});
      default: return f(B, D, std::integral_constant<int, 4>{});
    }
  };
  auto dims = [&](auto B) {
    if (d == 64) return heads(B, std::integral_constant<int64_t, 64>{});
    return heads(B, std::integral_constant<int64_t, 128>{});
  };
  switch (bits) {
    case 2: return dims(std::integral_constant<int, 2>{});
    case 4: return dims(std::integral_constant<int, 4>{});
    case 8: return dims(std::integral_constant<int, 8>{});
    default: return dims(std::integral_constant<int, 16>{});
  }
}
#endif

void check_pool_list(const char* name, const at::TensorList& ts, size_t W) {
  TORCH_CHECK(ts.size() == W, name, " holds ", ts.size(), " tensors but bits names ", W, " pools");
  for (const auto& t : ts) TORCH_CHECK(t.device().is_cpu(), name, " must be CPU tensors");
}

std::vector<PoolView> pool_views(at::TensorList k_data, at::TensorList k_scale, at::TensorList k_zero,
                                 at::TensorList v_data, at::TensorList v_scale, at::TensorList v_zero,
                                 at::TensorList token_pos, at::IntArrayRef bits, int64_t group_size, int64_t d,
                                 int64_t H_kv) {
  const size_t W = bits.size();
  check_pool_list("k_data", k_data, W);
  check_pool_list("k_scale", k_scale, W);
  check_pool_list("k_zero", k_zero, W);
  check_pool_list("v_data", v_data, W);
  check_pool_list("v_scale", v_scale, W);
  check_pool_list("v_zero", v_zero, W);
  check_pool_list("token_pos", token_pos, W);
  TORCH_CHECK(d <= kMaxHeadDim, "head dim ", d, " exceeds ", kMaxHeadDim);
  std::vector<PoolView> views(W);
  for (size_t w = 0; w < W; ++w) {
    PoolView& pv = views[w];
    pv.bits = static_cast<int>(bits[w]);
    const Tensor& tp = token_pos[w];
    TORCH_CHECK(tp.dim() == 2 && tp.scalar_type() == at::kInt && tp.is_contiguous(),
                "token_pos[", w, "] must be contiguous int32 [pages, P]");
    pv.pages = tp.size(0);
    pv.P = tp.size(1);
    pv.H_kv = H_kv;
    pv.token_pos = tp.data_ptr<int32_t>();
    pv.k_codes = pv.v_codes = nullptr;
    pv.k_scale = pv.k_zero = pv.v_scale = pv.v_zero = pv.k_values = pv.v_values = nullptr;
    for (const Tensor* t : {&k_data[w], &v_data[w]})
      TORCH_CHECK(t->dim() == 4 && t->size(0) == pv.pages && t->size(1) == pv.P && t->size(2) == H_kv &&
                      t->is_contiguous(),
                  "pool ", w, ": data must be contiguous [pages=", pv.pages, ", P=", pv.P, ", H_kv=", H_kv,
                  ", ...], got ", t->sizes());
    if (pv.bits == 16) {
      for (const Tensor* t : {&k_data[w], &v_data[w]})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->size(3) == d, "pool ", w,
                    ": 16-bit data must be float16 [..., d=", d, "]");
      pv.k_values = k_data[w].data_ptr<Half>();
      pv.v_values = v_data[w].data_ptr<Half>();
      pv.row_bytes = 2 * d;
      pv.n_groups = 0;
      pv.kv_bytes = 2 * pv.row_bytes;
    } else {
      TORCH_CHECK(pv.bits == 2 || pv.bits == 4 || pv.bits == 8, "bits[", w, "]=", pv.bits,
                  " is not a cache width; use 2, 4, 8 or 16");
      TORCH_CHECK(group_size > 0 && d % group_size == 0, "group_size=", group_size, " must divide d=", d);
      pv.row_bytes = d * pv.bits / 8;
      pv.n_groups = d / group_size;
      for (const Tensor* t : {&k_data[w], &v_data[w]})
        TORCH_CHECK(t->scalar_type() == at::kByte && t->size(3) == pv.row_bytes, "pool ", w,
                    ": codes must be uint8 [..., ", pv.row_bytes, "]");
      for (const Tensor* t : {&k_scale[w], &k_zero[w], &v_scale[w], &v_zero[w]})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 4 && t->size(0) == pv.pages &&
                        t->size(1) == pv.P && t->size(2) == H_kv && t->size(3) == pv.n_groups,
                    "pool ", w, ": scale/zero must be contiguous float16 [", pv.pages, ", ", pv.P, ", ", H_kv, ", ",
                    pv.n_groups, "]");
      pv.k_codes = k_data[w].data_ptr<uint8_t>();
      pv.v_codes = v_data[w].data_ptr<uint8_t>();
      pv.k_scale = k_scale[w].data_ptr<Half>();
      pv.k_zero = k_zero[w].data_ptr<Half>();
      pv.v_scale = v_scale[w].data_ptr<Half>();
      pv.v_zero = v_zero[w].data_ptr<Half>();
      pv.kv_bytes = 2 * (pv.row_bytes + 2 * 2 * pv.n_groups);
    }
  }
  return views;
}

}  // namespace

Tensor triroute_decode::paged_attention(const Tensor& q, at::TensorList k_data, at::TensorList k_scale, at::TensorList k_zero,
                           at::TensorList v_data, at::TensorList v_scale, at::TensorList v_zero,
                           at::TensorList token_pos, at::IntArrayRef bits, int64_t group_size,
                           const Tensor& page_tables, const Tensor& request, const Tensor& lo, const Tensor& hi,
                           double sm_scale, const Tensor& counters) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be float32 [N, H, d], got ", q.sizes());
  const int64_t N = q.size(0), H = q.size(1), d = q.size(2);
  TORCH_CHECK(!bits.empty(), "paged_attention needs at least one pool");
  TORCH_CHECK(k_data[0].dim() == 4, "k_data[0] must be [pages, P, H_kv, ...]");
  const int64_t H_kv = k_data[0].size(2);
  TORCH_CHECK(H_kv > 0 && H % H_kv == 0, "H=", H, " must be a multiple of the pools' H_kv=", H_kv, " (GQA)");
  const int64_t G = H / H_kv;
  const int64_t W = static_cast<int64_t>(bits.size());
  auto views = pool_views(k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits, group_size, d, H_kv);
  TORCH_CHECK(page_tables.dim() == 3 && page_tables.size(0) == W && page_tables.scalar_type() == at::kLong,
              "page_tables must be int64 [W=", W, ", R, M], got ", page_tables.scalar_type(), " ", page_tables.sizes());
  TORCH_CHECK(request.dim() == 1 && request.size(0) == N && request.scalar_type() == at::kLong,
              "request must be int64 [N=", N, "]");
  TORCH_CHECK(lo.dim() == 2 && lo.size(0) == N && lo.size(1) == H && lo.scalar_type() == at::kLong,
              "lo must be int64 [N=", N, ", H=", H, "]");
  TORCH_CHECK(hi.dim() == 1 && hi.size(0) == N && hi.scalar_type() == at::kLong, "hi must be int64 [N=", N, "]");
  TORCH_CHECK(counters.dim() == 1 && counters.size(0) == 2 && counters.scalar_type() == at::kLong &&
                  counters.is_contiguous(),
              "counters must be int64 [2]");
  const Tensor qc = q.contiguous();
  const Tensor tables = page_tables.contiguous();
  const Tensor req = request.contiguous(), loc = lo.contiguous(), hic = hi.contiguous();
  const int64_t R = tables.size(1), M = tables.size(2);
  const float* qp = qc.data_ptr<float>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* reqp = req.data_ptr<int64_t>();
  const int64_t* lop = loc.data_ptr<int64_t>();
  const int64_t* hip = hic.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(reqp[n] >= 0 && reqp[n] < R, "request[", n, "]=", reqp[n], " is not a row of page_tables (R=", R, ")");
  int64_t table_end = 0;  // the widest row's entries up to its last page, over the pools
  for (int64_t i = 0; i < W * R * M; ++i) {
    TORCH_CHECK(tab[i] < views[i / (R * M)].pages, "page_tables holds page ", tab[i], " but pool ", i / (R * M),
                " has ", views[i / (R * M)].pages, " pages");
    if (tab[i] >= 0) table_end = std::max(table_end, i % M + 1);
  }

  Tensor out = at::zeros({N, H, d}, q.options());
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  std::atomic<int64_t> macs_total{0}, bytes_total{0};

  // Keys are scored, softmaxed and accumulated in blocks of whole pages of one pool: up to
  // kBlockFloats / d slots (16 KB of dequantised K, and as much V, in the first-level cache), at
  // least one page. The per-block work (the running maximum's rescale, the loops' set-up) is paid
  // once per block rather than once per page: 15 % of the op's time at the 160m shape.
  constexpr int64_t kBlockFloats = 4096;
  int64_t P_max = 1;
  for (const auto& pv : views) P_max = std::max(P_max, pv.P);
  const int64_t B_max = std::max(P_max, kBlockFloats / d);

  // Work item = (chunk of consecutive rows of one request, kv head): a prefill's rows share their
  // request's pages, so each page is dequantised once per chunk, not once per row. Chunks of at
  // most kChunkRows rows keep the per-row state small and leave items for every thread.
  constexpr int64_t kChunkRows = 32;
  std::vector<int64_t> chunk_start;
  for (int64_t n = 0; n < N; ++n)
    if (n == 0 || reqp[n] != reqp[n - 1] || n - chunk_start.back() == kChunkRows) chunk_start.push_back(n);
  chunk_start.push_back(N);
  const int64_t n_chunks = static_cast<int64_t>(chunk_start.size()) - 1;
  int64_t chunk_rows = 1;  // the longest chunk's rows: a decode step's are one, so are its buffers' rows
  for (int64_t c = 0; c < n_chunks; ++c) chunk_rows = std::max(chunk_rows, chunk_start[c + 1] - chunk_start[c]);

  // Split-K: with few items for the threads (a decode step of few requests), each item's page list
  // is cut into S parts, one unit each, S the smallest count that gives every thread as many units
  // (threads / gcd(items, threads)); a unit keeps its online-softmax state (max, sum, weighted V)
  // for the merge below instead of writing the output. Each part holds at least kSplitPages table
  // entries of a pool.
  constexpr int64_t kSplitPages = 4;
  const int64_t n_items = n_chunks * H_kv, threads = at::get_num_threads();
  int64_t S = 1;
  if (threads > 1 && n_items < 4 * threads && !at::in_parallel_region())
    S = std::max<int64_t>(1, std::min(threads / std::gcd(n_items, threads), table_end / kSplitPages));
  const int64_t RG_max = chunk_rows * G, part_stride = d + 2;
  std::vector<float> part(S > 1 ? n_items * S * RG_max * part_stride : 0);  // zero (sum 0) where no head reads

  at::parallel_for(0, n_items * S, 1, [&](int64_t begin, int64_t end) {
    // One block of pages at a time (attend_block): their K rows in the chunk's range dequantised
    // into kbuf once, scored for every reading (row, head) of the chunk (row r's keys: positions in
    // lo[r, head]..hi[r], a contiguous run of the block's rows since positions increase along it),
    // one rescale per (row, head) and block, then their V rows dequantised into vbuf once and
    // accumulated.
    const int64_t RG = RG_max;
    // The dequantised K and V and the weighted sums start on a cache line: with d a multiple of 16,
    // every 64-byte vector load and store of them then stays inside one line (a line-crossing one
    // costs two accesses: 3-13 % of the op's time at the 160m shape with every buffer 16 bytes off).
    CacheLineFloats kbuf(B_max * d), vbuf(B_max * d), acc(RG * d), sbuf(RG * B_max);
    std::vector<float> m(RG), l(RG);
    float* const kb = kbuf.data();
    float* const vb = vbuf.data();
    float* const accp = acc.data();
    float* const sb = sbuf.data();
    std::vector<int64_t> lo_h(RG), rows(B_max), pos(B_max), first(RG), stop(RG), row_lo(kChunkRows);
    std::vector<char> reads(RG);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    int64_t macs = 0, bytes = 0;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / S, split = unit % S;
      const int64_t chunk = item / H_kv, g = item % H_kv;
      const int64_t n0 = chunk_start[chunk], RL = chunk_start[chunk + 1] - n0;
      int64_t lo_min = std::numeric_limits<int64_t>::max(), hi_max = -1;
      for (int64_t r = 0; r < RL; ++r) {
        const int64_t n = n0 + r, hi_n = hip[n];
        row_lo[r] = std::numeric_limits<int64_t>::max();  // the row's smallest reading lo (its bytes)
        for (int64_t j = 0; j < G; ++j) {
          const int64_t rj = r * G + j;
          lo_h[rj] = std::max<int64_t>(lop[n * H + g * G + j], 0);  // free slots (position -1) are never read
          reads[rj] = lo_h[rj] <= hi_n;
          if (reads[rj]) row_lo[r] = std::min(row_lo[r], lo_h[rj]);
          m[rj] = neg_inf;
          l[rj] = 0.f;
        }
        if (row_lo[r] <= hi_n) {
          lo_min = std::min(lo_min, row_lo[r]);
          hi_max = std::max(hi_max, hi_n);
        }
      }
      if (lo_min > hi_max) continue;  // no head of the chunk reads: out stays 0 (a split part: its sum 0)
      std::fill(accp, accp + RL * G * d, 0.f);
      [[maybe_unused]] const bool fused = RL == 1 && group_size == 32 && (d == 64 || d == 128);
      // Row r's keys in a block of c keys of pool pv: each of its heads' [first, stop) of the block
      // (empty where the head reads none of it), and the row's K and V bytes read (each row once per
      // query row: the counter's unit).
      auto row_keys = [&](const PoolView& pv, int64_t r, int64_t c) {
        const int64_t hi_n = hip[n0 + r];
        int64_t t1 = c;  // the row's keys end at its own position
        while (t1 > 0 && pos[t1 - 1] > hi_n) --t1;
        if (row_lo[r] <= hi_n) {
          int64_t b0 = 0;
          while (b0 < t1 && pos[b0] < row_lo[r]) ++b0;
          bytes += (t1 - b0) * pv.kv_bytes;
        }
        for (int64_t rj = r * G; rj < (r + 1) * G; ++rj) {
          int64_t t0 = 0;
          while (t0 < t1 && pos[t0] < lo_h[rj]) ++t0;
          first[rj] = t0;
          stop[rj] = reads[rj] ? t1 : t0;
        }
      };
      // The online softmax of (row, head) rj after scoring n_keys keys into s, their maximum with
      // m[rj] being m_new: s becomes the keys' weights, l and the weighted sum are rescaled.
      auto softmax_update = [&](int64_t rj, float* s, int64_t n_keys, float m_new) {
        macs += 2 * d * n_keys;
        // exp(-inf) = 0 before the first key; exp(0) = 1 exactly, so an unchanged maximum skips it
        const float alpha = m_new == m[rj] ? 1.f : exp_nonpositive(m[rj] - m_new);
        const float sum = exp_shifted(s, n_keys, m_new);
        l[rj] = l[rj] * alpha + sum;
        if (alpha != 1.f) {
          float* a = accp + rj * d;
          for (int64_t i = 0; i < d; ++i) a[i] *= alpha;
        }
        m[rj] = m_new;
      };
      // The heads of rj0's row, from rj0 on, that read the same keys of the block as rj0 (a decode
      // step's full heads; its local heads of one window), up to kMaxJointHeads, into js and marked
      // taken; returns how many.
      auto joint_heads = [&](int64_t rj0, int64_t* js) {
        const int64_t f0 = first[rj0], s0 = stop[rj0], row_end = (rj0 / G + 1) * G;
        int nh = 0;
        for (int64_t rj = rj0; rj < row_end && nh < kMaxJointHeads; ++rj)
          if (first[rj] == f0 && stop[rj] == s0) js[nh++] = rj;
        for (int e = 0; e < nh; ++e) stop[js[e]] = first[js[e]];
        return nh;
      };
#if defined(TRIROUTE_AVX512)
      // attend_block for a decode step's chunk (one row): the heads that read the same keys of the
      // block scored and accumulated together, each K and V row dequantised into registers once for
      // them (score_keys, accumulate_keys): the same values as below, without the buffers.
      auto attend_block_fused = [&](const PoolView& pv, int64_t c) {
        row_keys(pv, 0, c);
        const float* qr = qp + (n0 * H + g * G) * d;
        for (int64_t j0 = 0; j0 < G; ++j0) {
          if (first[j0] >= stop[j0]) continue;  // no key here, or taken with an earlier head
          const int64_t f0 = first[j0], n_keys = stop[j0] - f0;
          int64_t js[kMaxJointHeads];
          const int nh = joint_heads(j0, js);
          const float* qs[kMaxJointHeads];
          float* ss[kMaxJointHeads];
          float* accs[kMaxJointHeads];
          float ms[kMaxJointHeads];
          for (int e = 0; e < nh; ++e)
            qs[e] = qr + js[e] * d, ss[e] = sb + js[e] * B_max + f0, accs[e] = accp + js[e] * d, ms[e] = m[js[e]];
          const int64_t* keys = rows.data() + f0;
          with_fused_shape(pv.bits, d, nh, [&](auto B, auto D, auto NH) {
            score_keys<B(), D(), NH()>(pv, keys, n_keys, scale, qs, ss, ms, kb);
          });
          for (int e = 0; e < nh; ++e) softmax_update(js[e], ss[e], n_keys, ms[e]);
          with_fused_shape(pv.bits, d, nh, [&](auto B, auto D, auto NH) {
            accumulate_keys<B(), D(), NH()>(pv, keys, n_keys, accs, ss);
          });
        }
      };
#endif
      // The c keys gathered in rows/pos (positions ascending), all of pool pv.
      auto attend_block = [&](const PoolView& pv, int64_t c) {
#if defined(TRIROUTE_AVX512)
        if (fused) return attend_block_fused(pv, c);
#endif
        load_rows(pv, false, rows.data(), c, d, group_size, kb);
        for (int64_t r = 0; r < RL; ++r) {
          row_keys(pv, r, c);
          const float* qr = qp + ((n0 + r) * H + g * G) * d;
          for (int64_t j = 0; j < G; ++j) {
            const int64_t rj = r * G + j;
            if (first[rj] >= stop[rj]) continue;  // this head takes no key of the block
            float* sj = sb + rj * B_max + first[rj];
            const int64_t n_keys = stop[rj] - first[rj];
            softmax_update(rj, sj, n_keys, score_rows_any(qr + j * d, kb + first[rj] * d, n_keys, d, scale, sj, m[rj]));
          }
        }
        load_rows(pv, true, rows.data(), c, d, group_size, vb);
        // Each row's heads that read the same keys of the block accumulate together.
        for (int64_t rj0 = 0; rj0 < RL * G; ++rj0) {
          if (first[rj0] >= stop[rj0]) continue;  // no key here, or accumulated with an earlier head
          const int64_t f0 = first[rj0], n_keys = stop[rj0] - f0;
          int64_t js[kMaxJointHeads];
          const int nh = joint_heads(rj0, js);
          float* accs[kMaxJointHeads];
          const float* ps[kMaxJointHeads];
          for (int e = 0; e < nh; ++e) accs[e] = accp + js[e] * d, ps[e] = sb + js[e] * B_max + f0;
          accumulate_rows(accs, ps, nh, vb + f0 * d, n_keys, d);
        }
      };
      for (int64_t w = 0; w < W; ++w) {
        const PoolView& pv = views[w];
        const int64_t* row_pages = tab + (w * R + reqp[n0]) * M;
        int64_t used = M;  // this row's entries up to its last page; the unit's share of them
        while (used > 0 && row_pages[used - 1] < 0) --used;
        const int64_t mi0 = split * used / S, mi1 = (split + 1) * used / S;
        int64_t c = 0;  // keys gathered for the block so far
        for (int64_t mi = mi0; mi < mi1; ++mi) {
          const int64_t page = row_pages[mi];
          if (page < 0) continue;
          const int32_t* tp = pv.token_pos + page * pv.P;
          // Positions increase inside a page and unfilled slots are -1: the last filled slot holds
          // the page's largest position, the first its smallest. A page outside [lo_min, hi_max]
          // is never touched (a local head reads only the last pages).
          int64_t last = pv.P - 1;
          while (last >= 0 && tp[last] < 0) --last;
          if (last < 0 || tp[last] < lo_min || tp[0] > hi_max) continue;
          // A full block, or a page whose positions do not follow the block's, ends the block.
          if (c > 0 && (c + pv.P > B_max || tp[0] <= pos[c - 1])) {
            attend_block(pv, c);
            c = 0;
          }
          for (int64_t slot = 0; slot <= last; ++slot) {
            const int64_t p = tp[slot];
            if (p < lo_min || p > hi_max) continue;
            rows[c] = (page * pv.P + slot) * H_kv + g;  // (slot, kv head) row
            pos[c++] = p;
          }
        }
        if (c > 0) attend_block(pv, c);
      }
      for (int64_t r = 0; r < RL; ++r)
        for (int64_t j = 0; j < G; ++j) {
          const int64_t rj = r * G + j;
          if (S > 1) {  // the unit's state, for the merge
            float* st = part.data() + (unit * RG_max + rj) * part_stride;
            st[0] = m[rj], st[1] = l[rj];
            std::copy_n(accp + rj * d, d, st + 2);
            continue;
          }
          if (l[rj] <= 0.f) continue;
          float* o = op + ((n0 + r) * H + g * G + j) * d;
          for (int64_t i = 0; i < d; ++i) o[i] = accp[rj * d + i] / l[rj];
        }
    }
    macs_total += macs;
    bytes_total += bytes;
  });
  if (S > 1) {  // each (row, head) of an item: its S parts' states rescaled to their common maximum
    at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t chunk = item / H_kv, g = item % H_kv;
        const int64_t n0 = chunk_start[chunk], RL = chunk_start[chunk + 1] - n0;
        for (int64_t rj = 0; rj < RL * G; ++rj) {
          const float* st0 = part.data() + (item * S * RG_max + rj) * part_stride;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t sp = 0; sp < S; ++sp) mx = std::max(mx, st0[sp * RG_max * part_stride]);
          if (mx == -std::numeric_limits<float>::infinity()) continue;  // no key: out stays 0
          float* o = op + ((n0 + rj / G) * H + g * G + rj % G) * d;
          float sum = 0.f;
          for (int64_t sp = 0; sp < S; ++sp) {
            const float* st = st0 + sp * RG_max * part_stride;
            if (st[1] <= 0.f) continue;
            const float f = exp_nonpositive(st[0] - mx);
            sum += st[1] * f;
            for (int64_t i = 0; i < d; ++i) o[i] += st[2 + i] * f;
          }
          if (sum <= 0.f) continue;
          for (int64_t i = 0; i < d; ++i) o[i] /= sum;
        }
      }
    });
  }
  int64_t* cp = counters.data_ptr<int64_t>();
  cp[0] += macs_total.load();
  cp[1] += bytes_total.load();
  return out;
}

namespace {

// Quantise one group of gs float32 values at `bits`: quant.quantize_grouped's arithmetic.
template <int BITS>
inline void quantize_group(const float* x, int64_t gs, uint8_t* codes_row, int64_t first, Half* scale, Half* zero) {
  constexpr int levels = (1 << BITS) - 1;
  constexpr int per_byte = 8 / BITS;
  float mn, mx;
  triroute_format::group_range(x, gs, &mn, &mx);
  triroute_format::group_scale_zero(mn, mx, levels, scale, zero);
  const float s = static_cast<float>(*scale), z = static_cast<float>(*zero);
  for (int64_t i = 0; i < gs; ++i) {
    int code = 0;
    if (s > 0.f) {
      const float t = std::nearbyint((x[i] - z) / s);  // round half to even (default rounding mode)
      code = static_cast<int>(std::min(std::max(t, 0.f), static_cast<float>(levels)));
    }
    const int64_t c = first + i;
    uint8_t& byte = codes_row[c / per_byte];
    if (c % per_byte == 0) byte = 0;
    byte |= static_cast<uint8_t>(code << ((c % per_byte) * BITS));
  }
}

inline void quantize_row(int bits, const float* x, int64_t d, int64_t gs, uint8_t* codes, Half* scale, Half* zero) {
  for (int64_t g0 = 0, k = 0; g0 < d; g0 += gs, ++k) {
    switch (bits) {
      case 2: quantize_group<2>(x + g0, gs, codes, g0, scale + k, zero + k); break;
      case 4: quantize_group<4>(x + g0, gs, codes, g0, scale + k, zero + k); break;
      default: quantize_group<8>(x + g0, gs, codes, g0, scale + k, zero + k); break;
    }
  }
}

void cache_write_cpu(const Tensor& k, const Tensor& v, const Tensor& option, const Tensor& slots,
                     const Tensor& positions, at::TensorList k_data, at::TensorList k_scale, at::TensorList k_zero,
                     at::TensorList v_data, at::TensorList v_scale, at::TensorList v_zero, at::TensorList token_pos,
                     at::IntArrayRef bits, int64_t group_size) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must both be [N, H_kv, d], got ", k.sizes(), " and ",
              v.sizes());
  const int64_t N = k.size(0), H_kv = k.size(1), d = k.size(2);
  TORCH_CHECK(!bits.empty(), "cache_write needs at least one pool");
  auto views = pool_views(k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits, group_size, d, H_kv);
  for (const Tensor* t : {&option, &slots, &positions})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == N && t->scalar_type() == at::kLong,
                "option, slots and positions must be int64 [N=", N, "]");
  const Tensor kc = k.to(at::kFloat).contiguous(), vc = v.to(at::kFloat).contiguous();
  const Tensor oc = option.contiguous(), sc = slots.contiguous(), pc = positions.contiguous();
  const int64_t *opt = oc.data_ptr<int64_t>(), *slt = sc.data_ptr<int64_t>(), *pos = pc.data_ptr<int64_t>();
  const int64_t W = static_cast<int64_t>(bits.size());
  for (int64_t n = 0; n < N; ++n) {
    if (opt[n] < 0) continue;
    TORCH_CHECK(opt[n] < W, "option[", n, "]=", opt[n], " names no pool (", W, " pools)");
    const PoolView& pv = views[opt[n]];
    TORCH_CHECK(slt[n] >= 0 && slt[n] < pv.pages * pv.P, "slots[", n, "]=", slt[n], " must lie in [0, ",
                pv.pages * pv.P, ") of pool ", opt[n]);
  }
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  at::parallel_for(0, N * H_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / H_kv, h = item % H_kv;
      if (opt[n] < 0) continue;
      const int64_t w = opt[n];
      const PoolView& pv = views[w];
      const int64_t r = slt[n] * H_kv + h;
      const float* xk = kp + item * d;
      const float* xv = vp + item * d;
      if (pv.bits == 16) {
        Half* kd = const_cast<Half*>(pv.k_values) + r * d;
        Half* vd = const_cast<Half*>(pv.v_values) + r * d;
        for (int64_t i = 0; i < d; ++i) {
          kd[i] = Half(xk[i]);
          vd[i] = Half(xv[i]);
        }
      } else {
        const int64_t ng = pv.n_groups;
        quantize_row(pv.bits, xk, d, group_size, const_cast<uint8_t*>(pv.k_codes) + r * pv.row_bytes,
                     const_cast<Half*>(pv.k_scale) + r * ng, const_cast<Half*>(pv.k_zero) + r * ng);
        quantize_row(pv.bits, xv, d, group_size, const_cast<uint8_t*>(pv.v_codes) + r * pv.row_bytes,
                     const_cast<Half*>(pv.v_scale) + r * ng, const_cast<Half*>(pv.v_zero) + r * ng);
      }
      if (h == 0) const_cast<int32_t*>(pv.token_pos)[slt[n]] = static_cast<int32_t>(pos[n]);
    }
  });
}

// A decode step's append: one token per request (rows distinct). Token n of decode-state row
// rows[n] takes the next slot of its pool option[n]: index i = counts[option, row] (then
// counts[option, row] += 1), slot = tables[option, row, i / P] * P + i % P, and is written as
// cache_write writes it. The tensor ops of kv_cache.PagedKVCache.write_step are the definition.
}  // namespace

void triroute_decode::cache_append(const Tensor& k, const Tensor& v, const Tensor& option, const Tensor& rows,
                      const Tensor& positions, const Tensor& counts, const Tensor& tables, int64_t page_size,
                      at::TensorList k_data, at::TensorList k_scale, at::TensorList k_zero, at::TensorList v_data,
                      at::TensorList v_scale, at::TensorList v_zero, at::TensorList token_pos, at::IntArrayRef bits,
                      int64_t group_size) {
  const int64_t N = option.numel(), W = static_cast<int64_t>(bits.size());
  TORCH_CHECK(option.dim() == 1 && rows.sizes() == option.sizes() && option.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong,
              "cache_append: option and rows must be int64 [N], got ", option.sizes(), " and ", rows.sizes());
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == W && counts.scalar_type() == at::kLong &&
                  tables.dim() == 3 && tables.size(0) == W && tables.size(1) == counts.size(1) &&
                  tables.scalar_type() == at::kLong && page_size > 0,
              "cache_append: counts [pools, R] and tables [pools, R, width] int64, got ", counts.sizes(), " and ",
              tables.sizes());
  const int64_t R = counts.size(1), width = tables.size(2);
  const auto cs = counts.strides(), ts = tables.strides();
  int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const Tensor oc = option.contiguous(), rc = rows.contiguous();
  const int64_t *opt = oc.data_ptr<int64_t>(), *row = rc.data_ptr<int64_t>();
  Tensor slots = at::empty({N}, option.options());
  int64_t* slt = slots.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(opt[n] >= 0 && opt[n] < W && row[n] >= 0 && row[n] < R, "cache_append: token ", n, " has option ",
                opt[n], " (", W, " pools) and row ", row[n], " (", R, " rows)");
    const int64_t count = cp[opt[n] * cs[0] + row[n] * cs[1]], page_col = count / page_size;
    const int64_t page = page_col < width ? tp[opt[n] * ts[0] + row[n] * ts[1] + page_col * ts[2]] : -1;
    TORCH_CHECK(page >= 0, "cache_append: row ", row[n], " has no page reserved for its token ", count, " in pool ",
                opt[n], ". Fix: reserve room before the step (PagedKVCache.before_step)");
    slt[n] = page * page_size + count % page_size;
  }
  cache_write_cpu(k, v, option, slots, positions, k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos, bits,
                  group_size);
  for (int64_t n = 0; n < N; ++n) ++cp[opt[n] * cs[0] + row[n] * cs[1]];  // after the write: an error leaves them
}

namespace {

// --- decode linear ---------------------------------------------------------------------------
// y = x w^T for a few rows of x (a decode step's tokens): x [M, K], w [N, K] float32, row-major.
// At these shapes a matmul is bound by reading w once. BLAS's gemv reads it at about two thirds
// of one thread's streaming rate, and its small-M gemm slower still; eight independent rows of w in
// flight reach that rate, and each 8-row block serves every x row from the first-level cache.
// Other shapes, dtypes and builds: at::linear.
constexpr int64_t kDecodeLinearRows = 16;
#if defined(TRIROUTE_AVX2)
// How the kernels ask for the next block of w while a block streams: non-temporal, into the
// first-level cache without a place in the outer ones (the weights stream once a step). On an AMD
// EPYC (Zen 5) eight rows of x took 0.93-0.95x the time they took with the second-level hint, and a
// decode step at batch 8 0.97x (docs/kernels.md); on an AMX Xeon, with an older kernel, a
// non-temporal prefetch measured slower.
constexpr auto kNextBlockHint = _MM_HINT_NTA;
// Rows n0..n0+7 of y for one x row: eight row streams of w, one accumulator each.
inline void gemv_rows8(const float* w, const float* x, int64_t K, float* y, const float* next = nullptr) {
  __m256 a[8];
  int64_t k = 0;
#if defined(TRIROUTE_AVX512)
  {  // 16 channels a step; each row's two halves then summed into 8 lanes
    __m512 b[8];
    for (int r = 0; r < 8; ++r) b[r] = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      if (next != nullptr)  // the next block's line at this k, non-temporal (kNextBlockHint)
        for (int r = 0; r < 8; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), kNextBlockHint);
      const __m512 xv = _mm512_loadu_ps(x + k);
      for (int r = 0; r < 8; ++r) b[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * K + k), xv, b[r]);
    }
    for (int r = 0; r < 8; ++r) a[r] = fold16(b[r]);
  }
#else
  for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
#endif
  const int64_t K8 = K - K % 8;
  for (; k < K8; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), xv, a[r]);
  }
  _mm256_storeu_ps(y, sums8(a));
  for (int64_t k = K8; k < K; ++k)
    for (int r = 0; r < 8; ++r) y[r] += w[r * K + k] * x[k];
}
#endif

#if defined(TRIROUTE_AVX512)
// Rows n0..n0+7 of y for T rows of x at once (K a multiple of 16): 8 T accumulators in registers,
// each x chunk loaded once for the 8 rows of w and each w chunk once for the T rows of x, so a
// block of w is read T times fewer than by gemv_rows8 row after row (eight rows of x read a block
// of 24 KB eight times, from the second-level cache once x and w fill the first). Every (x row,
// w row) pair is summed exactly as gemv_rows8 sums it: the same 16-lane fused multiply-adds in the
// same order, the same fold to 8 lanes (fold16) and the same tree (sums8), so a row of y has the same bits
// whichever rows of x come with it.
template <int T>
inline void gemm_rows8(const float* w, const float* x, int64_t K, int64_t ldy, float* y,
                       const float* next, int next_r0, int next_r1) {
  __m512 b[T][8];
  for (int m = 0; m < T; ++m)
    for (int r = 0; r < 8; ++r) b[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (next != nullptr)  // rows next_r0..next_r1 of the next block: their line at this k (kNextBlockHint)
      for (int r = next_r0; r < next_r1; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), kNextBlockHint);
    __m512 xv[T];
    for (int m = 0; m < T; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < 8; ++r) {
      __m512 wv = _mm512_loadu_ps(w + r * K + k);
      __asm__("" : "+v"(wv));  // one load into a register: the compiler would fold a load into each multiply-add
      for (int m = 0; m < T; ++m) b[m][r] = _mm512_fmadd_ps(wv, xv[m], b[m][r]);
    }
  }
  for (int m = 0; m < T; ++m) {
    __m256 a[8];
    for (int r = 0; r < 8; ++r) a[r] = fold16(b[m][r]);
    _mm256_storeu_ps(y + m * ldy, sums8(a));
  }
}

// y rows n0..n0+7 for every row of x, three rows of x at a time (24 accumulators, the w and x
// chunks: within the 32 vector registers). Each pass over the block asks for its share of the next
// block's rows (pass i of P: rows 8 i / P .. 8 (i + 1) / P), so the next block's requests are spread
// over every pass; when the first pass asked for all of it and the others for nothing, eight rows
// of x took 1.06-1.11x the time.
inline void gemm_block8(const float* w, const float* x, int64_t M, int64_t K, int64_t ldy, float* y,
                        const float* next) {
  const int passes = static_cast<int>((M + 2) / 3);
  for (int i = 0; i < passes; ++i) {
    const int64_t m = 3 * i;
    const int r0 = 8 * i / passes, r1 = 8 * (i + 1) / passes;
    if (M - m >= 3) gemm_rows8<3>(w, x + m * K, K, ldy, y + m * ldy, next, r0, r1);
    else if (M - m == 2) gemm_rows8<2>(w, x + m * K, K, ldy, y + m * ldy, next, r0, r1);
    else gemm_rows8<1>(w, x + m * K, K, ldy, y + m * ldy, next, r0, r1);
  }
}
#endif

#if defined(TRIROUTE_AVX512)
// Up to kStreamRows rows of x: stream_rows8 below, one pass over the block.
constexpr int64_t kStreamRows = 4;

// Rows n0..n0+7 of y for T rows of x (K a multiple of 16), the block's rows of w read one after the
// other: the 8 K floats of the block, and of the matrix, in one sequential stream, where gemv_rows8
// and gemm_rows8 read eight streams K floats apart. Each (x row, w row) pair is summed exactly as
// they sum it (one 16-lane accumulator over k in order, fold16, the block's sums8 tree), so a row of
// y has the same bits whichever path or rows of x came with it. One accumulator chain per pair: at
// one to four rows of x the stream, not the chains' latency, bounds it (on an AMD EPYC, Zen 5: one
// row of x read w at 36-41 GB/s here against 33-36 through eight streams, two rows at 30-38 against
// 23-26 through the tile); from about six rows the tile's 24 independent chains are the faster.
template <int T>
inline void stream_rows8(const float* w, const float* x, int64_t K, float* y, int64_t ldy, const float* next) {
  __m256 a[T][8];
  for (int r = 0; r < 8; ++r) {
    const float* wr = w + r * K;
    __m512 b[T];
    for (int m = 0; m < T; ++m) b[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      if (next != nullptr)  // the next block's line at this k: one block ahead in the stream (kNextBlockHint)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), kNextBlockHint);
      const __m512 wv = _mm512_loadu_ps(wr + k);
      for (int m = 0; m < T; ++m) b[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), b[m]);
    }
    for (int m = 0; m < T; ++m) a[m][r] = fold16(b[m]);
  }
  for (int m = 0; m < T; ++m) _mm256_storeu_ps(y + m * ldy, sums8(a[m]));
}

inline void stream_block8(const float* w, const float* x, int64_t M, int64_t K, int64_t ldy, float* y,
                          const float* next) {
  switch (M) {
    case 1: stream_rows8<1>(w, x, K, y, ldy, next); break;
    case 2: stream_rows8<2>(w, x, K, y, ldy, next); break;
    case 3: stream_rows8<3>(w, x, K, y, ldy, next); break;
    default: stream_rows8<4>(w, x, K, y, ldy, next); break;
  }
}
#endif

}  // namespace

Tensor triroute_decode::decode_linear(const Tensor& x, const Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "decode_linear: x [M, K] and w [N, K], got ",
              x.sizes(), " and ", w.sizes());
#if defined(TRIROUTE_AVX2)
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  if (M >= 1 && M <= kDecodeLinearRows && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
      w.is_contiguous()) {
    const Tensor xc = x.contiguous();
    Tensor y = at::empty({M, N}, x.options());
    triroute_linear::rows(w.data_ptr<float>(), xc.data_ptr<float>(), M, N, K, y.data_ptr<float>());
    return y;
  }
#endif
  return at::linear(x, w);
}

namespace {

// Whether routed_experts_rows takes these: float32 contiguous CPU x, weight and expert weights.
bool few_rows_experts(const Tensor& x, const Tensor& weight, at::TensorList w1, at::TensorList w3,
                      at::TensorList w2) {
  const auto ok = [](const Tensor& t) { return t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(); };
  if (!ok(x) || !ok(weight)) return false;
  for (const auto* ws : {&w1, &w3, &w2})
    for (const Tensor& w : *ws)
      if (!ok(w) || w.dim() != 2) return false;
  return true;
}

// routed_experts for a decode step's few float32 rows: each expert's routes gathered into one
// buffer, its three matmuls by decode_linear's kernel (each weight read once), silu(a) * b and the
// gated sum in place, with no tensor op between them (at one token per request their dispatches
// and allocations cost more than the arithmetic). The routes (flat ids n * K + j) come grouped by
// expert: route[count[e]..count[e+1]) are expert e's. Expert order and each row's sum order are
// the tensor path's; silu is x / (1 + exp(-x)), so values equal it up to exp's rounding.
Tensor routed_experts_rows(const Tensor& x, const Tensor& weight, at::TensorList w1, at::TensorList w3,
                           at::TensorList w2, const std::vector<int64_t>& count, const int64_t* route, int64_t K) {
  const int64_t D = x.size(1), E = static_cast<int64_t>(w1.size());
  Tensor out = at::zeros_like(x);
  float* op = out.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *gp = weight.data_ptr<float>();
  std::vector<float> xe, a, b, y;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c0 = count[e], c = count[e + 1] - c0;
    if (c == 0) continue;
    const int64_t F = w1[e].size(0);
    TORCH_CHECK(w1[e].size(1) == D && w3[e].sizes() == w1[e].sizes() && w2[e].size(0) == D && w2[e].size(1) == F,
                "routed_experts: expert ", e, " has w1 ", w1[e].sizes(), ", w3 ", w3[e].sizes(), ", w2 ",
                w2[e].sizes(), " for rows of ", D);
    xe.resize(c * D), a.resize(c * F), b.resize(c * F), y.resize(c * D);
    for (int64_t i = 0; i < c; ++i) std::copy_n(xp + route[c0 + i] / K * D, D, xe.data() + i * D);
    triroute_linear::rows(w1[e].data_ptr<float>(), xe.data(), c, F, D, a.data());
    triroute_linear::rows(w3[e].data_ptr<float>(), xe.data(), c, F, D, b.data());
    for (int64_t i = 0; i < c * F; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
    triroute_linear::rows(w2[e].data_ptr<float>(), a.data(), c, D, F, y.data());
    for (int64_t i = 0; i < c; ++i) {
      const int64_t r = route[c0 + i];
      const float g = gp[r];
      float* o = op + r / K * D;
      for (int64_t j = 0; j < D; ++j) o[j] += y[i * D + j] * g;
    }
  }
  return out;
}

}  // namespace

Tensor triroute_decode::routed_experts(const Tensor& x, const Tensor& index, const Tensor& weight, at::TensorList w1,
                          at::TensorList w3, at::TensorList w2) {
  TORCH_CHECK(x.dim() == 2, "x must be [N, D], got ", x.sizes());
  const int64_t N = x.size(0), E = static_cast<int64_t>(w1.size());
  TORCH_CHECK(index.dim() == 2 && index.size(0) == N && index.scalar_type() == at::kLong,
              "index must be int64 [N=", N, ", k]");
  TORCH_CHECK(weight.sizes() == index.sizes(), "weight must have index's shape ", index.sizes());
  TORCH_CHECK(static_cast<int64_t>(w3.size()) == E && static_cast<int64_t>(w2.size()) == E,
              "w1, w3 and w2 must hold one weight per expert");
  const int64_t K = index.size(1);
  const Tensor ic = index.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  // Counting sort of the routes (token, slot) by expert; -1 is the null expert (no work).
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < N * K; ++i) {
    TORCH_CHECK(ip[i] >= -1 && ip[i] < E, "index holds expert ", ip[i], " but there are ", E, " experts (-1 = null)");
    if (ip[i] >= 0) ++count[ip[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  Tensor route = at::empty({count[E]}, index.options());  // flat route ids n * K + j, grouped by expert
  int64_t* rp = route.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * K; ++i)
    if (ip[i] >= 0) rp[fill[ip[i]]++] = i;
  if (N <= kDecodeLinearRows && few_rows_experts(x, weight, w1, w3, w2))
    return routed_experts_rows(x, weight, w1, w3, w2, count, rp, K);
  Tensor out = at::zeros_like(x);
  const Tensor wflat = weight.reshape({-1});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c0 = count[e], c1 = count[e + 1];
    if (c0 == c1) continue;
    const Tensor routes = route.slice(0, c0, c1);
    const Tensor rows = at::floor_divide(routes, K);
    const Tensor xe = x.index_select(0, rows);
    const Tensor h = at::silu(triroute_decode::decode_linear(xe, w1[e])) * triroute_decode::decode_linear(xe, w3[e]);
    const Tensor y = triroute_decode::decode_linear(h, w2[e]) * wflat.index_select(0, routes).to(x.scalar_type()).unsqueeze(1);
    out.index_add_(0, rows, y);
  }
  return out;
}

namespace {

// How many threads one at::parallel_for over `items` items ran on (each item its own chunk): the
// library's kernels parallelise as this does, so 1 under several torch threads means a build
// without OpenMP (cpu_ops.CFLAGS).
int64_t parallel_threads_cpu(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

// The core's float32 multiply-add peak: `iterations` rounds of twelve independent multiply-add
// chains (more than a core's multiply-add units times their latency) at the widest vector this build
// compiles for (16 lanes with AVX-512, 8 with AVX2 and FMA, else 1), in registers only: [floating-point
// operations executed (2 a lane a multiply-add), seconds]. The decode benchmark's roofline prices
// compute at torch.mm's rate; this is the ceiling its kernels' own vector code answers to.
std::vector<double> fma_probe_cpu(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "fma_probe: iterations must be positive, got ", iterations);
#if defined(TRIROUTE_AVX512)
  using Vec = __m512;
  constexpr int kLanes = 16;
#define TRIROUTE_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define TRIROUTE_SPLAT(v) _mm512_set1_ps(v)
#define TRIROUTE_LANE0(v) _mm512_cvtss_f32(v)
#elif defined(TRIROUTE_AVX2)
  using Vec = __m256;
  constexpr int kLanes = 8;
#define TRIROUTE_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define TRIROUTE_SPLAT(v) _mm256_set1_ps(v)
#define TRIROUTE_LANE0(v) _mm256_cvtss_f32(v)
#else
  using Vec = float;
  constexpr int kLanes = 1;
#define TRIROUTE_FMA(a, b, c) std::fma(a, b, c)
#define TRIROUTE_SPLAT(v) (v)
#define TRIROUTE_LANE0(v) (v)
#endif
  const Vec m = TRIROUTE_SPLAT(0.999999f), c = TRIROUTE_SPLAT(1e-7f);
  Vec a0 = TRIROUTE_SPLAT(0.f), a1 = TRIROUTE_SPLAT(1.f), a2 = TRIROUTE_SPLAT(2.f), a3 = TRIROUTE_SPLAT(3.f),
      a4 = TRIROUTE_SPLAT(4.f), a5 = TRIROUTE_SPLAT(5.f), a6 = TRIROUTE_SPLAT(6.f), a7 = TRIROUTE_SPLAT(7.f),
      a8 = TRIROUTE_SPLAT(8.f), a9 = TRIROUTE_SPLAT(9.f), a10 = TRIROUTE_SPLAT(10.f), a11 = TRIROUTE_SPLAT(11.f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n) {  // twelve chains: more than the units times their latency
    a0 = TRIROUTE_FMA(a0, m, c); a1 = TRIROUTE_FMA(a1, m, c); a2 = TRIROUTE_FMA(a2, m, c);
    a3 = TRIROUTE_FMA(a3, m, c); a4 = TRIROUTE_FMA(a4, m, c); a5 = TRIROUTE_FMA(a5, m, c);
    a6 = TRIROUTE_FMA(a6, m, c); a7 = TRIROUTE_FMA(a7, m, c); a8 = TRIROUTE_FMA(a8, m, c);
    a9 = TRIROUTE_FMA(a9, m, c); a10 = TRIROUTE_FMA(a10, m, c); a11 = TRIROUTE_FMA(a11, m, c);
    // every chain kept in a register and every round executed (no value the compiler could fold)
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                     "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = TRIROUTE_LANE0(a0) + TRIROUTE_LANE0(a1) + TRIROUTE_LANE0(a2) + TRIROUTE_LANE0(a3) +
                        TRIROUTE_LANE0(a4) + TRIROUTE_LANE0(a5) + TRIROUTE_LANE0(a6) + TRIROUTE_LANE0(a7) +
                        TRIROUTE_LANE0(a8) + TRIROUTE_LANE0(a9) + TRIROUTE_LANE0(a10) + TRIROUTE_LANE0(a11);
  (void)sink;
#undef TRIROUTE_FMA
#undef TRIROUTE_SPLAT
#undef TRIROUTE_LANE0
  return {2.0 * kLanes * 12 * static_cast<double>(iterations), seconds};
}

}  // namespace

namespace triroute_linear {
void rows(const float* w, const float* x, int64_t M, int64_t N, int64_t K, float* y, int64_t ldy) {
  if (ldy < 0) ldy = N;
#if defined(TRIROUTE_AVX2)
  const int64_t blocks = N / 8;
  // Per block of 8 rows of w (8 K floats: in the first-level cache once the first x row has
  // streamed it from memory), every x row: w is read from memory once whatever M. The threads take
  // equal runs of at least 8 blocks (64 rows of w), so a 768-row projection still spreads over them.
  // While a block streams from memory (its first x row or rows), the next block of the run is asked
  // for line by line (kNextBlockHint): the memory keeps streaming while the block serves its other x
  // rows (at eight rows, the 160m LM head in a decode step: 14 -> 11.5 ms). With AVX-512, up
  // to kStreamRows rows of x read the block row after row (stream_rows8: one sequential stream), more
  // rows go through it three at a time (gemm_block8); every path gives a row of y the same bits.
  at::parallel_for(0, blocks, 8, [&](int64_t b0, int64_t b1) {
    const auto next = [&](int64_t b) { return b + 1 < b1 ? w + (b + 1) * 8 * K : nullptr; };
#if defined(TRIROUTE_AVX512)
    if (M >= 1 && M <= kStreamRows && K % 16 == 0) {  // few rows of x: the block read row after row, once
      for (int64_t b = b0; b < b1; ++b) stream_block8(w + b * 8 * K, x, M, K, ldy, y + b * 8, next(b));
      return;
    }
    if (K % 16 == 0) {  // more rows of x: the block's rows of w read once for three of them
      for (int64_t b = b0; b < b1; ++b) gemm_block8(w + b * 8 * K, x, M, K, ldy, y + b * 8, next(b));
      return;
    }
#endif
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = 0; m < M; ++m)
        gemv_rows8(w + b * 8 * K, x + m * K, K, y + m * ldy + b * 8, m == 0 ? next(b) : nullptr);
  });
  for (int64_t n = blocks * 8; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * ldy + n] = triroute_sums::dot8(w + n * K, x + m * K, K);  // rows past the last block
#else
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  Tensor out = at::from_blob(y, {M, N}, {ldy, 1}, f32);
  at::mm_out(out, at::from_blob(const_cast<float*>(x), {M, K}, f32), at::from_blob(const_cast<float*>(w), {N, K}, f32).t());
#endif
}
}  // namespace triroute_linear

TORCH_LIBRARY(triroute, m) {
  m.def(
      "paged_attention(Tensor q, Tensor[] k_data, Tensor[] k_scale, Tensor[] k_zero, Tensor[] v_data, "
      "Tensor[] v_scale, Tensor[] v_zero, Tensor[] token_pos, int[] bits, int group_size, Tensor page_tables, "
      "Tensor request, Tensor lo, Tensor hi, float sm_scale, Tensor(a!) counters) -> Tensor");
  m.def(
      "cache_write(Tensor k, Tensor v, Tensor option, Tensor slots, Tensor positions, Tensor(a!)[] k_data, "
      "Tensor(b!)[] k_scale, Tensor(c!)[] k_zero, Tensor(d!)[] v_data, Tensor(e!)[] v_scale, Tensor(f!)[] v_zero, "
      "Tensor(g!)[] token_pos, int[] bits, int group_size) -> ()");
  m.def(
      "cache_append(Tensor k, Tensor v, Tensor option, Tensor rows, Tensor positions, Tensor(a!) counts, "
      "Tensor tables, int page_size, Tensor(b!)[] k_data, Tensor(c!)[] k_scale, Tensor(d!)[] k_zero, "
      "Tensor(e!)[] v_data, Tensor(f!)[] v_scale, Tensor(g!)[] v_zero, Tensor(h!)[] token_pos, int[] bits, "
      "int group_size) -> ()");
  m.def("routed_experts(Tensor x, Tensor index, Tensor weight, Tensor[] w1, Tensor[] w3, Tensor[] w2) -> Tensor");
  m.def("decode_linear(Tensor x, Tensor w) -> Tensor");
  m.def("parallel_threads(int items) -> int");
  m.def("fma_probe(int iterations) -> float[]");
}

TORCH_LIBRARY_IMPL(triroute, CPU, m) {
  m.impl("paged_attention", &triroute_decode::paged_attention);
  m.impl("cache_write", &cache_write_cpu);
  m.impl("cache_append", &triroute_decode::cache_append);
  m.impl("routed_experts", &triroute_decode::routed_experts);
  m.impl("decode_linear", &triroute_decode::decode_linear);
}

TORCH_LIBRARY_IMPL(triroute, CompositeExplicitAutograd, m) {
  m.impl("parallel_threads", &parallel_threads_cpu);
  m.impl("fma_probe", &fma_probe_cpu);
}
