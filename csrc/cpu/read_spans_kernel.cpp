// read_spans_into: bytes [offsets[k], offsets[k] + lengths[k]) of an open file, for every k, read
// back to back into out (uint8) by a pool of pread workers. The parallel-pread ceiling of a batch's
// cold read (bench/bench_decode.py measures read_batch against it) and a way to read spans of any
// file without mapping it.
//
// A cold random read waits for the disk, so throughput comes from many reads in flight: `threads`
// workers each take the next span and pread it (a short read continues where it stopped; EINTR is
// retried). The workers live in a pool kept for the process (starting threads costs about as much
// as a cached read), rebuilt in a forked child, whose copy of the pool has no threads. Every
// argument is checked, with overflow-safe sums, before the first byte is read; the GIL is released
// while the workers read.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gil_release.h"
#include "overlap_check.h"

namespace latentfast {
namespace {

constexpr int64_t kMaxThreads = 256;

struct ReadJob {
  int fd = -1;
  const int64_t* offsets = nullptr;
  const int64_t* lengths = nullptr;
  const int64_t* starts = nullptr;  // where span k goes in out
  uint8_t* out = nullptr;
  int64_t spans = 0;
  int64_t threads = 1;  // workers of the pool that take part
  std::atomic<int64_t> next{0};
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

  void work() {
    for (int64_t k = next.fetch_add(1); k < spans; k = next.fetch_add(1)) read_span(k);
  }
};

// Worker threads that run one job at a time; run() returns when every worker has finished it.
class ReadPool {
 public:
  explicit ReadPool(int64_t threads) {
    for (int64_t t = 0; t < threads; ++t) workers_.emplace_back([this, t] { loop(t); });
  }
  ~ReadPool() {
    {
      std::lock_guard<std::mutex> hold(lock_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }
  int64_t size() const { return static_cast<int64_t>(workers_.size()); }

  void run(ReadJob& job) {
    std::unique_lock<std::mutex> hold(lock_);
    job_ = &job;
    busy_ = size();
    ++generation_;
    wake_.notify_all();
    done_.wait(hold, [this] { return busy_ == 0; });
    job_ = nullptr;
  }

 private:
  void loop(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      ReadJob* job;
      {
        std::unique_lock<std::mutex> hold(lock_);
        wake_.wait(hold, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      if (index < job->threads) job->work();
      std::lock_guard<std::mutex> hold(lock_);
      if (--busy_ == 0) done_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex lock_;
  std::condition_variable wake_, done_;
  ReadJob* job_ = nullptr;
  int64_t busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// This process's pool of at least `threads` workers; one call reads at a time. A forked child gets
// a copy of the pool without its threads (and maybe of a held lock): it starts over with new ones,
// leaking the copies, which it must not destroy.
std::mutex* pool_lock = new std::mutex;
ReadPool* pool = nullptr;
[[maybe_unused]] const int forget_pool_in_child = pthread_atfork(nullptr, nullptr, [] {
  pool_lock = new std::mutex;
  pool = nullptr;
});

ReadPool& pool_of(int64_t threads) {
  if (pool == nullptr || pool->size() < threads) {
    delete pool;
    pool = new ReadPool(threads);
  }
  return *pool;
}

void read_spans_into_cpu(int64_t fd, const at::Tensor& offsets, const at::Tensor& lengths, int64_t threads,
                         const at::Tensor& out) {
  constexpr const char* op = "read_spans_into";
  TORCH_CHECK_VALUE(fd >= 0 && fd <= std::numeric_limits<int>::max(), op, ": fd must be an open file descriptor, got ",
                    fd);
  TORCH_CHECK_VALUE(threads >= 1 && threads <= kMaxThreads, op, ": threads must be in [1, ", kMaxThreads, "], got ",
                    threads);
  for (const auto* t : {&offsets, &lengths}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), op,
                      ": offsets and lengths must be contiguous 1-D int64 CPU tensors, got ", t->scalar_type(), " ",
                      t->sizes(), " on ", t->device());
  }
  TORCH_CHECK_VALUE(offsets.numel() == lengths.numel(), op, ": offsets has ", offsets.numel(), " spans but lengths has ",
                    lengths.numel());
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kByte && out.dim() == 1 && out.is_contiguous(), op,
                    ": out must be a contiguous 1-D uint8 CPU tensor, got ", out.scalar_type(), " ", out.sizes(), " on ",
                    out.device());
  check_no_overlap(op, out, "out", offsets, "offsets");
  check_no_overlap(op, out, "out", lengths, "lengths");
  const int64_t spans = offsets.numel();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<int64_t> starts(spans);
  int64_t total = 0;
  for (int64_t k = 0; k < spans; ++k) {
    TORCH_CHECK_VALUE(off[k] >= 0 && len[k] >= 0 && len[k] <= std::numeric_limits<int64_t>::max() - off[k], op,
                      ": span ", k, " = (offset ", off[k], ", length ", len[k], ") is not a byte range of a file");
    TORCH_CHECK_VALUE(len[k] <= out.numel() - total, op, ": out holds ", out.numel(), " bytes, the spans need more (",
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
  job.out = out.data_ptr<uint8_t>();
  job.spans = spans;
  job.threads = std::min(threads, spans);
  {
    GilRelease no_gil;
    std::lock_guard<std::mutex> hold(*pool_lock);
    pool_of(job.threads).run(job);
  }
  TORCH_CHECK_VALUE(!job.past_end, op, ": ", job.error);
  TORCH_CHECK(job.error.empty(), op, ": ", job.error);
}

}  // namespace

TORCH_LIBRARY_IMPL(latentfast_compiled, CPU, m) { m.impl("read_spans_into", &read_spans_into_cpu); }

}  // namespace latentfast
