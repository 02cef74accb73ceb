// CUDA kernel of scatter_cotangents_into (layout: see csrc/cpu/scatter_cotangents_kernel.cpp).
// One launch covers every (microbatch, branch) segment: the host builds a small table of segment
// descriptors (source pointer and strides, block shape, arena offset, first thread block),
// copies it to the device asynchronously on the current stream, and each thread block finds its
// segment with a binary search over the table's first-block column.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "scatter_cotangents_checks.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace latentfast {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kElemsPerBlock = 4096;

// Field layout of one descriptor row (int64 each) in the segment table.
enum SegmentField : int {
  kSrc = 0,        // address of the segment's first source element
  kStride0,        // source strides (elements) over rows, tokens, channels
  kStride1,
  kStride2,
  kTokens,         // N_k
  kChannels,       // D_k
  kNumel,          // rows * N_k * D_k
  kArenaOffset,    // arena element offset of the local copy; the scaled copy follows it
  kFirstBlock,     // index of the segment's first thread block
  kNumFields
};

template <typename scalar_t>
__global__ void scatter_cotangents_kernel(const int64_t* __restrict__ table, int64_t num_segments, double scale,
                                          scalar_t* __restrict__ arena) {
  using opmath_t = at::opmath_type<scalar_t>;
  // binary search: the last segment whose first block is <= this block
  int64_t lo = 0, hi = num_segments - 1;
  const int64_t block = blockIdx.x;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (table[mid * kNumFields + kFirstBlock] <= block) lo = mid; else hi = mid - 1;
  }
  const int64_t* seg = table + lo * kNumFields;
  const scalar_t* src = reinterpret_cast<const scalar_t*>(seg[kSrc]);
  const int64_t s0 = seg[kStride0], s1 = seg[kStride1], s2 = seg[kStride2];
  const int64_t N = seg[kTokens], D = seg[kChannels], numel = seg[kNumel];
  scalar_t* local = arena + seg[kArenaOffset];
  scalar_t* scaled = local + numel;
  const opmath_t s = static_cast<opmath_t>(scale);
  const int64_t start = (block - seg[kFirstBlock]) * kElemsPerBlock;
  const int64_t stop = min(start + kElemsPerBlock, numel);
  for (int64_t e = start + threadIdx.x; e < stop; e += blockDim.x) {
    const int64_t d = e % D;
    const int64_t n = (e / D) % N;
    const int64_t i = e / (D * N);
    const scalar_t v = src[i * s0 + n * s1 + d * s2];
    local[e] = v;
    scaled[e] = static_cast<scalar_t>(static_cast<opmath_t>(v) * s);
  }
}

void scatter_cotangents_into_cuda(at::TensorList grads_list, at::IntArrayRef batch_sizes, double scale,
                                  at::Tensor arena) {
  TORCH_CHECK_VALUE(arena.is_cuda(), "scatter_cotangents (cuda kernel): arena must be a CUDA tensor, got ", arena.device());
  const std::vector<at::Tensor> grads = check_scatter_cotangents_args(grads_list, batch_sizes, arena);
  const auto dtype = arena.scalar_type();

  const int64_t element_size = static_cast<int64_t>(arena.element_size());
  std::vector<int64_t> rows;  // descriptor rows, kNumFields each
  int64_t offset = 0, row0 = 0, blocks = 0, segments = 0;
  for (const int64_t size : batch_sizes) {
    for (const auto& g : grads) {
      const int64_t numel = size * g.size(1) * g.size(2);
      if (numel > 0) {
        const auto src = reinterpret_cast<int64_t>(static_cast<const char*>(g.const_data_ptr()) +
                                                   row0 * g.stride(0) * element_size);
        const int64_t seg_blocks = (numel + kElemsPerBlock - 1) / kElemsPerBlock;
        rows.insert(rows.end(), {src, g.stride(0), g.stride(1), g.stride(2), g.size(1), g.size(2), numel, offset,
                                 blocks});
        blocks += seg_blocks;
        ++segments;
      }
      offset += 2 * numel;
    }
    row0 += size;
  }
  if (segments == 0) return;
  TORCH_CHECK_VALUE(blocks <= std::numeric_limits<int32_t>::max(), "scatter_cotangents: too many elements for one launch");

  const c10::cuda::CUDAGuard guard(arena.device());
  // pinned host table -> device copy on the current stream; the caching host allocator keeps the
  // pinned buffer alive until that copy has completed.
  at::Tensor host_table = at::empty({static_cast<int64_t>(rows.size())},
                                    at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(rows.begin(), rows.end(), host_table.data_ptr<int64_t>());
  at::Tensor table = host_table.to(arena.device(), /*non_blocking=*/true);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "scatter_cotangents_cuda", [&] {
    scatter_cotangents_kernel<scalar_t><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
        table.const_data_ptr<int64_t>(), segments, scale, arena.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CUDA, m) { m.impl("scatter_cotangents_into", &scatter_cotangents_into_cuda); }

}  // namespace latentfast
