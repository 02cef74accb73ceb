// out[b] = mean[b] + std[b] * eps(item_seeds[b], j) for a [B, ...] batch: reproducible latent sampling.
//
// eps is latentfast/sampling.py's definition, bit for bit in its integers: element j of item b is in
// group q = j / 4, whose Philox4x32-10 words (key = the item seed's two 32-bit halves, counter
// (q_lo, q_hi, STREAM_LATENT_EPS = 0, 0)) give the four normals of elements 4q .. 4q+3 by Box-Muller
// in float32 with libm's logf, sqrtf, cosf and sinf. The float math is the reference's operation for
// operation (no fused multiply-add: the build targets baseline x86-64); only the transcendental
// functions may differ from torch's (vectorized) ones in the last bit.
//
// mean, std and out have any strides and any of float32 / bfloat16 / float16 each. The work is cut
// into blocks of kBlock elements of one item: the block's normals are drawn into a buffer, then each
// tensor's elements of the block are read (or written) run by run, a run being contiguous in that
// tensor's collapsed item dims, so the index math is done once per run, never per element.
#include <algorithm>
#include <cmath>
#include <vector>

#include "checked_math.h"
#include "native.h"
#include "overlap_check.h"
#include "thread_pool.h"

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
// group q0 + g into x[i][g]. The groups sit side by side so the compiler vectorizes the rounds across
// them (AVX2's vpmuludq where the CPU has it, chosen at load time; SSE2 else): ~6% of the kernel's time
// against one group at a time (the rest is libm's logf and sincosf).
__attribute__((target_clones("avx2", "default"))) void block_words(uint64_t seed, int64_t q0, int64_t n,
                                                                   uint32_t (*x)[kBlock / 4]) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t g = 0; g < n; ++g) {
    const uint64_t q = static_cast<uint64_t>(q0 + g);
    x[0][g] = static_cast<uint32_t>(q), x[1][g] = static_cast<uint32_t>(q >> 32);
    x[2][g] = kStreamLatentEps, x[3][g] = 0;
  }
  for (int round = 0; round < 10; ++round) {
    for (int64_t g = 0; g < n; ++g) {
      const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * x[0][g];
      const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * x[2][g];
      x[0][g] = static_cast<uint32_t>(p1 >> 32) ^ x[1][g] ^ k0;
      x[1][g] = static_cast<uint32_t>(p1);
      x[2][g] = static_cast<uint32_t>(p0 >> 32) ^ x[3][g] ^ k1;
      x[3][g] = static_cast<uint32_t>(p0);
    }
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
}

// Two float32 standard normals from two words: u1 in (0, 1], u2 in [0, 1), both exact.
inline void box_muller(uint32_t a, uint32_t b, float* z) {
  const float u1 = static_cast<float>((a >> 8) + 1) * 0x1p-24f;
  const float u2 = static_cast<float>(b >> 8) * 0x1p-24f;
  const float r = sqrtf(-2.0f * logf(u1));
  const float t = u2 * kTwoPi;
  z[0] = r * cosf(t);
  z[1] = r * sinf(t);
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
  for (int64_t k = 0; k < n; ++k) dst[k] = to_float(p[k * stride]);
}

template <typename T>
void store_run(char* data, int64_t offset, int64_t stride, int64_t n, const float* src) {
  T* p = reinterpret_cast<T*>(data) + offset;
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

// Elements [j0, j0 + n) of item b, n <= kBlock, j0 a multiple of 4.
void sample_block(const Batch& batch, int64_t b, int64_t j0, int64_t n) {
  float eps[kBlock], mean[kBlock], std[kBlock];
  uint32_t words[4][kBlock / 4];
  const int64_t groups = (n + 3) / 4;
  block_words(static_cast<uint64_t>(batch.seeds[b * batch.seeds_stride]), j0 / 4, groups, words);
  for (int64_t g = 0; g < groups; ++g) {
    box_muller(words[0][g], words[1][g], eps + 4 * g);
    box_muller(words[2][g], words[3][g], eps + 4 * g + 2);
  }
  transfer<false>(batch.mean, b, j0, n, mean);
  transfer<false>(batch.std, b, j0, n, std);
  for (int64_t k = 0; k < n; ++k) {
    const float scaled = std[k] * eps[k];  // rounded before the add, as the reference computes it
    eps[k] = mean[k] + scaled;
  }
  transfer<true>(batch.out, b, j0, n, eps);
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
  // ~40 ns per element: a thread per 16K elements at least (waking one costs ~10 us), chunks of 8 blocks
  const int64_t threads = std::clamp<int64_t>(checked_mul(B, N, kOp, "elements") / (16 << 10), 1,
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
