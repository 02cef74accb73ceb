// CUDA kernel of scatter_cotangents_into (layout: see csrc/cpu/scatter_cotangents_kernel.cpp).
// One launch covers every (microbatch, branch) segment: the host builds a small table of segment
// descriptors (source pointer and strides, block shape, arena offset, first tile), copies it to
// the device asynchronously on the current stream, and the blocks walk the tiles of 4096
// elements with a grid-stride loop over a capped grid (torchvision's CUDA_1D_KERNEL_LOOP, one
// tile per step), finding each tile's segment with a binary search over the first-tile column.
// Index math is 32-bit whenever every segment's element count and source extent fit (a 64-bit
// division costs several times a 32-bit one), and contiguous segments skip the divisions.
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
constexpr int64_t kTileElements = 4096;
constexpr int64_t kMaxBlocks = 4096;  // the grid cap; the grid-stride loop covers the rest

// Field layout of one descriptor row (int64 each) in the segment table.
enum SegmentField : int {
  kSrc = 0,        // address of the segment's first source element
  kStride0,        // source strides (elements) over rows, tokens, channels
  kStride1,
  kStride2,
  kTokens,         // N_k
  kChannels,       // D_k
  kNumel,          // rows * N_k * D_k: one copy of the block
  kArenaOffset,    // arena element offset of the first copy; the next copy follows it
  kFirstTile,      // index of the segment's first tile
  kContiguous,     // 1 when the source block is contiguous (element e is src[e])
  kNumFields
};

struct Factors {
  double value[2];
  int copies;
};

template <typename in_t, typename out_t, typename index_t>
__global__ void scatter_cotangents_kernel(const int64_t* __restrict__ table, int64_t num_segments, int64_t num_tiles,
                                          Factors factors, out_t* __restrict__ arena) {
  using opmath_t = at::opmath_type<in_t>;
  const opmath_t s0 = static_cast<opmath_t>(factors.value[0]);
  const opmath_t s1 = static_cast<opmath_t>(factors.value[1]);
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    // binary search: the last segment whose first tile is <= this tile
    int64_t lo = 0, hi = num_segments - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (table[mid * kNumFields + kFirstTile] <= tile) lo = mid; else hi = mid - 1;
    }
    const int64_t* seg = table + lo * kNumFields;
    const in_t* src = reinterpret_cast<const in_t*>(seg[kSrc]);
    const index_t stride0 = static_cast<index_t>(seg[kStride0]), stride1 = static_cast<index_t>(seg[kStride1]);
    const index_t stride2 = static_cast<index_t>(seg[kStride2]);
    const index_t N = static_cast<index_t>(seg[kTokens]), D = static_cast<index_t>(seg[kChannels]);
    const int64_t numel = seg[kNumel];
    const bool contiguous = seg[kContiguous] != 0;
    out_t* first = arena + seg[kArenaOffset];
    out_t* second = first + numel;
    const index_t start = static_cast<index_t>((tile - seg[kFirstTile]) * kTileElements);
    const index_t stop = static_cast<index_t>(min(static_cast<int64_t>(start) + kTileElements, numel));
    for (index_t e = start + static_cast<index_t>(threadIdx.x); e < stop; e += static_cast<index_t>(blockDim.x)) {
      index_t offset = e;
      if (!contiguous) {
        const index_t d = e % D, rest = e / D;
        offset = (rest / N) * stride0 + (rest % N) * stride1 + d * stride2;
      }
      const opmath_t v = static_cast<opmath_t>(src[offset]);
      first[e] = static_cast<out_t>(v * s0);
      if (factors.copies == 2) second[e] = static_cast<out_t>(v * s1);
    }
  }
}

struct SegmentTable {
  std::vector<int64_t> rows;  // kNumFields per segment
  int64_t segments = 0, tiles = 0;
  bool fits_int32 = true;     // every element index and source offset fits in int32
};

SegmentTable make_table(const std::vector<at::Tensor>& grads, at::IntArrayRef batch_sizes, int64_t copies,
                        int64_t element_size) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  SegmentTable t;
  int64_t offset = 0, row0 = 0;
  for (const int64_t size : batch_sizes) {
    for (const auto& g : grads) {
      const int64_t numel = size * g.size(1) * g.size(2);  // below the checked arena size
      if (numel > 0) {
        const auto src = reinterpret_cast<int64_t>(static_cast<const char*>(g.const_data_ptr()) +
                                                   row0 * g.stride(0) * element_size);
        const bool contiguous = g.is_contiguous();  // then element e of the block is src[e]
        // largest source offset of the block; the tensor is valid, so this fits in int64
        const int64_t extent = (size - 1) * g.stride(0) + (g.size(1) - 1) * g.stride(1) + (g.size(2) - 1) * g.stride(2);
        t.fits_int32 = t.fits_int32 && numel + kTileElements <= kInt32Max && extent <= kInt32Max;
        t.rows.insert(t.rows.end(), {src, g.stride(0), g.stride(1), g.stride(2), g.size(1), g.size(2), numel, offset,
                                     t.tiles, contiguous ? 1 : 0});
        t.tiles += (numel + kTileElements - 1) / kTileElements;
        ++t.segments;
      }
      offset += copies * numel;
    }
    row0 += size;
  }
  return t;
}

template <typename in_t, typename out_t>
void launch(const at::Tensor& table, const SegmentTable& t, const Factors& factors, at::Tensor& arena) {
  const auto blocks = static_cast<unsigned int>(std::min<int64_t>(t.tiles, kMaxBlocks));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (t.fits_int32) {
    scatter_cotangents_kernel<in_t, out_t, int32_t><<<blocks, kThreads, 0, stream>>>(
        table.const_data_ptr<int64_t>(), t.segments, t.tiles, factors, arena.data_ptr<out_t>());
  } else {
    scatter_cotangents_kernel<in_t, out_t, int64_t><<<blocks, kThreads, 0, stream>>>(
        table.const_data_ptr<int64_t>(), t.segments, t.tiles, factors, arena.data_ptr<out_t>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scatter_cotangents_into_cuda(at::TensorList grads_list, at::IntArrayRef batch_sizes, c10::ArrayRef<double> scales,
                                  at::Tensor arena) {
  TORCH_CHECK_VALUE(arena.is_cuda(), "scatter_cotangents (cuda kernel): arena must be a CUDA tensor, got ", arena.device());
  const std::vector<at::Tensor> grads = check_scatter_cotangents_args(grads_list, batch_sizes, scales, arena);
  const int64_t copies = static_cast<int64_t>(scales.size());
  const SegmentTable t = make_table(grads, batch_sizes, copies, grads[0].element_size());
  if (t.segments == 0) return;
  const Factors factors{{scales[0], copies == 2 ? scales[1] : 0.0}, static_cast<int>(copies)};

  const c10::cuda::CUDAGuard guard(arena.device());
  // pinned host table -> device copy on the current stream; the caching host allocator keeps the
  // pinned buffer alive until that copy has completed.
  at::Tensor host_table = at::empty({static_cast<int64_t>(t.rows.size())},
                                    at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(t.rows.begin(), t.rows.end(), host_table.data_ptr<int64_t>());
  at::Tensor table = host_table.to(arena.device(), /*non_blocking=*/true);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[0].scalar_type(), "scatter_cotangents_cuda", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, arena.scalar_type(), "scatter_cotangents_cuda_out",
                                    [&] { launch<in_t, scalar_t>(table, t, factors, arena); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CUDA, m) { m.impl("scatter_cotangents_into", &scatter_cotangents_into_cuda); }

}  // namespace latentfast
