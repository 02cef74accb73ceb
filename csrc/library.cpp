// The native library's own entry points (its ABI version, build, CPU features, last error) and the
// shared pieces of native.h: tensor descriptors and argument reading.
#include <limits>

#include "checked_math.h"
#include "native.h"

#ifndef LATENTFAST_BUILD_INFO
#define LATENTFAST_BUILD_INFO "(unknown build)"
#endif

// Bumped whenever an entry point's arguments change: Python refuses a library of another version
// (e.g. a stale build left next to newer Python files) instead of passing it the wrong arguments.
#define LATENTFAST_ABI_VERSION 2

namespace latentfast {

namespace {
thread_local std::string last_error;
}

void set_last_error(const char* message) { last_error = message; }

const char* dtype_name(int64_t dtype) {
  switch (dtype) {
    case kByte: return "Byte";
    case kChar: return "Char";
    case kShort: return "Short";
    case kInt: return "Int";
    case kLong: return "Long";
    case kHalf: return "Half";
    case kFloat: return "Float";
    case kDouble: return "Double";
    case kBool: return "Bool";
    case kBFloat16: return "BFloat16";
    default: return "(a dtype the kernels do not take)";
  }
}

int64_t element_size(int64_t dtype) {
  switch (dtype) {
    case kByte: case kChar: case kBool: return 1;
    case kShort: case kHalf: case kBFloat16: return 2;
    case kInt: case kFloat: return 4;
    case kLong: case kDouble: return 8;
    default: return 1;
  }
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d = 0; d < ndim; ++d) n = checked_mul(n, sizes_[d], "tensor", "numel");
  return n;
}

bool Tensor::is_contiguous() const {  // torch's rule: size-1 dims have any stride
  int64_t expected = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    if (sizes_[d] == 0) return true;
    if (sizes_[d] != 1 && strides_[d] != expected) return false;
    if (!mul_fits(expected, sizes_[d], &expected)) return false;
  }
  return true;
}

static std::string join(const int64_t* values, int64_t n) {
  std::string s = "[";
  for (int64_t d = 0; d < n; ++d) s += (d ? ", " : "") + std::to_string(values[d]);
  return s + "]";
}

std::string Tensor::shape() const { return join(sizes_, ndim); }
std::string Tensor::strides() const { return join(strides_, ndim); }

int64_t ArgReader::integer() {
  LF_CHECK(i_ < n_, "latentfast native: argument list too short (a latentfast bug)");
  return args_[i_++];
}

double ArgReader::real() {
  LF_CHECK(f_ < n_fargs_, "latentfast native: float argument list too short (a latentfast bug)");
  return fargs_[f_++];
}

Tensor ArgReader::tensor() {
  static const int64_t unit_stride = 1;
  Tensor t;
  t.data = reinterpret_cast<void*>(static_cast<uintptr_t>(integer()));
  t.dtype = integer();
  t.device = integer();
  t.ndim = integer();
  if (t.ndim == kContiguousVector) {  // a contiguous 1-D tensor: its size, stride 1 implied
    LF_CHECK(i_ < n_, "latentfast native: bad tensor descriptor (a latentfast bug)");
    t.ndim = 1;
    t.sizes_ = args_ + i_++;
    t.strides_ = &unit_stride;
    return t;
  }
  LF_CHECK(t.ndim >= 0 && t.ndim <= kMaxDims && t.ndim * 2 <= n_ - i_,
           "latentfast native: bad tensor descriptor (a latentfast bug)");
  t.sizes_ = args_ + i_;
  t.strides_ = args_ + i_ + t.ndim;
  i_ += 2 * t.ndim;
  return t;
}

std::vector<Tensor> ArgReader::tensors() {
  const int64_t n = integer();
  LF_CHECK(n >= 0 && n <= n_ - i_, "latentfast native: bad tensor list (a latentfast bug)");
  std::vector<Tensor> out;
  out.reserve(n);
  for (int64_t k = 0; k < n; ++k) out.push_back(tensor());
  return out;
}

std::vector<int64_t> ArgReader::integers() {
  const int64_t n = integer();
  LF_CHECK(n >= 0 && n <= n_ - i_, "latentfast native: bad int list (a latentfast bug)");
  std::vector<int64_t> out(args_ + i_, args_ + i_ + n);
  i_ += n;
  return out;
}

std::vector<double> ArgReader::reals() {
  const int64_t n = integer();
  LF_CHECK(n >= 0 && n <= n_fargs_ - f_, "latentfast native: bad float list (a latentfast bug)");
  std::vector<double> out(fargs_ + f_, fargs_ + f_ + n);
  f_ += n;
  return out;
}

void ArgReader::finish() const {
  LF_CHECK(i_ == n_ && f_ == n_fargs_, "latentfast native: ", n_ - i_, " arguments left unread (a latentfast bug)");
}

}  // namespace latentfast

extern "C" {
__attribute__((visibility("default"))) int latentfast_abi_version() { return LATENTFAST_ABI_VERSION; }

__attribute__((visibility("default"))) const char* latentfast_build_info() { return LATENTFAST_BUILD_INFO; }

__attribute__((visibility("default"))) const char* latentfast_last_error() {
  return latentfast::last_error.c_str();
}

// The vector paths this CPU takes (each kernel chooses at run time; the build targets baseline x86-64).
__attribute__((visibility("default"))) const char* latentfast_cpu_paths() {
#if defined(__x86_64__)
  static const std::string paths = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                                           __builtin_cpu_supports("fma")
                                       ? "avx2+f16c+fma"
                                       : "scalar (no avx2/f16c/fma)";
  return paths.c_str();
#else
  return "scalar";
#endif
}
}
