// What every kernel of the native library shares: its C ABI, errors, tensor descriptors, 16-bit floats.
//
// The library links neither libtorch nor libc10 (nor libpython): one build serves every torch. Python
// (latentfast/backends/native.py) hands each kernel a flat int64 argument list -- a tensor is its
// descriptor (data pointer, dtype, device, rank, sizes, strides; or, for a contiguous 1-D tensor,
// data pointer, dtype, device, kContiguousVector, size), a scalar is one value -- and a double
// list for float arguments. The kernel checks every argument before it touches memory; a failure is a
// C++ exception caught at the C boundary (LATENTFAST_ENTRY), whose message Python reads back with
// latentfast_last_error() and raises as ValueError / IndexError / RuntimeError. ctypes releases the GIL for
// the whole call.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace latentfast {

// Error kinds, the return codes of the entry points (0 = success).
enum ErrorKind : int { kOk = 0, kValueError = 1, kIndexError = 2, kRuntimeError = 3 };

struct Error : std::runtime_error {
  Error(ErrorKind k, const std::string& message) : std::runtime_error(message), kind(k) {}
  ErrorKind kind;
};

// Messages are joined without iostreams: the library links libstdc++ statically, and a static
// libstdc++'s locale facets break (an integer ends the message) in a process where torch loaded
// another libstdc++.
inline void append(std::string& s, const char* part) { s += part; }
inline void append(std::string& s, const std::string& part) { s += part; }
template <typename T>
inline void append(std::string& s, T part) {
  static_assert(std::is_arithmetic_v<T>, "messages join strings and numbers");
  s += std::to_string(part);
}

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

// TORCH_CHECK_VALUE / TORCH_CHECK_INDEX without torch: raise ValueError / IndexError in Python.
#define LF_CHECK_VALUE(cond, ...) \
  if (!(cond)) throw ::latentfast::Error(::latentfast::kValueError, ::latentfast::cat(__VA_ARGS__))
#define LF_CHECK_INDEX(cond, ...) \
  if (!(cond)) throw ::latentfast::Error(::latentfast::kIndexError, ::latentfast::cat(__VA_ARGS__))
#define LF_CHECK(cond, ...) \
  if (!(cond)) throw ::latentfast::Error(::latentfast::kRuntimeError, ::latentfast::cat(__VA_ARGS__))

void set_last_error(const char* message);

// An exported kernel: `extern "C" int name(const int64_t* args, int64_t n_args, const double* fargs,
// int64_t n_fargs)`, body in braces; returns the ErrorKind.
#define LATENTFAST_ENTRY(name)                                                                       \
  static void name##_body(::latentfast::ArgReader& in);                                             \
  extern "C" __attribute__((visibility("default"))) int name(const int64_t* args, int64_t n_args,    \
                                                             const double* fargs, int64_t n_fargs) { \
    try {                                                                                            \
      ::latentfast::ArgReader in(args, n_args, fargs, n_fargs);                                      \
      name##_body(in);                                                                               \
      return ::latentfast::kOk;                                                                      \
    } catch (const ::latentfast::Error& e) {                                                         \
      ::latentfast::set_last_error(e.what());                                                        \
      return e.kind;                                                                                 \
    } catch (const std::exception& e) {                                                              \
      ::latentfast::set_last_error(e.what());                                                        \
      return ::latentfast::kRuntimeError;                                                            \
    }                                                                                                \
  }                                                                                                  \
  static void name##_body(::latentfast::ArgReader& in)

// torch's ScalarType numbering (Python maps torch dtypes onto it); kOtherDtype for anything else.
enum Dtype : int64_t {
  kByte = 0, kChar = 1, kShort = 2, kInt = 3, kLong = 4, kHalf = 5, kFloat = 6, kDouble = 7, kBool = 11,
  kBFloat16 = 15, kOtherDtype = 99
};
enum DeviceType : int64_t { kCPU = 0, kCUDA = 1, kOtherDevice = 2 };

const char* dtype_name(int64_t dtype);
int64_t element_size(int64_t dtype);

constexpr int64_t kMaxDims = 64;
// The rank a descriptor gives for a contiguous 1-D tensor, which it describes by its size alone (its
// stride is 1): Python then reads no shape or stride tuple, the larger part of a small call's cost.
constexpr int64_t kContiguousVector = -1;

// A tensor as Python described it. Its numel and byte extent fit in int64 (it exists), but the
// kernels still compute them with checked arithmetic where a size enters a product.
struct Tensor {
  void* data = nullptr;
  int64_t dtype = kOtherDtype, device = kOtherDevice, ndim = 0;
  const int64_t* sizes_ = nullptr;
  const int64_t* strides_ = nullptr;

  int64_t dim() const { return ndim; }
  int64_t size(int64_t d) const { return sizes_[d]; }
  int64_t stride(int64_t d) const { return strides_[d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  bool is_cpu() const { return device == kCPU; }
  int64_t itemsize() const { return element_size(dtype); }
  std::vector<int64_t> sizes() const { return {sizes_, sizes_ + ndim}; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  std::string shape() const;    // "[3, 4, 8, 8]"
  std::string strides() const;  // "[256, 64, 8, 1]"
  const char* device_name() const { return device == kCPU ? "cpu" : device == kCUDA ? "cuda" : "another device"; }
};

// Reads a kernel's arguments in order; running past the end is a bug of the Python side, refused.
class ArgReader {
 public:
  ArgReader(const int64_t* args, int64_t n, const double* fargs, int64_t n_fargs)
      : args_(args), n_(n), fargs_(fargs), n_fargs_(n_fargs) {}
  int64_t integer();
  double real();
  Tensor tensor();
  bool present() { return integer() != 0; }  // an optional argument's flag
  std::vector<Tensor> tensors();            // a count, then that many descriptors
  std::vector<int64_t> integers();          // a count, then that many values
  std::vector<double> reals();              // a count (int64 list), then that many doubles
  void finish() const;                      // every argument was read

 private:
  const int64_t* args_;
  int64_t n_, i_ = 0;
  const double* fargs_;
  int64_t n_fargs_, f_ = 0;
};

// 16-bit floats as bits, converted exactly as c10::Half / c10::BFloat16 do (round to nearest even).
struct Half {
  uint16_t x;
};
struct BFloat16 {
  uint16_t x;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(Half h) {  // FP16 library's fp16_ieee_to_fp32_value (as c10)
  const uint32_t w = static_cast<uint32_t>(h.x) << 16;
  const uint32_t sign = w & 0x80000000u, two_w = w + w;
  const float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_float(sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized)));
}

inline Half float_to_half(float f) {  // fp16_ieee_from_fp32_value (as c10): round to nearest even
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return Half{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

inline float bfloat16_to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.x) << 16); }

inline BFloat16 float_to_bfloat16(float f) {  // c10::BFloat16's round_to_nearest_even
  if (f != f) return BFloat16{0x7FC0};
  const uint32_t u = float_bits(f);
  return BFloat16{static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16)};
}

// Conversions between the element types the kernels use, through float (double stays double).
template <typename T> inline float to_float(T v) { return static_cast<float>(v); }
template <> inline float to_float(Half v) { return half_to_float(v); }
template <> inline float to_float(BFloat16 v) { return bfloat16_to_float(v); }
template <typename T> inline T from_float(float v) { return static_cast<T>(v); }
template <> inline Half from_float(float v) { return float_to_half(v); }
template <> inline BFloat16 from_float(float v) { return float_to_bfloat16(v); }

}  // namespace latentfast
