// Size arithmetic that cannot wrap. Every product or sum of caller-controlled sizes (a pitch, a
// channel count, a width) in the kernels' argument checks goes through these: int64 overflow is
// undefined behaviour, and a wrapped size turns a bounds check into an out-of-bounds access.
#pragma once

#include "native.h"

#include <cstdint>

namespace latentfast {

// a * b, or false when it does not fit in int64.
inline bool mul_fits(int64_t a, int64_t b, int64_t* result) { return !__builtin_mul_overflow(a, b, result); }

// a + b, or false when it does not fit in int64.
inline bool add_fits(int64_t a, int64_t b, int64_t* result) { return !__builtin_add_overflow(a, b, result); }

// a * b; raises ValueError naming `what` when it does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t result = 0;
  LF_CHECK_VALUE(mul_fits(a, b, &result), op, ": ", what, " = ", a, " * ", b, " does not fit in int64");
  return result;
}

// a + b; raises ValueError naming `what` when it does not fit in int64.
inline int64_t checked_add(int64_t a, int64_t b, const char* op, const char* what) {
  int64_t result = 0;
  LF_CHECK_VALUE(add_fits(a, b, &result), op, ": ", what, " = ", a, " + ", b, " does not fit in int64");
  return result;
}

}  // namespace latentfast
