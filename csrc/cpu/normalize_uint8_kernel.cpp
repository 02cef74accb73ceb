// uint8 [..., C, T, H, W] -> num_views outputs [..., C, T/num_views, H, W], value x / 127.5 - 1
// computed in float32 and rounded once to the output dtype. One parallel pass over the input
// rows: every input byte is read once and written to the view its frame belongs to. Strided
// input is read in place (no hidden contiguous copy); the inner loop over W is unit-stride and
// vectorizable whenever the input's W stride is 1.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/ATen.h>
#include <string>
#include <vector>

#include "overlap_check.h"

namespace latentfast {
namespace {

template <typename out_t>
inline void normalize_row(const uint8_t* in, int64_t in_stride, out_t* out, int64_t width) {
  if (in_stride == 1) {
    for (int64_t w = 0; w < width; ++w) {
      out[w] = static_cast<out_t>(static_cast<float>(in[w]) / 127.5f - 1.0f);
    }
  } else {
    for (int64_t w = 0; w < width; ++w) {
      out[w] = static_cast<out_t>(static_cast<float>(in[w * in_stride]) / 127.5f - 1.0f);
    }
  }
}

template <typename out_t>
void normalize_impl(const at::Tensor& x, const std::vector<at::Tensor>& out) {
  const int64_t ndim = x.dim();
  const int64_t views = static_cast<int64_t>(out.size());
  const int64_t T = x.size(ndim - 3), H = x.size(ndim - 2), W = x.size(ndim - 1);
  const int64_t F = T / views;
  const int64_t st = x.stride(ndim - 3), sh = x.stride(ndim - 2), sw = x.stride(ndim - 1);
  // lead dims = everything before T (batch dims and C), addressed with their own strides
  std::vector<int64_t> lead_sizes(x.sizes().begin(), x.sizes().end() - 3);
  std::vector<int64_t> lead_strides(x.strides().begin(), x.strides().end() - 3);
  int64_t lead_count = 1;
  for (int64_t s : lead_sizes) lead_count *= s;

  const uint8_t* base = x.data_ptr<uint8_t>();
  std::vector<out_t*> out_ptrs;
  for (const auto& o : out) out_ptrs.push_back(o.data_ptr<out_t>());

  const int64_t rows = lead_count * T * H;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(W, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    int64_t row = begin;
    while (row < end) {
      const int64_t h0 = row % H;
      const int64_t t = (row / H) % T;
      int64_t lead = row / (H * T);
      // offset of this lead index, decomposed over the (possibly non-collapsible) lead dims
      int64_t lead_offset = 0;
      for (int64_t d = static_cast<int64_t>(lead_sizes.size()) - 1; d >= 0; --d) {
        lead_offset += (lead % lead_sizes[d]) * lead_strides[d];
        lead /= lead_sizes[d];
      }
      const int64_t view = t / F, tv = t % F;
      const int64_t lead_index = row / (H * T);
      out_t* out_plane = out_ptrs[view] + ((lead_index * F + tv) * H) * W;
      const uint8_t* in_plane = base + lead_offset + t * st;
      // walk the rest of this (lead, t) plane without recomputing the decomposition
      const int64_t h_end = std::min<int64_t>(H, h0 + (end - row));
      for (int64_t h = h0; h < h_end; ++h) {
        normalize_row<out_t>(in_plane + h * sh, sw, out_plane + h * W, W);
      }
      row += h_end - h0;
    }
  });
}

void normalize_uint8_into_cpu(const at::Tensor& x, at::TensorList out_list) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kByte, "normalize_uint8: x must be uint8, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 4, "normalize_uint8: x must be [..., C, T, H, W], got ", x.dim(), "-D");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "normalize_uint8 (cpu kernel): x must be a CPU tensor");
  const int64_t views = static_cast<int64_t>(out_list.size());
  TORCH_CHECK_VALUE(views >= 1, "normalize_uint8: out must hold at least one tensor");
  const int64_t T = x.size(x.dim() - 3);
  TORCH_CHECK_VALUE(T % views == 0, "normalize_uint8: T=", T, " is not divisible by num_views=", views);
  std::vector<int64_t> view_shape(x.sizes().begin(), x.sizes().end());
  view_shape[x.dim() - 3] = T / views;
  std::vector<at::Tensor> out(out_list.begin(), out_list.end());
  const auto dtype = out[0].scalar_type();
  for (size_t v = 0; v < out.size(); ++v) {
    TORCH_CHECK_VALUE(out[v].device().is_cpu(), "normalize_uint8: out[", v, "] must be a CPU tensor");
    TORCH_CHECK_VALUE(out[v].scalar_type() == dtype, "normalize_uint8: out[", v, "] dtype ", out[v].scalar_type(),
                " differs from out[0] dtype ", dtype);
    TORCH_CHECK_VALUE(out[v].sizes().vec() == view_shape, "normalize_uint8: out[", v, "] must have shape ",
                at::IntArrayRef(view_shape), ", got ", out[v].sizes());
    TORCH_CHECK_VALUE(out[v].is_contiguous(), "normalize_uint8: out[", v, "] must be contiguous");
    const std::string name = "out[" + std::to_string(v) + "]";
    check_no_overlap("normalize_uint8", out[v], name, x, "x");
    for (size_t u = 0; u < v; ++u) check_no_overlap("normalize_uint8", out[v], name, out[u], "out[" + std::to_string(u) + "]");
  }
  if (x.numel() == 0) return;
  switch (dtype) {
    case at::kFloat: normalize_impl<float>(x, out); break;
    case at::kBFloat16: normalize_impl<at::BFloat16>(x, out); break;
    case at::kHalf: normalize_impl<at::Half>(x, out); break;
    default: TORCH_CHECK_VALUE(false, "normalize_uint8: out dtype must be float32, bfloat16 or float16, got ", dtype);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CPU, m) { m.impl("normalize_uint8_into", &normalize_uint8_into_cpu); }

}  // namespace latentfast
