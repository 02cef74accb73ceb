// Per-branch leaf gradients grads[k] = [b_local, N_k, D_k] (any strides) -> one contiguous arena
// holding, for every (microbatch m, branch k) in microbatch-major order, the block of m's rows
// once per entry of `scales`, each times its factor:
//   arena = [ m0k0 * s0 | (m0k0 * s1) | m0k1 * s0 | ... | m1k0 * s0 | ... ]
// One parallel pass: every input element is read once per copy (from cache for the second) and
// written once per copy. The product is computed in the input's op-math type (float, or double
// for double input) and rounded once to the arena's dtype (double -> float -> 16-bit, as torch does).
#include <algorithm>
#include <vector>

#include "native.h"
#include "scatter_cotangents_checks.h"
#include "thread_pool.h"

namespace latentfast {
namespace {

// One unit of work: tokens [n_begin, n_end) of one (branch, sample row) slab, written once per
// copy. Slabs are cut into chunks of about kChunkElements so a few large segments still spread
// over every thread, and small slabs stay whole.
struct Chunk {
  int64_t branch;
  int64_t row;         // sample index in grads[branch]
  int64_t n_begin, n_end;
  int64_t out_off;     // arena element offset of token n_begin in the first copy
  int64_t copy_step;   // elements between one copy of the block and the next
};
constexpr int64_t kChunkElements = 16384;

template <typename T> struct OpMath { using type = float; };
template <> struct OpMath<double> { using type = double; };

template <typename opmath_t, typename in_t> inline opmath_t load(in_t v) {
  if constexpr (std::is_same_v<in_t, double>) return v; else return static_cast<opmath_t>(to_float(v));
}
template <typename out_t, typename opmath_t> inline out_t store(opmath_t v) {
  if constexpr (std::is_same_v<out_t, double>) return static_cast<double>(v);
  else return from_float<out_t>(static_cast<float>(v));
}

template <typename in_t, typename out_t>
void scatter_impl(const std::vector<Tensor>& grads, const std::vector<Chunk>& chunks, int64_t total,
                  const std::vector<double>& factors, const Tensor& arena, int64_t max_threads) {
  using opmath_t = typename OpMath<in_t>::type;
  out_t* out = arena.ptr<out_t>();
  // threads of ~64K elements at least: below that, waking a second thread costs more than it saves
  const int64_t threads = std::clamp<int64_t>(total / 65536, 1, std::max<int64_t>(max_threads, 1));
  parallel_for(static_cast<int64_t>(chunks.size()), 1, threads, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const Tensor& g = grads[chunk.branch];
      const int64_t D = g.size(2), s1 = g.stride(1), s2 = g.stride(2);
      const in_t* src = g.ptr<const in_t>() + chunk.row * g.stride(0) + chunk.n_begin * s1;
      for (size_t copy = 0; copy < factors.size(); ++copy) {
        const opmath_t s = static_cast<opmath_t>(factors[copy]);
        out_t* dst = out + chunk.out_off + static_cast<int64_t>(copy) * chunk.copy_step;
        for (int64_t n = 0; n < chunk.n_end - chunk.n_begin; ++n) {
          const in_t* in = src + n * s1;
          out_t* o = dst + n * D;
          if (s2 == 1) {
            for (int64_t d = 0; d < D; ++d) o[d] = store<out_t>(load<opmath_t>(in[d]) * s);
          } else {
            for (int64_t d = 0; d < D; ++d) o[d] = store<out_t>(load<opmath_t>(in[d * s2]) * s);
          }
        }
      }
    }
  });
}

// The work list; every offset is below the arena size the checks verified, so no product overflows.
std::vector<Chunk> make_chunks(const std::vector<Tensor>& grads, const std::vector<int64_t>& batch_sizes,
                               int64_t copies) {
  std::vector<Chunk> chunks;
  int64_t offset = 0, row0 = 0;
  for (const int64_t size : batch_sizes) {
    for (size_t k = 0; k < grads.size(); ++k) {
      const int64_t N = grads[k].size(1), D = grads[k].size(2), slab = N * D, block = size * slab;
      const int64_t tokens_per_chunk = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(D, 1));
      for (int64_t j = 0; j < size && slab > 0; ++j) {
        for (int64_t n = 0; n < N; n += tokens_per_chunk) {
          chunks.push_back({static_cast<int64_t>(k), row0 + j, n, std::min(N, n + tokens_per_chunk),
                            offset + j * slab + n * D, block});
        }
      }
      offset += copies * block;
    }
    row0 += size;
  }
  return chunks;
}

template <typename in_t>
void dispatch_out(const std::vector<Tensor>& grads, const std::vector<Chunk>& chunks, int64_t total,
                  const std::vector<double>& scales, const Tensor& arena, int64_t threads) {
  switch (arena.dtype) {
    case kFloat: return scatter_impl<in_t, float>(grads, chunks, total, scales, arena, threads);
    case kDouble: return scatter_impl<in_t, double>(grads, chunks, total, scales, arena, threads);
    case kHalf: return scatter_impl<in_t, Half>(grads, chunks, total, scales, arena, threads);
    default: return scatter_impl<in_t, BFloat16>(grads, chunks, total, scales, arena, threads);  // checked
  }
}

void scatter_cotangents_into_cpu(const std::vector<Tensor>& grads, const std::vector<int64_t>& batch_sizes,
                                 const std::vector<double>& scales, const Tensor& arena, int64_t threads) {
  LF_CHECK_VALUE(arena.is_cpu(), "scatter_cotangents (cpu kernel): arena must be a CPU tensor, got ",
                 arena.device_name());
  check_scatter_cotangents_args(grads, batch_sizes, scales, arena);
  if (arena.numel() == 0) return;
  const int64_t copies = static_cast<int64_t>(scales.size());
  const std::vector<Chunk> chunks = make_chunks(grads, batch_sizes, copies);
  const int64_t total = arena.numel() / copies;
  switch (grads[0].dtype) {
    case kFloat: return dispatch_out<float>(grads, chunks, total, scales, arena, threads);
    case kDouble: return dispatch_out<double>(grads, chunks, total, scales, arena, threads);
    case kHalf: return dispatch_out<Half>(grads, chunks, total, scales, arena, threads);
    default: return dispatch_out<BFloat16>(grads, chunks, total, scales, arena, threads);  // checked
  }
}

}  // namespace

// args: grads (a list), batch_sizes (a list), scales (a list, in fargs), arena, threads
LATENTFAST_ENTRY(latentfast_scatter_cotangents_into) {
  const std::vector<Tensor> grads = in.tensors();
  const std::vector<int64_t> batch_sizes = in.integers();
  const std::vector<double> scales = in.reals();
  const Tensor arena = in.tensor();
  const int64_t threads = in.integer();
  in.finish();
  scatter_cotangents_into_cpu(grads, batch_sizes, scales, arena, threads);
}

}  // namespace latentfast
