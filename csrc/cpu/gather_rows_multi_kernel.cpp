// Batch gather out of several flat float16 sources at once (the shards of a sharded cache):
//
//   gather_rows_multi_into -> out [B, C, h, W] (f16 / bf16 / f32), as gather_rows_into, except that
//                             row i lies in data[row_sources[i]] (row_offsets[i] counts elements of
//                             that source).
//
// A batch whose items sit in several shards is one call: the rows are resolved against their own
// source (every index, source number, width and offset checked before the first byte is copied),
// then copied by the one-source gather's padded copy (csrc/gather_rows.h), threads and all.
#include <vector>

#include "gather_rows.h"
#include "native.h"
#include "overlap_check.h"

namespace latentfast {
namespace {

void gather_rows_multi_into_cpu(const std::vector<Tensor>& data, const Tensor& row_sources, const Tensor& row_offsets,
                                const Tensor& widths, int64_t pitch, const Tensor& indices, const Tensor* white,
                                const Tensor& out, int64_t threads) {
  constexpr const char* op = "gather_rows_multi_into";
  const int64_t lines = check_padded_out(op, out, indices, white);
  const int64_t n_rows = check_row_vectors(op, row_offsets, widths, pitch, indices);
  LF_CHECK_VALUE(row_sources.is_cpu() && row_sources.dtype == kInt && row_sources.dim() == 1 &&
                  row_sources.is_contiguous() && row_sources.numel() == n_rows,
              op, ": row_sources must be a contiguous 1-D int32 CPU tensor of ", n_rows, " rows (one per row_offsets), got ",
              dtype_name(row_sources.dtype), " ", row_sources.shape());
  for (size_t s = 0; s < data.size(); ++s) {
    LF_CHECK_VALUE(data[s].is_cpu() && data[s].dtype == kHalf && data[s].dim() == 1 && data[s].is_contiguous(), op,
                ": data[", s, "] must be a contiguous 1-D float16 CPU tensor, got ", dtype_name(data[s].dtype), " ",
                data[s].shape(), " on ", data[s].device_name());
  }
  const int64_t n_sources = static_cast<int64_t>(data.size());
  const int64_t* idx = indices.ptr<int64_t>();
  const int32_t* src = row_sources.ptr<int32_t>();
  const int64_t* offs = row_offsets.ptr<int64_t>();
  const int32_t* wid = widths.ptr<int32_t>();
  std::vector<RowSpan> rows(indices.numel());
  for (int64_t b = 0; b < indices.numel(); ++b) {
    const int64_t i = idx[b];
    LF_CHECK_INDEX(i >= 0 && i < n_rows, op, ": indices[", b, "] = ", i, " is out of range for ", n_rows, " rows");
    const int64_t s = src[i];
    LF_CHECK_VALUE(s >= 0 && s < n_sources, op, ": row ", i, " names source ", s, ", outside the ", n_sources,
                " data tensors");
    rows[b] = checked_row_span(op, i, wid[i], offs[i], pitch, lines, out.size(3), data[s].ptr<Half>(), data[s].numel());
  }
  for (size_t s = 0; s < data.size(); ++s) check_no_overlap(op, out, "out", data[s], "data");
  check_no_overlap(op, out, "out", row_sources, "row_sources");
  check_no_overlap(op, out, "out", row_offsets, "row_offsets");
  check_no_overlap(op, out, "out", widths, "widths");
  check_no_overlap(op, out, "out", indices, "indices");
  if (white) check_no_overlap(op, out, "out", *white, "white");
  copy_padded_rows(op, rows, white, lines, out, threads);
}

}  // namespace

// args: data[], row_sources, row_offsets, widths, pitch, indices, white?, out, threads
LATENTFAST_ENTRY(latentfast_gather_rows_multi_into) {
  const std::vector<Tensor> data = in.tensors();
  const Tensor row_sources = in.tensor(), row_offsets = in.tensor(), widths = in.tensor();
  const int64_t pitch = in.integer();
  const Tensor indices = in.tensor();
  Tensor white;
  const bool has_white = in.present();
  if (has_white) white = in.tensor();
  const Tensor out = in.tensor();
  const int64_t threads = in.integer();
  in.finish();
  gather_rows_multi_into_cpu(data, row_sources, row_offsets, widths, pitch, indices, has_white ? &white : nullptr, out,
                             threads);
}

}  // namespace latentfast
