// What the one-source gather (csrc/cpu/gather_rows_kernel.cpp) and the several-source gather of a
// sharded cache (csrc/cpu/gather_rows_multi_kernel.cpp) share: a requested row resolved and
// bounds-checked, the checks of the padded output, and the padded copy itself.
#pragma once

#include <cstdint>
#include <vector>

#include "native.h"

namespace latentfast {

// One requested row, resolved and bounds-checked.
struct RowSpan {
  const Half* src;     // start of line (0, 0)
  int64_t width;       // real columns
  int64_t line_pitch;  // elements between consecutive lines
};

// Checks that row_offsets (int64), widths (int32) and indices (int64) are contiguous 1-D CPU vectors
// of agreeing lengths and pitch >= 0; returns the row count.
int64_t check_row_vectors(const char* op, const Tensor& row_offsets, const Tensor& widths, int64_t pitch,
                          const Tensor& indices);

// Row i of width w at element `start` of a source of `data_len` float16 elements at `base`, after
// checking it lies inside that source (lines_per_row lines, pitch 0 = ragged) and w <= max_width.
RowSpan checked_row_span(const char* op, int64_t i, int64_t w, int64_t start, int64_t pitch, int64_t lines_per_row,
                         int64_t max_width, const Half* base, int64_t data_len);

// Checks a padded output [B, C, h, W] against indices and the white column; returns C * h.
int64_t check_padded_out(const char* op, const Tensor& out, const Tensor& indices, const Tensor* white);

// out[b] = rows[b]'s real columns, then the white column up to W (every row checked already).
void copy_padded_rows(const char* op, const std::vector<RowSpan>& rows, const Tensor* white, int64_t lines,
                      const Tensor& out, int64_t threads);

}  // namespace latentfast
