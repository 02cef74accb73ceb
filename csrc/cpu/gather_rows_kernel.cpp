// Batch gather out of a latent cache's flat float16 data (a memmap), in two forms:
//
//   gather_rows_into        -> out [B, C, h, W] (f16 / bf16 / f32): each requested row's real
//                              columns, then the white column repeated up to W (the CPU path).
//   gather_rows_packed_into -> out 1-D f16: the requested rows' real columns only, back to back as
//                              [C, h, w_i] each (the GPU path stages this in pinned memory and
//                              expands it on the device).
//
// Row i's line (c, y) starts at row_offsets[i] + (c*h + y) * pitch, pitch = w_max for the padded
// layout, or pitch = 0 meaning "w_i" for the ragged layout (rows stored [C, h, w_i] contiguously).
// Every index, width and offset is checked against the data before the first byte is copied, so a
// bad request raises instead of reading outside the memmap. The copy itself runs with the GIL
// released (other Python threads, e.g. a training loop, keep running) on the native pool's threads.
// Batches of line caches are small (64 rows of a few KiB are ~0.5 MiB), so fixed costs matter: a
// row's lines are copied by inlined vector moves rather than a memcpy call per line, and a batch is
// split between threads only when each gets at least kMinThreadBytes, and only while threads have
// measured faster than the caller alone (ThreadChoice). Batches of records' fields are large (a padded
// text field of 64 items is ~256 MiB): those are written with streaming stores (stream_halves_avx2)
// where their pages are already in memory (a reused buffer: stream_into).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "checked_math.h"
#include "gather_rows.h"
#include "native.h"
#include "overlap_check.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace latentfast {
namespace {

void check_no_overlap_with_sources(const char* op, const Tensor& out, const Tensor& data,
                                   const Tensor& row_offsets, const Tensor& widths, const Tensor& indices) {
  check_no_overlap(op, out, "out", data, "data");
  check_no_overlap(op, out, "out", row_offsets, "row_offsets");
  check_no_overlap(op, out, "out", widths, "widths");
  check_no_overlap(op, out, "out", indices, "indices");
}

std::vector<RowSpan> resolve_rows(const char* op, const Tensor& data, const Tensor& row_offsets,
                                  const Tensor& widths, int64_t pitch, const Tensor& indices,
                                  int64_t lines_per_row, int64_t max_width) {
  LF_CHECK_VALUE(data.is_cpu(), op, ": data, row_offsets, widths and indices must be CPU tensors");
  LF_CHECK_VALUE(data.dtype == kHalf && data.dim() == 1 && data.is_contiguous(), op,
              ": data must be a contiguous 1-D float16 tensor, got ", dtype_name(data.dtype), " ", data.shape());
  const int64_t n_rows = check_row_vectors(op, row_offsets, widths, pitch, indices);
  const int64_t* idx = indices.ptr<int64_t>();
  const int64_t* offs = row_offsets.ptr<int64_t>();
  const int32_t* wid = widths.ptr<int32_t>();
  std::vector<RowSpan> rows(indices.numel());
  for (int64_t b = 0; b < indices.numel(); ++b) {
    const int64_t i = idx[b];
    LF_CHECK_INDEX(i >= 0 && i < n_rows, op, ": indices[", b, "] = ", i, " is out of range for ", n_rows,
                      " rows");
    rows[b] = checked_row_span(op, i, wid[i], offs[i], pitch, lines_per_row, max_width, data.ptr<Half>(), data.numel());
  }
  return rows;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LATENTFAST_F16C 1
// The extension is built for baseline x86-64, where a float16 -> float conversion is a scalar bit
// shuffle (~4x slower than the copy). These two use the F16C/AVX2 instructions, chosen at run time.
__attribute__((target("avx2,f16c"))) void half_to_float_f16c(const Half* src, float* dst, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m128i half8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(half8));
  }
  for (; k < n; ++k) dst[k] = half_to_float(src[k]);
}

// 8 float16 -> float32 (exact) -> bfloat16 bits rounded to nearest even, as c10::BFloat16 does; NaN
// stays NaN. Results in the low 16 bits of each 32-bit lane.
__attribute__((target("avx2,f16c"))) inline __m256i half8_to_bfloat16_bits(const Half* from) {
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
}

__attribute__((target("avx2,f16c"))) void half_to_bfloat16_f16c(const Half* src, BFloat16* dst,
                                                                 int64_t n) {
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    // packus works per 128-bit lane; the permute puts the 16 results back in order
    const __m256i packed = _mm256_packus_epi32(half8_to_bfloat16_bits(src + k), half8_to_bfloat16_bits(src + k + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; k < n; ++k) dst[k] = float_to_bfloat16(half_to_float(src[k]));
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

template <typename out_t>
inline void copy_line(const Half* src, out_t* dst, int64_t n) {
  if constexpr (std::is_same_v<out_t, Half>) {
    std::memcpy(dst, src, n * sizeof(Half));
    return;
  }
#ifdef LATENTFAST_F16C
  if (cpu_has_f16c()) {
    if constexpr (std::is_same_v<out_t, float>) return half_to_float_f16c(src, dst, n);
    if constexpr (std::is_same_v<out_t, BFloat16>) return half_to_bfloat16_f16c(src, dst, n);
  }
#endif
  for (int64_t k = 0; k < n; ++k) dst[k] = from_float<out_t>(half_to_float(src[k]));
}

// Rows sit at random places of a file larger than the caches. While row b is copied, the same line
// of row b + 1 is prefetched (into L2): a row's lines are then found there when it is copied, and the
// hardware prefetcher, which needs a few lines of a stride to catch on, is not relied on.
// Only a line's first kPrefetchBytes are asked for: a longer line (a record field's value is one line
// of up to megabytes) is found by the hardware prefetcher once its copy starts, and asking for all of
// it would pull the next row through L2 ahead of time, evicting it again before it is read (the
// source read twice).
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_line_of(const RowSpan* next, int64_t l) {
  const char* start = reinterpret_cast<const char*>(next->src + l * next->line_pitch);
  const char* end = start + std::min<int64_t>(next->width * static_cast<int64_t>(sizeof(Half)), kPrefetchBytes);
  for (const char* p = start; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

#ifdef LATENTFAST_F16C
// float16 -> float16 rows, the default and hottest case. Lines are tens to hundreds of bytes, where a
// call to memcpy per line (and another for the padding) costs about as much as the bytes: these are
// inlined 32-byte moves, the tail done by one overlapping move. The padding is stored from a register
// holding the line's white value, first, so the real columns written next may overwrite its start.
__attribute__((target("avx2"))) inline void copy_halves_avx2(const Half* src, Half* dst, int64_t n) {
  constexpr int64_t V = 16;  // halves per vector
  if (n < V) {
    std::memcpy(dst, src, n * sizeof(Half));
    return;
  }
  int64_t k = 0;
  for (; k + V <= n; k += V) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  }
  if (k < n) {  // the tail: one more vector, ending at n, overlapping what was just written
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + n - V),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + n - V)));
  }
}

__attribute__((target("avx2"))) void copy_row_half_avx2(const RowSpan& row, const RowSpan* next,
                                                        const Half* white, int64_t lines, Half* dst,
                                                        int64_t W) {
  constexpr int64_t V = 16;  // halves per vector
  const int64_t w = row.width;
  for (int64_t l = 0; l < lines; ++l, dst += W) {
    if (next) prefetch_line_of(next, l);
    if (w < W) {
      const __m256i fill = _mm256_set1_epi16(static_cast<short>(white[l].x));
      if (W >= V) {
        int64_t k = w & ~(V - 1);
        for (; k + V <= W; k += V) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), fill);
        if (k < W) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + W - V), fill);
      } else {
        for (int64_t k = w; k < W; ++k) dst[k] = white[l];
      }
    }
    copy_halves_avx2(row.src + l * row.line_pitch, dst, w);
  }
}

// Streaming (non-temporal) stores, for batches far larger than the CPU caches (a padded text field of a
// batch of records: tens to hundreds of MiB). A plain store first reads the destination's cache line
// (for ownership), which for an output that leaves the caches before it is read doubles the memory
// traffic of the write; a streaming store writes whole lines without reading them, and leaves the
// caches to the source. Filling the padding of such a batch measured 3x faster streamed than with
// plain stores (or memset) on the CI VM; the copy ~10%. The head up to the first 32-byte boundary
// is stored plainly; the caller fences (sfence) before the output is handed on.
__attribute__((target("avx2"))) void stream_halves_avx2(const Half* src, Half* dst, int64_t n) {
  constexpr int64_t V = 16;  // halves per vector
  int64_t k = 0;
  for (; k < n && (reinterpret_cast<uintptr_t>(dst + k) & 31); ++k) dst[k] = src[k];
  for (; k + 4 * V <= n; k += 4 * V) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + V));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 2 * V));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k + 3 * V));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + V), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + 2 * V), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k + 3 * V), d);
  }
  for (; k + V <= n; k += V) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k)));
  }
  for (; k < n; ++k) dst[k] = src[k];
}

__attribute__((target("avx2"))) void stream_fill_avx2(Half* dst, Half value, int64_t n) {
  constexpr int64_t V = 16;
  const __m256i fill = _mm256_set1_epi16(static_cast<short>(value.x));
  int64_t k = 0;
  for (; k < n && (reinterpret_cast<uintptr_t>(dst + k) & 31); ++k) dst[k] = value;
  for (; k + V <= n; k += V) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k), fill);
  for (; k < n; ++k) dst[k] = value;
}

// One row -> out rows [lines, W] with streaming stores: real columns, then the white column up to W.
__attribute__((target("avx2"))) void stream_row_half_avx2(const RowSpan& row, const Half* white, int64_t lines,
                                                          Half* dst, int64_t W) {
  for (int64_t l = 0; l < lines; ++l, dst += W) {
    stream_halves_avx2(row.src + l * row.line_pitch, dst, row.width);
    if (row.width < W) stream_fill_avx2(dst + row.width, white[l], W - row.width);
  }
}

// One row's real columns, back to back as [lines, w] (the packed staging of the GPU path).
__attribute__((target("avx2"))) void pack_row_half_avx2(const RowSpan& row, const RowSpan* next, int64_t lines,
                                                        Half* dst) {
  for (int64_t l = 0; l < lines; ++l, dst += row.width) {
    if (next) prefetch_line_of(next, l);
    copy_halves_avx2(row.src + l * row.line_pitch, dst, row.width);
  }
}

bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// One requested row -> out rows [lines, W]: real columns (cast), then the white column up to W.
// `stream`: a float16 batch far larger than the caches (see stream_halves_avx2).
template <typename out_t>
void copy_row(const RowSpan& row, const RowSpan* next, const Half* white, int64_t lines, out_t* dst,
              int64_t W, bool stream) {
#ifdef LATENTFAST_F16C
  if constexpr (std::is_same_v<out_t, Half>) {
    if (stream) return stream_row_half_avx2(row, white, lines, dst, W);
  }
#endif
  if (row.width == W && row.line_pitch == W) {  // a full-width row stored contiguously: one block
    copy_line<out_t>(row.src, dst, lines * W);
    return;
  }
#ifdef LATENTFAST_F16C
  if constexpr (std::is_same_v<out_t, Half>) {
    if (cpu_has_avx2()) return copy_row_half_avx2(row, next, white, lines, dst, W);
  }
#endif
  for (int64_t l = 0; l < lines; ++l, dst += W) {
    if (next) prefetch_line_of(next, l);
    copy_line<out_t>(row.src + l * row.line_pitch, dst, row.width);
    if (row.width < W) std::fill(dst + row.width, dst + W, from_float<out_t>(half_to_float(white[l])));
  }
}

// Threads only pay off once each has this many bytes to move: waking a pool thread costs
// microseconds, about what copying 64 KiB costs. The work is handed out in chunks of about
// kChunkBytes, so a thread that is descheduled holds up no more than one chunk.
constexpr int64_t kMinThreadBytes = 256 * 1024;
constexpr int64_t kChunkBytes = 64 * 1024;

// A float16 batch is written with streaming stores when it is at least kStreamBytes (far past what
// the caches keep for the reader of the batch) and its lines at least kStreamLineBytes (whole cache
// lines: a streamed partial line costs a read-modify-write in memory).
constexpr int64_t kStreamBytes = 16 << 20;
constexpr int64_t kStreamLineBytes = 4096;

bool use_streaming_stores(int64_t total_bytes, int64_t line_bytes) {
#ifdef LATENTFAST_F16C
  return total_bytes >= kStreamBytes && line_bytes >= kStreamLineBytes && cpu_has_avx2();
#else
  (void)total_bytes, (void)line_bytes;
  return false;
#endif
}

// Streaming pays only into pages already in memory (a reused buffer). Into a fresh allocation each
// first touch faults, and the kernel's zero-fill of the page leaves its lines in cache, where plain
// stores then land and a streaming store first evicts them: measured, a fresh 256 MiB padded batch
// read 1.6x slower streamed. So a row is streamed when the first and last pages it writes are resident
// (mincore); an address mincore cannot answer for counts as not resident.
bool page_resident(const void* address) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  unsigned char present = 0;
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(address) & ~(page - 1));
  return mincore(start, 1, &present) == 0 && (present & 1);
}

bool stream_into(bool stream, const void* first, const void* last) {
  return stream && page_resident(first) && page_resident(last);
}

// Streaming stores are weakly ordered: each thread fences its own before its chunk counts as done.
inline void fence_streaming_stores(bool stream) {
#ifdef LATENTFAST_F16C
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

// On a host with more runnable threads than cores (other ranks, DataLoader workers, other jobs), a
// pool worker that claimed a chunk can be taken off the CPU before it finishes it, and the caller then
// waits for it: measured on the shared CI VM, 2 threads ran a hot 8 MiB batch at 0.5-0.7x the speed of
// 1. So the gathers time themselves: per size class of batch (powers of 2 from 256 KiB), the
// picoseconds per KiB of gathers on the caller alone and with the pool's threads, each a running
// average, and a gather takes the way that has been faster, the other way every kExploreEvery-th
// gather of its class (so a host that quiets down, or gets busy, is noticed). A try of the slower way
// that loses again doubles the interval to the next (up to kExploreEvery << kMaxBackoff; one that wins
// puts it back to kExploreEvery): on a host
// at load 12, a try with the pool's threads cost 2-5 ms where the batch took 0.1 ms alone, and one try
// in 8 made the 2 MiB line batch 7x slower on average. Which thread copies which row never changes a
// result.
constexpr uint64_t kExploreEvery = 8;
constexpr int kMaxBackoff = 5;
constexpr int kSizeClasses = 8;

class ThreadChoice {
 public:
  // Whether the next gather of `bytes` uses the pool's threads.
  bool use_threads(int64_t bytes) {
    Class& c = classes_[size_class(bytes)];
    const uint64_t call = c.calls.fetch_add(1, std::memory_order_relaxed);
    const int64_t solo = c.solo_ps.load(std::memory_order_relaxed), pool = c.pool_ps.load(std::memory_order_relaxed);
    if (pool == 0) return true;  // each way measured once first
    if (solo == 0) return false;
    const bool faster = pool <= solo;
    const uint64_t every = kExploreEvery << c.losses.load(std::memory_order_relaxed);
    return call % every == 0 ? !faster : faster;
  }

  // A gather of `bytes` took `ns`, with the pool's threads or on the caller alone.
  void record(bool threads, int64_t bytes, int64_t ns) {
    Class& c = classes_[size_class(bytes)];
    std::atomic<int64_t>& average = threads ? c.pool_ps : c.solo_ps;
    const int64_t ps_per_kib = std::max<int64_t>(1, ns * 1000 / std::max<int64_t>(1, bytes >> 10));
    const int64_t old = average.load(std::memory_order_relaxed);
    const bool tried_slower = old != 0 && old > (threads ? c.solo_ps : c.pool_ps).load(std::memory_order_relaxed);
    const int64_t now = old == 0 ? ps_per_kib : old + (ps_per_kib - old) / 4;
    average.store(now, std::memory_order_relaxed);
    if (tried_slower) {  // a try of the slower way: lost again (back off), or won (try as often as at first
      // while its average, which remembers the slow tries, catches up)
      const bool lost = ps_per_kib > (threads ? c.solo_ps : c.pool_ps).load(std::memory_order_relaxed);
      const int backoff = c.losses.load(std::memory_order_relaxed);
      c.losses.store(lost ? std::min(backoff + 1, kMaxBackoff) : 0, std::memory_order_relaxed);
    }
  }

 private:
  struct Class {
    std::atomic<uint64_t> calls{0};
    std::atomic<int64_t> solo_ps{0}, pool_ps{0};  // picoseconds per KiB (0: not measured yet)
    std::atomic<int> losses{0};  // tries of the slower way in a row that lost (the interval's doubling)
  };

  static int size_class(int64_t bytes) {
    int c = 0;
    for (int64_t b = std::max<int64_t>(bytes, 1) >> 19; b > 0 && c < kSizeClasses - 1; b >>= 1) ++c;
    return c;  // 0: < 512 KiB, 1: < 1 MiB, ..., 7: >= 32 MiB
  }

  Class classes_[kSizeClasses];
};

ThreadChoice gather_threads;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// parallel_for over a gather's rows (`bytes` written in all), on the pool's `threads` threads or on the
// caller alone, as ThreadChoice picks.
template <typename Fn>
void parallel_rows(int64_t rows, int64_t grain, int64_t threads, int64_t bytes, const Fn& fn) {
  if (threads <= 1 || rows <= grain) return parallel_for(rows, grain, 1, fn);
  const bool pool = gather_threads.use_threads(bytes);
  const int64_t start = now_ns();
  parallel_for(rows, grain, pool ? threads : 1, fn);
  gather_threads.record(pool, bytes, now_ns() - start);
}

// (rows per chunk, threads) for rows of `row_bytes` bytes
std::pair<int64_t, int64_t> split(int64_t rows, int64_t row_bytes, int64_t max_threads) {
  row_bytes = std::max<int64_t>(row_bytes, 1);
  int64_t total = 0;
  if (!mul_fits(rows, row_bytes, &total)) total = std::numeric_limits<int64_t>::max();
  const int64_t threads = std::clamp<int64_t>(total / kMinThreadBytes, 1, std::max<int64_t>(max_threads, 1));
  return {std::max<int64_t>(1, kChunkBytes / row_bytes), threads};
}

template <typename out_t>
void gather_padded(const std::vector<RowSpan>& rows, const Half* white, int64_t lines, out_t* out, int64_t W,
                   int64_t max_threads) {
  // A null white means no row needs padding (checked by the caller).
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t row_elems = lines * W;
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(out_t));
  const auto [grain, threads] = split(B, row_bytes, max_threads);
  int64_t total_bytes = 0;
  if (!mul_fits(B, row_bytes, &total_bytes)) total_bytes = std::numeric_limits<int64_t>::max();
  const bool stream = std::is_same_v<out_t, Half> &&
                      use_streaming_stores(total_bytes, W * static_cast<int64_t>(sizeof(out_t)));
  parallel_rows(B, grain, threads, total_bytes, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      out_t* row_out = out + b * row_elems;
      copy_row<out_t>(rows[b], b + 1 < end ? &rows[b + 1] : nullptr, white, lines, row_out, W,
                      stream_into(stream, row_out, row_out + row_elems - 1));
    }
    fence_streaming_stores(stream);
  });
}

// white: null when no white column was given.
void gather_rows_into_cpu(const Tensor& data, const Tensor& row_offsets, const Tensor& widths, int64_t pitch,
                          const Tensor& indices, const Tensor* white, const Tensor& out, int64_t threads) {
  constexpr const char* op = "gather_rows_into";
  const int64_t lines = check_padded_out(op, out, indices, white);
  const auto rows = resolve_rows(op, data, row_offsets, widths, pitch, indices, lines, out.size(3));
  check_no_overlap_with_sources(op, out, data, row_offsets, widths, indices);
  if (white) check_no_overlap(op, out, "out", *white, "white");
  copy_padded_rows(op, rows, white, lines, out, threads);
}

void gather_rows_packed_into_cpu(const Tensor& data, const Tensor& row_offsets, const Tensor& widths,
                                 int64_t pitch, const Tensor& indices, int64_t channels, int64_t latent_h,
                                 const Tensor& out, int64_t max_threads) {
  constexpr const char* op = "gather_rows_packed_into";
  LF_CHECK_VALUE(channels >= 0 && latent_h >= 0, op, ": channels and latent_h must be >= 0, got ", channels, ", ",
              latent_h);
  LF_CHECK_VALUE(out.is_cpu() && out.dtype == kHalf && out.dim() == 1 && out.is_contiguous(), op,
              ": out must be a contiguous 1-D float16 CPU tensor, got ", dtype_name(out.dtype), " ", out.shape());
  const int64_t lines = checked_mul(channels, latent_h, op, "channels * latent_h");
  const auto rows = resolve_rows(op, data, row_offsets, widths, pitch, indices, lines,
                                 std::numeric_limits<int32_t>::max());
  check_no_overlap_with_sources(op, out, data, row_offsets, widths, indices);
  // where each row starts in out: the prefix sum of lines * w_i (each term lies inside data, the
  // sum of many may still not fit)
  std::vector<int64_t> starts(rows.size() + 1, 0);
  for (size_t b = 0; b < rows.size(); ++b) {
    starts[b + 1] = checked_add(starts[b], checked_mul(lines, rows[b].width, op, "a row's elements"), op,
                                "the rows' total elements");
  }
  LF_CHECK_VALUE(out.numel() >= starts.back(), op, ": out holds ", out.numel(), " elements, the rows need ",
              starts.back());
  if (starts.back() == 0) return;
  Half* dst = out.ptr<Half>();
  const int64_t B = static_cast<int64_t>(rows.size());
  const int64_t mean_row_bytes = starts.back() * static_cast<int64_t>(sizeof(Half)) / std::max<int64_t>(1, B);
  const auto [grain, threads] = split(B, mean_row_bytes, max_threads);
  // (a packed record field: values of whole MiBs back to back, streamed as the padded gather's are)
  const bool stream = use_streaming_stores(starts.back() * static_cast<int64_t>(sizeof(Half)), mean_row_bytes);
  parallel_rows(B, grain, threads, starts.back() * static_cast<int64_t>(sizeof(Half)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const RowSpan& row = rows[b];
      Half* row_dst = dst + starts[b];
      if (row.width == 0) continue;  // nothing to copy (its line loop could be 2^62 lines long)
      if (row.line_pitch == row.width) {  // ragged layout, or a full-width padded row: one block
#ifdef LATENTFAST_F16C
        if (stream_into(stream, row_dst, row_dst + lines * row.width - 1)) {
          stream_halves_avx2(row.src, row_dst, lines * row.width);
          continue;
        }
#endif
        std::memcpy(row_dst, row.src, lines * row.width * sizeof(Half));
        continue;
      }
      const RowSpan* next = b + 1 < end ? &rows[b + 1] : nullptr;
#ifdef LATENTFAST_F16C
      if (cpu_has_avx2()) {
        pack_row_half_avx2(row, next, lines, row_dst);
        continue;
      }
#endif
      for (int64_t l = 0; l < lines; ++l) {
        if (next) prefetch_line_of(next, l);
        std::memcpy(row_dst + l * row.width, row.src + l * row.line_pitch, row.width * sizeof(Half));
      }
    }
    fence_streaming_stores(stream);
  });
}

}  // namespace

// A test hook: a fresh ThreadChoice over n gathers of 2 MiB, gather k taking solo_ns[k] alone and pool_ns[k]
// with the pool's threads (int64 [n] each); out[k] = 1 where gather k used the threads (int64 [n]).
LATENTFAST_ENTRY(latentfast_thread_choice_trace) {
  const Tensor solo_ns = in.tensor(), pool_ns = in.tensor(), out = in.tensor();
  in.finish();
  for (const Tensor* t : {&solo_ns, &pool_ns, &out}) {
    LF_CHECK_VALUE(t->is_cpu() && t->dtype == kLong && t->dim() == 1 && t->is_contiguous() && t->numel() == out.numel(),
                   "thread_choice_trace: solo_ns, pool_ns and out must be contiguous 1-D int64 CPU tensors of one length");
  }
  ThreadChoice choice;
  int64_t* used = out.ptr<int64_t>();
  for (int64_t k = 0; k < out.numel(); ++k) {
    const bool threads = choice.use_threads(2 << 20);
    choice.record(threads, 2 << 20, std::max<int64_t>(1, (threads ? pool_ns : solo_ns).ptr<int64_t>()[k]));
    used[k] = threads;
  }
}

int64_t check_row_vectors(const char* op, const Tensor& row_offsets, const Tensor& widths, int64_t pitch,
                          const Tensor& indices) {
  LF_CHECK_VALUE(row_offsets.is_cpu() && widths.is_cpu() && indices.is_cpu(),
              op, ": data, row_offsets, widths and indices must be CPU tensors");
  LF_CHECK_VALUE(row_offsets.dtype == kLong && row_offsets.dim() == 1 && row_offsets.is_contiguous(),
              op, ": row_offsets must be a contiguous 1-D int64 tensor, got ", dtype_name(row_offsets.dtype), " ",
              row_offsets.shape());
  LF_CHECK_VALUE(widths.dtype == kInt && widths.dim() == 1 && widths.is_contiguous(), op,
              ": widths must be a contiguous 1-D int32 tensor, got ", dtype_name(widths.dtype), " ", widths.shape());
  LF_CHECK_VALUE(indices.dtype == kLong && indices.dim() == 1 && indices.is_contiguous(), op,
              ": indices must be a contiguous 1-D int64 tensor, got ", dtype_name(indices.dtype), " ",
              indices.shape());
  const int64_t n_rows = row_offsets.numel();
  LF_CHECK_VALUE(widths.numel() == n_rows, op, ": widths has ", widths.numel(), " rows but row_offsets has ", n_rows);
  LF_CHECK_VALUE(pitch >= 0, op, ": pitch must be >= 0 (0 = ragged layout), got ", pitch);
  return n_rows;
}

RowSpan checked_row_span(const char* op, int64_t i, int64_t w, int64_t start, int64_t pitch, int64_t lines_per_row,
                         int64_t max_width, const Half* base, int64_t data_len) {
  LF_CHECK_VALUE(w >= 0 && w <= max_width, op, ": row ", i, " has width ", w, ", outside [0, ", max_width, "]");
  LF_CHECK_VALUE(pitch == 0 || w <= pitch, op, ": row ", i, " has width ", w, " > pitch ", pitch);
  const int64_t line_pitch = pitch == 0 ? w : pitch;
  // the row reads [start, start + extent), extent = (lines-1)*line_pitch + w; a pitch or a line
  // count so large that extent does not fit in int64 cannot lie inside any data either
  int64_t extent = 0;
  const bool fits = lines_per_row == 0 || w == 0 ||
                    (mul_fits(lines_per_row - 1, line_pitch, &extent) && add_fits(extent, w, &extent));
  LF_CHECK_VALUE(fits, op, ": row ", i, " spans (", lines_per_row, " - 1) lines * pitch ", line_pitch, " + width ",
                    w, " elements, more than int64 holds: outside the data's ", data_len, " elements");
  LF_CHECK_VALUE(start >= 0 && start <= data_len && extent <= data_len - start, op, ": row ", i, " spans [",
                    start, ", ", start, " + ", extent, ") outside the data's ", data_len, " elements");
  return RowSpan{base + start, w, line_pitch};
}

int64_t check_padded_out(const char* op, const Tensor& out, const Tensor& indices, const Tensor* white) {
  LF_CHECK_VALUE(out.is_cpu() && out.dim() == 4 && out.is_contiguous(), op,
              ": out must be a contiguous CPU tensor [B, C, h, W], got sizes ", out.shape(), " strides ",
              out.strides(), " on ", out.device_name());
  const int64_t B = out.size(0), C = out.size(1), H = out.size(2);
  LF_CHECK_VALUE(indices.numel() == B, op, ": out has B=", B, " rows but indices has ", indices.numel());
  const int64_t lines = checked_mul(C, H, op, "C * h");  // an empty out may have any sizes
  if (white) {
    LF_CHECK_VALUE(white->is_cpu() && white->dtype == kHalf && white->is_contiguous() &&
                    white->numel() == lines,
                op, ": white must be a contiguous float16 CPU tensor of C*h=", lines, " elements ([C, h, 1]), got ",
                dtype_name(white->dtype), " ", white->shape(), " on ", white->device_name());
  }
  return lines;
}

void copy_padded_rows(const char* op, const std::vector<RowSpan>& rows, const Tensor* white, int64_t lines,
                      const Tensor& out, int64_t threads) {
  const int64_t W = out.size(3);
  if (!white) {
    for (size_t b = 0; b < rows.size(); ++b) {
      LF_CHECK_VALUE(rows[b].width == W, op, ": indices[", b, "] (width ", rows[b].width, ") needs padding to W=", W,
                  " but no white column was given");
    }
  }
  if (out.numel() == 0) return;
  const Half* white_ptr = white ? white->ptr<Half>() : nullptr;
  switch (out.dtype) {
    case kHalf: gather_padded<Half>(rows, white_ptr, lines, out.ptr<Half>(), W, threads); break;
    case kBFloat16: gather_padded<BFloat16>(rows, white_ptr, lines, out.ptr<BFloat16>(), W, threads); break;
    case kFloat: gather_padded<float>(rows, white_ptr, lines, out.ptr<float>(), W, threads); break;
    default: LF_CHECK_VALUE(false, op, ": out dtype must be float16, bfloat16 or float32, got ", dtype_name(out.dtype));
  }
}

// args: data, row_offsets, widths, pitch, indices, white?, out, threads
LATENTFAST_ENTRY(latentfast_gather_rows_into) {
  const Tensor data = in.tensor(), row_offsets = in.tensor(), widths = in.tensor();
  const int64_t pitch = in.integer();
  const Tensor indices = in.tensor();
  Tensor white;
  const bool has_white = in.present();
  if (has_white) white = in.tensor();
  const Tensor out = in.tensor();
  const int64_t threads = in.integer();
  in.finish();
  gather_rows_into_cpu(data, row_offsets, widths, pitch, indices, has_white ? &white : nullptr, out, threads);
}

// args: data, row_offsets, widths, pitch, indices, channels, latent_h, out, threads
LATENTFAST_ENTRY(latentfast_gather_rows_packed_into) {
  const Tensor data = in.tensor(), row_offsets = in.tensor(), widths = in.tensor();
  const int64_t pitch = in.integer();
  const Tensor indices = in.tensor();
  const int64_t channels = in.integer(), latent_h = in.integer();
  const Tensor out = in.tensor();
  const int64_t threads = in.integer();
  in.finish();
  gather_rows_packed_into_cpu(data, row_offsets, widths, pitch, indices, channels, latent_h, out, threads);
}

}  // namespace latentfast
