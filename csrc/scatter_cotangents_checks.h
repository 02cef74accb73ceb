// Argument checks shared by the CPU and CUDA kernels of latentfast::scatter_cotangents_into:
// every bound is verified here before either kernel touches memory.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "overlap_check.h"

namespace latentfast {

// grads: per-branch [b_local, N_k, D_k] on the arena's device, of the arena's dtype;
// batch_sizes: positive, summing to b_local; arena: contiguous 1-D, 2 * b_local * sum_k N_k*D_k
// elements, overlapping no input. Returns the grads as a vector.
inline std::vector<at::Tensor> check_scatter_cotangents_args(at::TensorList grads_list, at::IntArrayRef batch_sizes,
                                                             const at::Tensor& arena) {
  TORCH_CHECK_VALUE(!grads_list.empty(), "scatter_cotangents: grads must hold at least one tensor");
  TORCH_CHECK_VALUE(!batch_sizes.empty(), "scatter_cotangents: batch_sizes must hold at least one microbatch size");
  TORCH_CHECK_VALUE(arena.dim() == 1 && arena.is_contiguous(), "scatter_cotangents: arena must be contiguous 1-D, got shape ",
              arena.sizes(), " strides ", arena.strides());
  const auto dtype = arena.scalar_type();
  TORCH_CHECK_VALUE(at::isFloatingType(dtype), "scatter_cotangents: arena must be floating point, got ", dtype);
  int64_t b_local = 0;
  for (size_t m = 0; m < batch_sizes.size(); ++m) {
    TORCH_CHECK_VALUE(batch_sizes[m] > 0, "scatter_cotangents: batch_sizes[", m, "] must be positive, got ", batch_sizes[m]);
    b_local += batch_sizes[m];
  }
  std::vector<at::Tensor> grads(grads_list.begin(), grads_list.end());
  int64_t slab_sum = 0;  // sum_k N_k * D_k
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    TORCH_CHECK_VALUE(g.device() == arena.device(), "scatter_cotangents: grads[", k, "] is on ", g.device(),
                " but arena is on ", arena.device());
    TORCH_CHECK_VALUE(g.dim() == 3, "scatter_cotangents: grads[", k, "] must be [b_local, N, D], got shape ", g.sizes());
    TORCH_CHECK_VALUE(g.scalar_type() == dtype, "scatter_cotangents: grads[", k, "] dtype ", g.scalar_type(),
                " differs from arena dtype ", dtype);
    TORCH_CHECK_VALUE(g.size(0) == b_local, "scatter_cotangents: grads[", k, "] has ", g.size(0),
                " rows but batch_sizes sum to ", b_local);
    for (int64_t d = 0; d < 3; ++d) {
      TORCH_CHECK_VALUE(g.stride(d) >= 0, "scatter_cotangents: grads[", k, "] has a negative stride");
    }
    check_no_overlap("scatter_cotangents", arena, "arena", g, "grads[" + std::to_string(k) + "]");
    slab_sum += g.size(1) * g.size(2);
  }
  TORCH_CHECK_VALUE(arena.numel() == 2 * b_local * slab_sum, "scatter_cotangents: arena must hold 2 * b_local * sum(N*D) = ",
              2 * b_local * slab_sum, " elements, got ", arena.numel());
  return grads;
}

}  // namespace latentfast
