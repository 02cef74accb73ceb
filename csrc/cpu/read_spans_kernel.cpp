// read_spans_into: bytes [offsets[k], offsets[k] + lengths[k]) of an open file, for every k, read
// back to back into out (uint8) by a pool of pread workers. The parallel-pread ceiling of a batch's
// cold read (bench/bench_decode.py measures read_batch against it) and a way to read spans of any
// file without mapping it.
//
// A cold random read waits for the disk, so throughput comes from many reads in flight: `threads`
// threads (the caller and the native I/O pool's workers, kept for the process: starting threads costs
// about as much as a cached read) each take the next span and pread it (a short read continues where
// it stopped; EINTR is retried). Every argument is checked, with overflow-safe sums, before the first
// byte is read; the GIL is released for the call (ctypes).
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "native.h"
#include "overlap_check.h"
#include "thread_pool.h"

namespace latentfast {
namespace {

constexpr int64_t kMaxThreads = 256;

struct ReadJob {
  int fd = -1;
  const int64_t* offsets = nullptr;
  const int64_t* lengths = nullptr;
  const int64_t* starts = nullptr;  // where span k goes in out
  uint8_t* out = nullptr;
  std::mutex error_lock;
  std::string error;  // the first failure, empty if none
  bool past_end = false;  // it was a span past the end of the file (a bad argument, not an I/O error)

  void fail(std::string message, bool is_past_end = false) {
    std::lock_guard<std::mutex> hold(error_lock);
    if (error.empty()) {
      error = std::move(message);
      past_end = is_past_end;
    }
  }

  void read_span(int64_t k) {
    uint8_t* dst = out + starts[k];
    int64_t done = 0;
    while (done < lengths[k]) {
      const ssize_t got = pread(fd, dst + done, static_cast<size_t>(lengths[k] - done), offsets[k] + done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return fail("pread of span " + std::to_string(k) + " failed: " + std::strerror(errno));
      if (got == 0) {
        return fail("span " + std::to_string(k) + " = [" + std::to_string(offsets[k]) + ", " +
                        std::to_string(offsets[k] + lengths[k]) + ") runs past the end of the file",
                    true);
      }
      done += got;
    }
  }
};

void read_spans_into_cpu(int64_t fd, const Tensor& offsets, const Tensor& lengths, int64_t threads,
                         const Tensor& out) {
  constexpr const char* op = "read_spans_into";
  LF_CHECK_VALUE(fd >= 0 && fd <= std::numeric_limits<int>::max(), op, ": fd must be an open file descriptor, got ",
                 fd);
  LF_CHECK_VALUE(threads >= 1 && threads <= kMaxThreads, op, ": threads must be in [1, ", kMaxThreads, "], got ",
                 threads);
  for (const auto* t : {&offsets, &lengths}) {
    LF_CHECK_VALUE(t->is_cpu() && t->dtype == kLong && t->dim() == 1 && t->is_contiguous(), op,
                   ": offsets and lengths must be contiguous 1-D int64 CPU tensors, got ", dtype_name(t->dtype), " ",
                   t->shape(), " on ", t->device_name());
  }
  LF_CHECK_VALUE(offsets.numel() == lengths.numel(), op, ": offsets has ", offsets.numel(), " spans but lengths has ",
                 lengths.numel());
  LF_CHECK_VALUE(out.is_cpu() && out.dtype == kByte && out.dim() == 1 && out.is_contiguous(), op,
                 ": out must be a contiguous 1-D uint8 CPU tensor, got ", dtype_name(out.dtype), " ", out.shape(),
                 " on ", out.device_name());
  check_no_overlap(op, out, "out", offsets, "offsets");
  check_no_overlap(op, out, "out", lengths, "lengths");
  const int64_t spans = offsets.numel();
  const int64_t* off = offsets.ptr<int64_t>();
  const int64_t* len = lengths.ptr<int64_t>();
  std::vector<int64_t> starts(spans);
  int64_t total = 0;
  for (int64_t k = 0; k < spans; ++k) {
    LF_CHECK_VALUE(off[k] >= 0 && len[k] >= 0 && len[k] <= std::numeric_limits<int64_t>::max() - off[k], op,
                   ": span ", k, " = (offset ", off[k], ", length ", len[k], ") is not a byte range of a file");
    LF_CHECK_VALUE(len[k] <= out.numel() - total, op, ": out holds ", out.numel(), " bytes, the spans need more (",
                   total, " before span ", k, " of length ", len[k], ")");
    starts[k] = total;
    total += len[k];
  }
  if (total == 0) return;
  ReadJob job;
  job.fd = static_cast<int>(fd);
  job.offsets = off;
  job.lengths = len;
  job.starts = starts.data();
  job.out = out.ptr<uint8_t>();
  parallel_for(
      spans, 1, std::min(threads, spans),
      [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) job.read_span(k);
      },
      /*io=*/true);
  LF_CHECK_VALUE(!job.past_end, op, ": ", job.error);
  LF_CHECK(job.error.empty(), op, ": ", job.error);
}

}  // namespace

// args: fd, offsets, lengths, threads, out
LATENTFAST_ENTRY(latentfast_read_spans_into) {
  const int64_t fd = in.integer();
  const Tensor offsets = in.tensor(), lengths = in.tensor();
  const int64_t threads = in.integer();
  const Tensor out = in.tensor();
  in.finish();
  read_spans_into_cpu(fd, offsets, lengths, threads, out);
}

}  // namespace latentfast
