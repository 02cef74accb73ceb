// Argument checks of latentfast::scatter_cotangents_into's CPU kernel: every bound is verified here,
// with overflow-checked int64 arithmetic, before the kernel touches memory (a tensor expanded to
// 2**62 elements must not wrap a size product around to the size of a small arena). The GPU kernel
// (kernels/scatter_cotangents.py) runs after the op's Python checks, which refuse the same calls.
#pragma once

#include <string>
#include <vector>

#include "checked_math.h"
#include "native.h"
#include "overlap_check.h"

namespace latentfast {

inline bool is_scatter_dtype(int64_t t) { return t == kFloat || t == kDouble || t == kHalf || t == kBFloat16; }

inline int64_t scatter_checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  LF_CHECK_VALUE(mul_fits(a, b, &out), "scatter_cotangents: ", what, " overflows int64 (", a, " * ", b, ")");
  return out;
}

inline int64_t scatter_checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  LF_CHECK_VALUE(add_fits(a, b, &out), "scatter_cotangents: ", what, " overflows int64 (", a, " + ", b, ")");
  return out;
}

// grads: per-branch [b_local, N_k, D_k] on the arena's device, one floating dtype (float32,
// float64, float16, bfloat16); batch_sizes: positive, summing to b_local; scales: 1 or 2 factors
// (one copy of every block per factor); arena: contiguous 1-D of any of those dtypes,
// scales.size() * b_local * sum_k N_k*D_k elements, overlapping no input.
inline void check_scatter_cotangents_args(const std::vector<Tensor>& grads, const std::vector<int64_t>& batch_sizes,
                                          const std::vector<double>& scales, const Tensor& arena) {
  LF_CHECK_VALUE(!grads.empty(), "scatter_cotangents: grads must hold at least one tensor");
  LF_CHECK_VALUE(!batch_sizes.empty(), "scatter_cotangents: batch_sizes must hold at least one microbatch size");
  LF_CHECK_VALUE(scales.size() == 1 || scales.size() == 2, "scatter_cotangents: scales must hold 1 or 2 factors, got ",
                 scales.size());
  LF_CHECK_VALUE(arena.dim() == 1 && arena.is_contiguous(), "scatter_cotangents: arena must be contiguous 1-D, got shape ",
                 arena.shape(), " strides ", arena.strides());
  LF_CHECK_VALUE(is_scatter_dtype(arena.dtype),
                 "scatter_cotangents: arena dtype must be float32, float64, float16 or bfloat16, got ",
                 dtype_name(arena.dtype));
  int64_t b_local = 0;
  for (size_t m = 0; m < batch_sizes.size(); ++m) {
    LF_CHECK_VALUE(batch_sizes[m] > 0, "scatter_cotangents: batch_sizes[", m, "] must be positive, got ", batch_sizes[m]);
    b_local = scatter_checked_add(b_local, batch_sizes[m], "sum(batch_sizes)");
  }
  const int64_t dtype = grads[0].dtype;
  LF_CHECK_VALUE(is_scatter_dtype(dtype),
                 "scatter_cotangents: grads dtype must be float32, float64, float16 or bfloat16, got ", dtype_name(dtype));
  int64_t slab_sum = 0;  // sum_k N_k * D_k
  for (size_t k = 0; k < grads.size(); ++k) {
    const Tensor& g = grads[k];
    LF_CHECK_VALUE(g.device == arena.device, "scatter_cotangents: grads[", k, "] is on ", g.device_name(),
                   " but arena is on ", arena.device_name());
    LF_CHECK_VALUE(g.dim() == 3, "scatter_cotangents: grads[", k, "] must be [b_local, N, D], got shape ", g.shape());
    LF_CHECK_VALUE(g.dtype == dtype, "scatter_cotangents: grads[", k, "] dtype ", dtype_name(g.dtype),
                   " differs from grads[0] dtype ", dtype_name(dtype));
    LF_CHECK_VALUE(g.size(0) == b_local, "scatter_cotangents: grads[", k, "] has ", g.size(0),
                   " rows but batch_sizes sum to ", b_local);
    for (int64_t d = 0; d < 3; ++d) {
      LF_CHECK_VALUE(g.stride(d) >= 0, "scatter_cotangents: grads[", k, "] has a negative stride");
    }
    check_no_overlap("scatter_cotangents", arena, "arena", g, "grads[" + std::to_string(k) + "]");
    slab_sum = scatter_checked_add(slab_sum, scatter_checked_mul(g.size(1), g.size(2), "N * D"), "sum(N * D)");
  }
  const int64_t copies = static_cast<int64_t>(scales.size());
  const int64_t needed = scatter_checked_mul(copies, scatter_checked_mul(b_local, slab_sum, "b_local * sum(N * D)"),
                                             "copies * b_local * sum(N * D)");
  LF_CHECK_VALUE(arena.numel() == needed, "scatter_cotangents: arena must hold len(scales) * b_local * sum(N*D) = ",
                 needed, " elements, got ", arena.numel());
}

}  // namespace latentfast
