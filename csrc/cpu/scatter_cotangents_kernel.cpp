// Per-branch leaf gradients grads[k] = [b_local, N_k, D_k] (any strides) -> one contiguous arena
// holding, for every (microbatch m, branch k) in microbatch-major order, the block of m's rows
// and the same block times `scale`:
//   arena = [ m0k0 local | m0k0 scaled | m0k1 local | m0k1 scaled | ... | m1k0 local | ... ]
// One parallel pass: every input element is read once and written twice, instead of the
// split -> contiguous -> mul sequence (three dispatches and two reads per block).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "scatter_cotangents_checks.h"

#include <algorithm>
#include <vector>

namespace latentfast {
namespace {

// One unit of work: tokens [n_begin, n_end) of one (branch, sample row) slab, copied to two places.
// Slabs are cut into chunks of about kChunkElements so a few large segments still spread over
// every thread, and small slabs stay whole.
struct Chunk {
  int64_t branch;
  int64_t row;         // sample index in grads[branch]
  int64_t n_begin, n_end;
  int64_t local_off;   // arena element offset of token n_begin's local copy
  int64_t scaled_off;  // arena element offset of token n_begin's scaled copy
};
constexpr int64_t kChunkElements = 16384;

template <typename scalar_t>
void scatter_impl(const std::vector<at::Tensor>& grads, const std::vector<Chunk>& chunks, int64_t total,
                  double scale, at::Tensor& arena) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t s = static_cast<opmath_t>(scale);
  scalar_t* out = arena.data_ptr<scalar_t>();
  std::vector<const scalar_t*> base;
  for (const auto& g : grads) base.push_back(g.const_data_ptr<scalar_t>());
  // ~64K elements per thread at least: below that, waking a second thread costs more than it saves
  const int64_t chunk_count = static_cast<int64_t>(chunks.size());
  const int64_t grain = std::max<int64_t>(1, 65536 * chunk_count / std::max<int64_t>(total, 1));
  at::parallel_for(0, chunk_count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& chunk = chunks[c];
      const at::Tensor& g = grads[chunk.branch];
      const int64_t D = g.size(2), s1 = g.stride(1), s2 = g.stride(2);
      const scalar_t* src = base[chunk.branch] + chunk.row * g.stride(0) + chunk.n_begin * s1;
      scalar_t* local = out + chunk.local_off;
      scalar_t* scaled = out + chunk.scaled_off;
      // both outputs are written from one read of the input
      for (int64_t n = 0; n < chunk.n_end - chunk.n_begin; ++n) {
        const scalar_t* in = src + n * s1;
        scalar_t* lo = local + n * D;
        scalar_t* sc = scaled + n * D;
        if (s2 == 1) {
          for (int64_t d = 0; d < D; ++d) {
            const scalar_t v = in[d];
            lo[d] = v;
            sc[d] = static_cast<scalar_t>(static_cast<opmath_t>(v) * s);
          }
        } else {
          for (int64_t d = 0; d < D; ++d) {
            const scalar_t v = in[d * s2];
            lo[d] = v;
            sc[d] = static_cast<scalar_t>(static_cast<opmath_t>(v) * s);
          }
        }
      }
    }
  });
}

void scatter_cotangents_into_cpu(at::TensorList grads_list, at::IntArrayRef batch_sizes, double scale,
                                 at::Tensor arena) {
  TORCH_CHECK_VALUE(arena.device().is_cpu(), "scatter_cotangents (cpu kernel): arena must be a CPU tensor, got ",
              arena.device());
  const std::vector<at::Tensor> grads = check_scatter_cotangents_args(grads_list, batch_sizes, arena);
  const auto dtype = arena.scalar_type();

  std::vector<Chunk> chunks;
  int64_t offset = 0, row0 = 0;
  for (const int64_t size : batch_sizes) {
    for (size_t k = 0; k < grads.size(); ++k) {
      const int64_t N = grads[k].size(1), D = grads[k].size(2), slab = N * D;
      const int64_t tokens_per_chunk = std::max<int64_t>(1, kChunkElements / std::max<int64_t>(D, 1));
      for (int64_t j = 0; j < size && slab > 0; ++j) {
        const int64_t local_off = offset + j * slab, scaled_off = offset + (size + j) * slab;
        for (int64_t n = 0; n < N; n += tokens_per_chunk) {
          chunks.push_back({static_cast<int64_t>(k), row0 + j, n, std::min(N, n + tokens_per_chunk),
                            local_off + n * D, scaled_off + n * D});
        }
      }
      offset += 2 * size * slab;
    }
    row0 += size;
  }
  if (offset == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "scatter_cotangents_cpu",
                                  [&] { scatter_impl<scalar_t>(grads, chunks, offset / 2, scale, arena); });
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CPU, m) { m.impl("scatter_cotangents_into", &scatter_cotangents_into_cpu); }

}  // namespace latentfast
