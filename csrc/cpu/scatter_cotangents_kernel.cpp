// Per-branch leaf gradients grads[k] = [b_local, N_k, D_k] (any strides) -> one contiguous arena
// holding, for every (microbatch m, branch k) in microbatch-major order, the block of m's rows
// once per entry of `scales`, each times its factor:
//   arena = [ m0k0 * s0 | (m0k0 * s1) | m0k1 * s0 | ... | m1k0 * s0 | ... ]
// One parallel pass: every input element is read once per copy (from cache for the second) and
// written once per copy. The product is computed in the input's op-math type (float, or double
// for double input) and rounded once to the arena's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "scatter_cotangents_checks.h"

#include <algorithm>
#include <vector>

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

template <typename in_t, typename out_t>
void scatter_impl(const std::vector<at::Tensor>& grads, const std::vector<Chunk>& chunks, int64_t total,
                  c10::ArrayRef<double> scales, at::Tensor& arena) {
  using opmath_t = at::opmath_type<in_t>;
  out_t* out = arena.data_ptr<out_t>();
  std::vector<const in_t*> base;
  for (const auto& g : grads) base.push_back(g.const_data_ptr<in_t>());
  const std::vector<double> factors(scales.begin(), scales.end());
  // ~64K elements per thread at least: below that, waking a second thread costs more than it saves
  const int64_t chunk_count = static_cast<int64_t>(chunks.size());
  const int64_t grain = std::max<int64_t>(1, 65536 * chunk_count / std::max<int64_t>(total, 1));
  at::parallel_for(0, chunk_count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const at::Tensor& g = grads[chunk.branch];
      const int64_t D = g.size(2), s1 = g.stride(1), s2 = g.stride(2);
      const in_t* src = base[chunk.branch] + chunk.row * g.stride(0) + chunk.n_begin * s1;
      for (size_t copy = 0; copy < factors.size(); ++copy) {
        const opmath_t s = static_cast<opmath_t>(factors[copy]);
        out_t* dst = out + chunk.out_off + static_cast<int64_t>(copy) * chunk.copy_step;
        for (int64_t n = 0; n < chunk.n_end - chunk.n_begin; ++n) {
          const in_t* in = src + n * s1;
          out_t* o = dst + n * D;
          if (s2 == 1) {
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<out_t>(static_cast<opmath_t>(in[d]) * s);
          } else {
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<out_t>(static_cast<opmath_t>(in[d * s2]) * s);
          }
        }
      }
    }
  });
}

// The work list; every offset is below the arena size the checks verified, so no product overflows.
std::vector<Chunk> make_chunks(const std::vector<at::Tensor>& grads, at::IntArrayRef batch_sizes, int64_t copies) {
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

void scatter_cotangents_into_cpu(at::TensorList grads_list, at::IntArrayRef batch_sizes, c10::ArrayRef<double> scales,
                                 at::Tensor arena) {
  TORCH_CHECK_VALUE(arena.device().is_cpu(), "scatter_cotangents (cpu kernel): arena must be a CPU tensor, got ",
              arena.device());
  const std::vector<at::Tensor> grads = check_scatter_cotangents_args(grads_list, batch_sizes, scales, arena);
  if (arena.numel() == 0) return;
  const int64_t copies = static_cast<int64_t>(scales.size());
  const std::vector<Chunk> chunks = make_chunks(grads, batch_sizes, copies);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "scatter_cotangents_cpu", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, arena.scalar_type(), "scatter_cotangents_cpu_out", [&] {
      scatter_impl<in_t, scalar_t>(grads, chunks, arena.numel() / copies, scales, arena);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CPU, m) { m.impl("scatter_cotangents_into", &scatter_cotangents_into_cpu); }

}  // namespace latentfast
