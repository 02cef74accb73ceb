// uint8 [..., C, T, H, W] -> num_views outputs [..., C, T/num_views, H, W], value x / 127.5 - 1
// computed in float32 and rounded once (to nearest even) to the output dtype.
//
// One parallel pass over the input: every input byte is read once and written to the view its
// frame belongs to. Strided input is read in place (no hidden contiguous copy). The pass is bound
// by memory traffic (1 byte read + 2 or 4 bytes written per element), so:
//   - the work is a list of runs, each contiguous in the input and in its output: a whole (lead, t)
//     plane when the input's H*W plane is contiguous, else one row; the split between threads is
//     by input rows, and the index math is done once per run, never per element;
//   - a run is converted 8 elements at a time with AVX2 + FMA (uint8 -> int32 -> float32, a
//     division-free quotient that is bit-identical to the scalar formula, see normalize8) and rounded
//     to bfloat16 / float16 in registers (F16C for float16), chosen at run time like
//     gather_rows_kernel.cpp does; other CPUs run the scalar loop;
//   - outputs too large to stay in the caches are written with non-temporal stores, which skip the
//     read-for-ownership of every written cache line (4 of the 9 bytes a float32 element would
//     otherwise move).
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "checked_math.h"
#include "native.h"
#include "overlap_check.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace latentfast {
namespace {

// Outputs at least this large are streamed past the caches (see the top of this file); smaller ones
// are left in the caches for the consumer that reads them next.
constexpr int64_t kStreamBytes = 8 << 20;

template <typename out_t>
inline out_t normalize_one(uint8_t v) {
  return from_float<out_t>(static_cast<float>(v) / 127.5f - 1.0f);
}

template <typename out_t>
void normalize_scalar(const uint8_t* in, int64_t in_stride, out_t* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = normalize_one<out_t>(in[k * in_stride]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LATENTFAST_AVX2 1

bool cpu_has_avx2_fma_f16c() {
  static const bool has =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
}

// 8 uint8 -> 8 float32 values of x / 127.5 - 1, bit-identical to the scalar formula. The quotient is
// not a division (a divider-bound loop: 8 lanes per ~5 cycles) but q0 = x * RN(1/127.5) corrected once
// by its exact remainder: r = x - q0 * 127.5 (one fma, exact), q = q0 + r * RN(1/127.5). For the 256
// possible inputs this equals the correctly rounded x / 127.5 (checked in exact arithmetic and by the
// tests, which compare every uint8 value bit for bit).
__attribute__((target("avx2,fma"))) inline __m256 normalize8(const uint8_t* in) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in));
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 inverse = _mm256_set1_ps(1.0f / 127.5f);
  const __m256 q0 = _mm256_mul_ps(v, inverse);
  const __m256 remainder = _mm256_fnmadd_ps(q0, _mm256_set1_ps(127.5f), v);
  return _mm256_sub_ps(_mm256_fmadd_ps(remainder, inverse, q0), _mm256_set1_ps(1.0f));
}

// float32 -> bfloat16 bits, rounded to nearest even like c10::BFloat16, in the low half of each
// 32-bit lane (the values here are finite, so the NaN case of c10's rounding never arises).
__attribute__((target("avx2"))) inline __m256i bfloat16_bits(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
}

// 32 bytes of output (8 floats or 16 halves) computed from the input at `in`.
template <typename out_t>
__attribute__((target("avx2,fma,f16c"))) inline __m256i normalize_block(const uint8_t* in) {
  if constexpr (std::is_same_v<out_t, float>) {
    return _mm256_castps_si256(normalize8(in));
  } else if constexpr (std::is_same_v<out_t, Half>) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m128i lo = _mm256_cvtps_ph(normalize8(in), kRound);
    const __m128i hi = _mm256_cvtps_ph(normalize8(in + 8), kRound);
    return _mm256_set_m128i(hi, lo);
  } else {
    // packus works per 128-bit lane; the permute puts the 16 results back in order
    const __m256i packed = _mm256_packus_epi32(bfloat16_bits(normalize8(in)), bfloat16_bits(normalize8(in + 8)));
    return _mm256_permute4x64_epi64(packed, 0xD8);
  }
}

// One unit-stride run of n elements. The scalar head brings out to a 32-byte boundary, which the
// non-temporal store needs (and which keeps the plain stores from straddling cache lines).
template <typename out_t>
__attribute__((target("avx2,fma,f16c"))) void normalize_run_avx2(const uint8_t* in, out_t* out, int64_t n,
                                                             bool stream) {
  constexpr int64_t V = 32 / sizeof(out_t);  // elements per 32-byte store
  const auto misalign = reinterpret_cast<uintptr_t>(out) % 32;
  int64_t k = std::min<int64_t>(n, misalign == 0 ? 0 : (32 - misalign) / sizeof(out_t));
  normalize_scalar<out_t>(in, 1, out, k);
  if (stream) {
    for (; k + V <= n; k += V) _mm256_stream_si256(reinterpret_cast<__m256i*>(out + k), normalize_block<out_t>(in + k));
  } else {
    for (; k + V <= n; k += V) _mm256_store_si256(reinterpret_cast<__m256i*>(out + k), normalize_block<out_t>(in + k));
  }
  normalize_scalar<out_t>(in + k, 1, out + k, n - k);
}
#endif

template <typename out_t>
inline void normalize_run(const uint8_t* in, int64_t in_stride, out_t* out, int64_t n, bool stream) {
#ifdef LATENTFAST_AVX2
  // an element's alignment is all an out_t* promises: a 2-byte-misaligned float pointer cannot be
  // brought to a 32-byte boundary, so it takes the scalar loop
  if (in_stride == 1 && reinterpret_cast<uintptr_t>(out) % sizeof(out_t) == 0 && cpu_has_avx2_fma_f16c()) {
    return normalize_run_avx2<out_t>(in, out, n, stream);
  }
#endif
  normalize_scalar<out_t>(in, in_stride, out, n);
}

// Where things are: the input's lead dims (everything before T, addressed with their own strides,
// since they need not collapse) and the T, H, W strides; the outputs' shape.
struct Geometry {
  std::vector<int64_t> lead_sizes, lead_strides;
  int64_t T, H, W, F, st, sh, sw;
  bool plane_contiguous;  // a (lead, t) plane of the input is H*W consecutive bytes

  // byte offset in the input of lead index `lead` (row-major over the lead dims)
  int64_t lead_offset(int64_t lead) const {
    int64_t offset = 0;
    for (int64_t d = static_cast<int64_t>(lead_sizes.size()) - 1; d >= 0; --d) {
      offset += (lead % lead_sizes[d]) * lead_strides[d];
      lead /= lead_sizes[d];
    }
    return offset;
  }
};

// Input rows [begin, end) (a row = one (lead, t, h)) into their views.
template <typename out_t>
void normalize_rows(const Geometry& g, const uint8_t* base, const std::vector<out_t*>& out_ptrs, int64_t begin,
                    int64_t end, bool stream) {
  const int64_t H = g.H, W = g.W;
  int64_t row = begin;
  while (row < end) {  // one (lead, t) plane, or the part of it inside [begin, end), per iteration
    const int64_t plane = row / H, h0 = row % H;
    const int64_t lead = plane / g.T, t = plane % g.T;
    const int64_t h_end = std::min<int64_t>(H, h0 + (end - row));
    const uint8_t* in = base + g.lead_offset(lead) + t * g.st + h0 * g.sh;
    out_t* out = out_ptrs[t / g.F] + ((lead * g.F + t % g.F) * H + h0) * W;
    if (g.plane_contiguous) {
      normalize_run<out_t>(in, 1, out, (h_end - h0) * W, stream);
    } else {
      for (int64_t h = h0; h < h_end; ++h, in += g.sh, out += W) normalize_run<out_t>(in, g.sw, out, W, stream);
    }
    row += h_end - h0;
  }
#ifdef LATENTFAST_AVX2
  if (stream) _mm_sfence();  // this thread's streamed stores are visible before the op returns
#endif
}

template <typename out_t>
void normalize_impl(const Tensor& x, const std::vector<Tensor>& out, int64_t max_threads) {
  constexpr const char* op = "normalize_uint8";
  const int64_t ndim = x.dim();
  Geometry g;
  g.lead_sizes.assign(x.sizes_, x.sizes_ + ndim - 3);
  g.lead_strides.assign(x.strides_, x.strides_ + ndim - 3);
  g.T = x.size(ndim - 3), g.H = x.size(ndim - 2), g.W = x.size(ndim - 1);
  g.F = g.T / static_cast<int64_t>(out.size());
  g.st = x.stride(ndim - 3), g.sh = x.stride(ndim - 2), g.sw = x.stride(ndim - 1);
  g.plane_contiguous = g.sw == 1 && (g.H == 1 || g.sh == g.W);

  // every output exists, so these products are bounded by memory; checked all the same
  int64_t rows = 1;
  for (int64_t s : g.lead_sizes) rows = checked_mul(rows, s, op, "the lead dims' product");
  rows = checked_mul(checked_mul(rows, g.T, op, "lead * T"), g.H, op, "lead * T * H");
  const int64_t out_bytes = checked_mul(checked_mul(rows, g.W, op, "elements"), sizeof(out_t), op, "bytes");
  const bool stream = out_bytes >= kStreamBytes;

  const uint8_t* base = x.ptr<uint8_t>();
  std::vector<out_t*> out_ptrs;
  for (const auto& o : out) out_ptrs.push_back(o.ptr<out_t>());
  // threads of >= 64K elements each (waking a pool thread costs about what converting 16K elements
  // does), handed out in chunks of ~16K elements
  const int64_t elements = out_bytes / static_cast<int64_t>(sizeof(out_t));
  const int64_t threads = std::clamp<int64_t>(elements / (64 << 10), 1, std::max<int64_t>(max_threads, 1));
  const int64_t grain = std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(g.W, 1));
  parallel_for(rows, grain, threads, [&](int64_t begin, int64_t end) {
    normalize_rows<out_t>(g, base, out_ptrs, begin, end, stream);
  });
}

void normalize_uint8_into_cpu(const Tensor& x, const std::vector<Tensor>& out, int64_t threads) {
  LF_CHECK_VALUE(x.dtype == kByte, "normalize_uint8: x must be uint8, got ", dtype_name(x.dtype));
  LF_CHECK_VALUE(x.dim() >= 4, "normalize_uint8: x must be [..., C, T, H, W], got ", x.dim(), "-D");
  LF_CHECK_VALUE(x.is_cpu(), "normalize_uint8 (cpu kernel): x must be a CPU tensor, got ", x.device_name());
  const int64_t views = static_cast<int64_t>(out.size());
  LF_CHECK_VALUE(views >= 1, "normalize_uint8: out must hold at least one tensor");
  const int64_t T = x.size(x.dim() - 3);
  LF_CHECK_VALUE(T % views == 0, "normalize_uint8: T=", T, " is not divisible by num_views=", views);
  std::vector<int64_t> view_shape = x.sizes();
  view_shape[x.dim() - 3] = T / views;
  const int64_t dtype = out[0].dtype;
  for (size_t v = 0; v < out.size(); ++v) {
    LF_CHECK_VALUE(out[v].is_cpu(), "normalize_uint8: out[", v, "] must be a CPU tensor, got ",
                      out[v].device_name());
    LF_CHECK_VALUE(out[v].dtype == dtype, "normalize_uint8: out[", v, "] dtype ", dtype_name(out[v].dtype),
                      " differs from out[0] dtype ", dtype_name(dtype));
    LF_CHECK_VALUE(out[v].sizes() == view_shape, "normalize_uint8: out[", v, "] must have shape ",
                      Tensor{nullptr, kByte, kCPU, x.ndim, view_shape.data(), view_shape.data()}.shape(), ", got ",
                      out[v].shape());
    LF_CHECK_VALUE(out[v].is_contiguous(), "normalize_uint8: out[", v, "] must be contiguous");
    const std::string name = "out[" + std::to_string(v) + "]";
    check_no_overlap("normalize_uint8", out[v], name, x, "x");
    for (size_t u = 0; u < v; ++u) check_no_overlap("normalize_uint8", out[v], name, out[u], "out[" + std::to_string(u) + "]");
  }
  if (x.numel() == 0) return;
  switch (dtype) {
    case kFloat: normalize_impl<float>(x, out, threads); break;
    case kBFloat16: normalize_impl<BFloat16>(x, out, threads); break;
    case kHalf: normalize_impl<Half>(x, out, threads); break;
    default: LF_CHECK_VALUE(false, "normalize_uint8: out dtype must be float32, bfloat16 or float16, got ", dtype_name(dtype));
  }
}

}  // namespace

// args: x, out (a list), threads
LATENTFAST_ENTRY(latentfast_normalize_uint8_into) {
  const Tensor x = in.tensor();
  const std::vector<Tensor> out = in.tensors();
  const int64_t threads = in.integer();
  in.finish();
  normalize_uint8_into_cpu(x, out, threads);
}

}  // namespace latentfast
