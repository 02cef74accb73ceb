// out[b] = mean[b] + std[b] * eps(item_seeds[b], j) for a [B, ...] batch: reproducible latent sampling.
//
// eps is latentfast/sampling.py's definition, bit for bit in its integers: element j of item b is in
// group q = j / 4, whose Philox4x32-10 words (key = the item seed's two 32-bit halves, counter
// (q_lo, q_hi, STREAM_LATENT_EPS = 0, 0)) give the four normals of elements 4q .. 4q+3 by Box-Muller
// in float32. The float math is the definition's operation for operation; its log, cos and sin are
// this file's own (log_unit, sincos_quadrant: cephes' logf / sinf / cosf polynomials, within 2 ulp of
// the exact values), written without branches so the compiler vectorizes them -- libm's scalar logf
// and sincosf were 80% of the kernel's time, 3x the whole of torch's mean + std * randn. They use
// float multiplies and adds only (no fused multiply-add, see the pragma below), so every CPU and
// every vector path computes the same bits, which tests/test_sample_latents_op.py replays in numpy.
//
// mean, std and out have any strides and any of float32 / bfloat16 / float16 each. The work is cut
// into blocks of kBlock elements of one item: the block's normals are drawn into a buffer, then each
// tensor's elements of the block are read (or written) run by run, a run being contiguous in that
// tensor's collapsed item dims, so the index math is done once per run, never per element.
#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "checked_math.h"
#include "native.h"
#include "overlap_check.h"
#include "thread_pool.h"

// No a * b + c fused into one rounding, whatever -march a local build adds: the same bits everywhere.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace latentfast {
namespace {

constexpr const char* kOp = "sample_latents";
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
constexpr uint32_t kStreamLatentEps = 0;
constexpr float kTwoPi = 6.2831854820251465f;  // float32(2*pi), exactly
constexpr int64_t kBlock = 512;                 // elements per block (a multiple of 4: whole groups)

// Random123's philox4x32_10 for groups q0 .. q0 + n - 1 (n <= kBlock / 4) of the item whose seed is `seed`
// (uint64 bits): key = the seed's 32-bit halves, counter (q_lo, q_hi, STREAM_LATENT_EPS, 0); word i of
// group q0 + g into x[i][g]. One group's ten rounds at a time (a scalar loop; the AVX2 path below runs
// eight groups in registers and hands its tail to this loop).
void philox_groups(uint32_t seed_lo, uint32_t seed_hi, int64_t q0, int64_t g0, int64_t n, uint32_t (*x)[kBlock / 4]) {
  for (int64_t g = g0; g < n; ++g) {
    const uint64_t q = static_cast<uint64_t>(q0 + g);
    uint32_t c0 = static_cast<uint32_t>(q), c1 = static_cast<uint32_t>(q >> 32), c2 = kStreamLatentEps, c3 = 0;
    uint32_t k0 = seed_lo, k1 = seed_hi;
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
      c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
      c1 = static_cast<uint32_t>(p1);
      c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
      c3 = static_cast<uint32_t>(p0);
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    x[0][g] = c0, x[1][g] = c1, x[2][g] = c2, x[3][g] = c3;
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// hi and lo 32-bit halves of a * m for 8 lanes: vpmuludq multiplies the even lanes, then the odd ones
// shifted down; the halves are put back in place by blends (the compiler's own vectorization of the
// scalar loop shuffles between the two layouts every round, at half this speed).
__attribute__((target("avx2"))) inline void mulhilo8(__m256i a, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

__attribute__((target("avx2"))) void block_words_avx2(uint64_t seed, int64_t q0, int64_t n, uint32_t (*x)[kBlock / 4]) {
  const uint32_t seed_lo = static_cast<uint32_t>(seed), seed_hi = static_cast<uint32_t>(seed >> 32);
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0)), m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t g = 0;
  for (; g + 8 <= n; g += 8) {
    const uint64_t q = static_cast<uint64_t>(q0 + g);
    if (static_cast<uint32_t>(q) > 0xFFFFFFFFu - 7) break;  // the counter's high word changes inside: scalar
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(q))), lane);
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(q >> 32)));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(kStreamLatentEps)), c3 = _mm256_setzero_si256();
    uint32_t k0 = seed_lo, k1 = seed_hi;
    for (int round = 0; round < 10; ++round) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c0, m0, &hi0, &lo0);
      mulhilo8(c2, m1, &hi1, &lo1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[0] + g), c0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[1] + g), c1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[2] + g), c2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x[3] + g), c3);
  }
  philox_groups(seed_lo, seed_hi, q0, g, n, x);
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

void block_words(uint64_t seed, int64_t q0, int64_t n, uint32_t (*x)[kBlock / 4]) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (cpu_has_avx2()) return block_words_avx2(seed, q0, n, x);
#endif
  philox_groups(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), q0, 0, n, x);
}

// float32 constants, as hex so that the numpy replay in the tests uses the very same values: cephes'
// logf polynomial, ln 2 in two parts, pi / 2 in three (Cody-Waite), cephes' sinf and cosf polynomials.
constexpr float kLogP[9] = {0x1.204376p-4f,  -0x1.d7a370p-4f, 0x1.de4a34p-4f,  -0x1.fcba9ep-4f, 0x1.23d37ep-3f,
                            -0x1.555ca0p-3f, 0x1.999d58p-3f,  -0x1.fffff8p-3f, 0x1.555554p-2f};
constexpr float kLn2Hi = 0x1.63p-1f, kLn2Lo = -0x1.bd0106p-13f, kSqrtHalf = 0x1.6a09e6p-1f;
constexpr float kTwoOverPi = 0x1.45f306p-1f, kPio2Hi = 0x1.92p+0f, kPio2Mid = 0x1.fb4p-12f, kPio2Lo = 0x1.4442d2p-24f;
constexpr float kSin[3] = {-0x1.9943f2p-13f, 0x1.11073cp-7f, -0x1.555546p-3f};
constexpr float kCos[3] = {0x1.99eb9cp-16f, -0x1.6c0c34p-10f, 0x1.55554ap-5f};

// ln(x) for x in [2**-24, 1] (Box-Muller's u1): x = m * 2**e with m in [sqrt(1/2), sqrt(2)), then
// ln(x) = e * ln 2 + log1p(m - 1) by cephes' polynomial; m - 1 is exact (Sterbenz). The choices are
// bit operations, not branches, so that the loops calling it vectorize.
inline float log_unit(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t mantissa = (bits & 0x007FFFFFu) | 0x3F000000u;  // m in [0.5, 1)
  const uint32_t low = mantissa < float_bits(kSqrtHalf);           // then m = 2m (exact), e - 1
  const float f = bits_float(mantissa + (low << 23)) - 1.0f;
  const float e = static_cast<float>(static_cast<int32_t>((bits >> 23) - 126 - low));
  const float z = f * f;
  float y = kLogP[0];
  for (int k = 1; k < 9; ++k) y = y * f + kLogP[k];
  y = y * f * z;
  y = y + kLn2Lo * e;
  y = y - 0.5f * z;
  return (f + y) + kLn2Hi * e;
}

// cos(t) and sin(t) for t in [0, 2 pi]: t = q * pi/2 + x with |x| <= pi/4 (q <= 4: the products with
// kPio2Hi and kPio2Mid are exact), the polynomials on x, swapped (q odd) and negated by the quadrant,
// again with bit operations.
inline void sincos_quadrant(float t, float* cos_t, float* sin_t) {
  const uint32_t q = static_cast<uint32_t>(static_cast<int32_t>(t * kTwoOverPi + 0.5f));  // t >= 0: nearest
  const float fq = static_cast<float>(static_cast<int32_t>(q));
  const float x = ((t - fq * kPio2Hi) - fq * kPio2Mid) - fq * kPio2Lo;
  const float z = x * x;
  const uint32_t sin_x = float_bits(((kSin[0] * z + kSin[1]) * z + kSin[2]) * z * x + x);
  const uint32_t cos_x = float_bits((((kCos[0] * z + kCos[1]) * z + kCos[2]) * z * z - 0.5f * z) + 1.0f);
  const uint32_t odd = 0u - (q & 1u);  // all ones for q odd
  *sin_t = bits_float(((cos_x & odd) | (sin_x & ~odd)) ^ ((q & 2u) << 30));
  *cos_t = bits_float(((sin_x & odd) | (cos_x & ~odd)) ^ (((q + 1u) & 2u) << 30));
}

// The block's normals: group g's pairs (x0, x1) and (x2, x3) give eps[4g .. 4g+3] (u1 in (0, 1], u2 in
// [0, 1), both exact). One loop over the groups, vectorized across them.
__attribute__((target_clones("avx2", "default"))) void block_normals(const uint32_t (*x)[kBlock / 4], int64_t n,
                                                                     float* eps) {
  for (int64_t g = 0; g < n; ++g) {
    const float r0 = sqrtf(-2.0f * log_unit(static_cast<float>(static_cast<int32_t>((x[0][g] >> 8) + 1)) * 0x1p-24f));
    const float r1 = sqrtf(-2.0f * log_unit(static_cast<float>(static_cast<int32_t>((x[2][g] >> 8) + 1)) * 0x1p-24f));
    float c0, s0, c1, s1;
    sincos_quadrant(static_cast<float>(static_cast<int32_t>(x[1][g] >> 8)) * 0x1p-24f * kTwoPi, &c0, &s0);
    sincos_quadrant(static_cast<float>(static_cast<int32_t>(x[3][g] >> 8)) * 0x1p-24f * kTwoPi, &c1, &s1);
    eps[4 * g] = r0 * c0;
    eps[4 * g + 1] = r0 * s0;
    eps[4 * g + 2] = r1 * c1;
    eps[4 * g + 3] = r1 * s1;
  }
}

// One tensor's item (dims 1..) with adjacent dims merged where their strides allow: element j of item
// b is at  b * batch_stride + (the index of j / W in the outer dims) + (j % W) * stride of the last dim.
struct ItemLayout {
  char* data;
  int64_t dtype, batch_stride;
  std::vector<int64_t> sizes, strides;  // outermost first; the last is the run dimension (W)

  explicit ItemLayout(const Tensor& t) : data(static_cast<char*>(t.data)), dtype(t.dtype), batch_stride(t.stride(0)) {
    for (int64_t d = t.dim() - 1; d >= 1; --d) {
      if (t.size(d) == 1) continue;
      if (!sizes.empty() && t.stride(d) == strides.front() * sizes.front()) {
        sizes.front() *= t.size(d);  // merges with the dim inside it (exists, so no overflow)
      } else {
        sizes.insert(sizes.begin(), t.size(d));
        strides.insert(strides.begin(), t.stride(d));
      }
    }
    if (sizes.empty()) sizes = {1}, strides = {1};
  }
  int64_t width() const { return sizes.back(); }
  int64_t offset(int64_t b, int64_t j) const {  // in elements
    const int64_t W = width();
    int64_t off = b * batch_stride + (j % W) * strides.back(), row = j / W;
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0 && row; --d) {
      off += (row % sizes[d]) * strides[d];
      row /= sizes[d];
    }
    return off;
  }
};

template <typename T>
void load_run(const char* data, int64_t offset, int64_t stride, int64_t n, float* dst) {
  const T* p = reinterpret_cast<const T*>(data) + offset;
  if (stride == 1) {  // the common case, as its own loop: it vectorizes
    for (int64_t k = 0; k < n; ++k) dst[k] = to_float(p[k]);
    return;
  }
  for (int64_t k = 0; k < n; ++k) dst[k] = to_float(p[k * stride]);
}

template <typename T>
void store_run(char* data, int64_t offset, int64_t stride, int64_t n, const float* src) {
  T* p = reinterpret_cast<T*>(data) + offset;
  if (stride == 1) {
    for (int64_t k = 0; k < n; ++k) p[k] = from_float<T>(src[k]);
    return;
  }
  for (int64_t k = 0; k < n; ++k) p[k * stride] = from_float<T>(src[k]);
}

// Elements [j, j + n) of item b between `buffer` and the tensor, run by run (load or store).
template <bool kStore>
void transfer(const ItemLayout& t, int64_t b, int64_t j, int64_t n, float* buffer) {
  const int64_t W = t.width(), stride = t.strides.back();
  while (n > 0) {
    const int64_t run = std::min(n, W - j % W), offset = t.offset(b, j);
    switch (t.dtype) {
      case kFloat: kStore ? store_run<float>(t.data, offset, stride, run, buffer) : load_run<float>(t.data, offset, stride, run, buffer); break;
      case kHalf: kStore ? store_run<Half>(t.data, offset, stride, run, buffer) : load_run<Half>(t.data, offset, stride, run, buffer); break;
      default: kStore ? store_run<BFloat16>(t.data, offset, stride, run, buffer) : load_run<BFloat16>(t.data, offset, stride, run, buffer);
    }
    buffer += run, j += run, n -= run;
  }
}

struct Batch {
  ItemLayout mean, std, out;
  const int64_t* seeds;
  int64_t seeds_stride;
};

// Where elements [j, j + n) of item b are float32 and contiguous in t (one run of stride 1), t's own
// memory, read or written in place; else nullptr (they go through a buffer).
float* float32_run(const ItemLayout& t, int64_t b, int64_t j, int64_t n) {
  if (t.dtype != kFloat || t.strides.back() != 1 || j % t.width() + n > t.width()) return nullptr;
  return reinterpret_cast<float*>(t.data) + t.offset(b, j);
}

// Elements [j0, j0 + n) of item b, n <= kBlock, j0 a multiple of 4.
void sample_block(const Batch& batch, int64_t b, int64_t j0, int64_t n) {
  float eps[kBlock], mean_buffer[kBlock], std_buffer[kBlock];
  uint32_t words[4][kBlock / 4];
  const int64_t groups = (n + 3) / 4;
  block_words(static_cast<uint64_t>(batch.seeds[b * batch.seeds_stride]), j0 / 4, groups, words);
  block_normals(words, groups, eps);
  const float* mean = float32_run(batch.mean, b, j0, n);
  if (!mean) {
    transfer<false>(batch.mean, b, j0, n, mean_buffer);
    mean = mean_buffer;
  }
  const float* std = float32_run(batch.std, b, j0, n);
  if (!std) {
    transfer<false>(batch.std, b, j0, n, std_buffer);
    std = std_buffer;
  }
  float* out = float32_run(batch.out, b, j0, n);
  float* __restrict dst = out ? out : eps;  // out overlaps neither mean nor std (checked)
  for (int64_t k = 0; k < n; ++k) {
    const float scaled = std[k] * eps[k];  // rounded before the add, as the reference computes it
    dst[k] = mean[k] + scaled;
  }
  if (!out) transfer<true>(batch.out, b, j0, n, eps);
}

void check_sample_tensor(const Tensor& t, const char* name, const Tensor& mean) {
  LF_CHECK_VALUE(t.is_cpu(), kOp, " (cpu kernel): ", name, " must be a CPU tensor, got ", t.device_name());
  LF_CHECK_VALUE(t.dtype == kFloat || t.dtype == kHalf || t.dtype == kBFloat16, kOp, ": ", name,
                 " must be float16, bfloat16 or float32, got ", dtype_name(t.dtype));
  LF_CHECK_VALUE(t.sizes() == mean.sizes(), kOp, ": ", name, " must match mean's shape ", mean.shape(), ", got ",
                 t.shape());
}

// An out whose elements share memory (a stride-0 or overlapping view) would be written by two
// threads at once: refused. Sufficient test: sorted by stride, each dim steps past the span of those
// inside it.
void check_no_internal_overlap(const Tensor& out) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size) of dims of size > 1
  for (int64_t d = 0; d < out.dim(); ++d) {
    if (out.size(d) > 1) dims.emplace_back(std::llabs(out.stride(d)), out.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // elements from the first to the last one reachable through the dims so far
  for (const auto& [stride, size] : dims) {
    LF_CHECK_VALUE(stride > span, kOp, ": out has elements that share memory (strides ", out.strides(),
                   "); it must be a tensor whose elements are distinct");
    span = checked_add(span, checked_mul(stride, size - 1, kOp, "out's span"), kOp, "out's span");
  }
}

void check_arguments(const Tensor& mean, const Tensor& std, const Tensor& seeds, const Tensor& out) {
  LF_CHECK_VALUE(mean.dim() >= 1, kOp, ": mean must be a [B, ...] batch (one item per row), got a 0-d tensor");
  check_sample_tensor(mean, "mean", mean);
  check_sample_tensor(std, "std", mean);
  check_sample_tensor(out, "out", mean);
  LF_CHECK_VALUE(seeds.is_cpu() && seeds.dtype == kLong && seeds.dim() == 1 && seeds.size(0) == mean.size(0), kOp,
                 ": item_seeds must be an int64 CPU tensor [", mean.size(0), "] (one per item, from item_seeds()), got ",
                 dtype_name(seeds.dtype), " ", seeds.shape(), " on ", seeds.device_name());
  check_no_internal_overlap(out);
  check_no_overlap(kOp, out, "out", mean, "mean");
  check_no_overlap(kOp, out, "out", std, "std");
  check_no_overlap(kOp, out, "out", seeds, "item_seeds");
}

void sample_latents_into_cpu(const Tensor& mean, const Tensor& std, const Tensor& seeds, const Tensor& out,
                             int64_t max_threads) {
  check_arguments(mean, std, seeds, out);
  const int64_t B = mean.size(0), N = mean.numel() == 0 ? 0 : mean.numel() / B;
  if (B == 0 || N == 0) return;
  const int64_t blocks_per_item = N / kBlock + (N % kBlock != 0);
  const int64_t blocks = checked_mul(B, blocks_per_item, kOp, "blocks");
  const Batch batch{ItemLayout(mean), ItemLayout(std), ItemLayout(out), seeds.ptr<int64_t>(), seeds.stride(0)};
  // ~1.5-3 ns per element: a thread per 64K elements at least (~0.1-0.2 ms of work; waking one costs
  // ~10 us), chunks of 8 blocks (~10 us each: a descheduled thread's share goes to the others)
  const int64_t threads = std::clamp<int64_t>(checked_mul(B, N, kOp, "elements") / (64 << 10), 1,
                                              std::max<int64_t>(max_threads, 1));
  parallel_for(blocks, 8, threads, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t b = k / blocks_per_item, j0 = (k % blocks_per_item) * kBlock;
      sample_block(batch, b, j0, std::min(kBlock, N - j0));
    }
  });
}

// The words of groups [first_group, first_group + G) of each item, G = out.size(1) / 4 (a test hook:
// the integer stream, compared bit for bit with latentfast.sampling.philox_words).
void philox_words_cpu(const Tensor& seeds, int64_t first_group, const Tensor& out) {
  LF_CHECK_VALUE(seeds.is_cpu() && seeds.dtype == kLong && seeds.dim() == 1, kOp,
                 ": item_seeds must be a 1-D int64 CPU tensor, got ", dtype_name(seeds.dtype), " ", seeds.shape());
  LF_CHECK_VALUE(out.is_cpu() && out.dtype == kLong && out.dim() == 2 && out.is_contiguous() &&
                     out.size(0) == seeds.size(0) && out.size(1) % 4 == 0,
                 kOp, ": out must be a contiguous int64 CPU tensor [B, 4 * G], got ", out.shape());
  const int64_t groups = out.size(1) / 4;
  LF_CHECK_VALUE(first_group >= 0 && groups <= INT64_MAX - first_group, kOp, ": groups [", first_group, ", +",
                 groups, ") are outside [0, 2**63)");
  check_no_overlap(kOp, out, "out", seeds, "item_seeds");
  int64_t* dst = out.ptr<int64_t>();
  for (int64_t b = 0; b < seeds.size(0); ++b) {
    const uint64_t seed = static_cast<uint64_t>(seeds.ptr<int64_t>()[b * seeds.stride(0)]);
    for (int64_t q = 0; q < groups; q += kBlock / 4) {  // the sampling kernel's own blocks of groups
      uint32_t words[4][kBlock / 4];
      const int64_t n = std::min(kBlock / 4, groups - q);
      block_words(seed, first_group + q, n, words);
      for (int64_t g = 0; g < n; ++g, dst += 4) {
        for (int i = 0; i < 4; ++i) dst[i] = words[i][g];
      }
    }
  }
}

}  // namespace

// args: mean, std, item_seeds, out, threads
LATENTFAST_ENTRY(latentfast_sample_latents_into) {
  const Tensor mean = in.tensor(), std = in.tensor(), seeds = in.tensor(), out = in.tensor();
  const int64_t threads = in.integer();
  in.finish();
  sample_latents_into_cpu(mean, std, seeds, out, threads);
}

// args: item_seeds, first_group, out
LATENTFAST_ENTRY(latentfast_sample_latents_philox_words) {
  const Tensor seeds = in.tensor();
  const int64_t first_group = in.integer();
  const Tensor out = in.tensor();
  in.finish();
  philox_words_cpu(seeds, first_group, out);
}

}  // namespace latentfast
