// Refuse an output whose memory overlaps another argument of the call: a kernel that reads what it
// already wrote gives wrong results. The byte span a tensor can touch is compared, so a strided
// input is handled too (conservatively: interleaved but disjoint views count as overlapping).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "checked_math.h"
#include "native.h"

namespace latentfast {

struct ByteSpan {
  uintptr_t begin, end;  // [begin, end)
};

// A span whose size does not fit in int64 (possible only for a tensor of absurd strides) is taken
// to reach the end of the address space: it then overlaps everything after it, which is safe.
inline ByteSpan byte_span(const Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  int64_t extent = 1;  // elements from the first to one past the last reachable element
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t reach = 0;
    if (!mul_fits(t.size(d) - 1, std::llabs(t.stride(d)), &reach) || !add_fits(extent, reach, &extent)) {
      return {begin, UINTPTR_MAX};
    }
  }
  int64_t bytes = 0;
  if (!mul_fits(extent, t.itemsize(), &bytes) || static_cast<uintptr_t>(bytes) > UINTPTR_MAX - begin) {
    return {begin, UINTPTR_MAX};
  }
  return {begin, begin + static_cast<uintptr_t>(bytes)};
}

inline bool is_empty(const Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 0) return true;
  }
  return false;
}

// out_name / other_name label the two arguments in the error message.
inline void check_no_overlap(const char* op, const Tensor& out, const std::string& out_name, const Tensor& other,
                             const std::string& other_name) {
  if (is_empty(out) || is_empty(other)) return;
  const ByteSpan a = byte_span(out), b = byte_span(other);
  LF_CHECK_VALUE(a.end <= b.begin || b.end <= a.begin, op, ": ", out_name, " overlaps ", other_name,
                 " in memory; outputs must not alias any other argument");
}

}  // namespace latentfast
