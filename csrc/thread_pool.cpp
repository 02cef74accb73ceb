// The pool behind parallel_chunks (see thread_pool.h for the scheme).
//
// One 64-bit word holds the job's generation, the next unclaimed chunk and the chunk count; a thread
// claims a chunk with a compare-exchange on the whole word, so a worker that wakes late -- after its
// job ended, or during the next one -- can only claim chunks of the job that is current, never run a
// stale one. A job's fields (body, context, sizes) are written before the word publishes it and stay
// put until every claimed chunk is done, which the caller waits for before it returns.
#include "thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace latentfast {
namespace {

constexpr int kCountBits = 20;
constexpr uint64_t kCountMask = (uint64_t{1} << kCountBits) - 1;
constexpr int64_t kMaxChunks = static_cast<int64_t>(kCountMask);
constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kCountBits)) - 1;
constexpr int64_t kMaxThreads = 256;
constexpr int kSpins = 256;  // pauses before a caller sleeps on chunks still running elsewhere

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

class Pool {
 public:
  void run(int64_t tasks, int64_t grain, int64_t threads, ChunkBody body, void* context, bool wait_for_pool) {
    std::unique_lock<std::mutex> caller(caller_, std::defer_lock);
    if (wait_for_pool) {
      caller.lock();
    } else if (!caller.try_lock()) {
      return body(context, 0, tasks);  // another caller has the pool: this one runs alone
    }
    const int64_t chunks = (tasks + grain - 1) / grain;
    const int64_t helpers = std::min<int64_t>(threads, chunks) - 1;
    spawn(helpers);
    body_ = body;
    context_ = context;
    tasks_ = tasks;
    grain_ = grain;
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & kGenerationMask;
    state_.store((generation_ << (2 * kCountBits)) | static_cast<uint64_t>(chunks), std::memory_order_release);
    {
      std::lock_guard<std::mutex> hold(lock_);
      wanted_ = helpers;
      ++wake_count_;
    }
    for (int64_t k = 0; k < helpers; ++k) wake_.notify_one();
    work();
    for (int spin = 0; spin < kSpins && done_.load(std::memory_order_acquire) < chunks; ++spin) cpu_relax();
    if (done_.load(std::memory_order_acquire) < chunks) {
      std::unique_lock<std::mutex> hold(lock_);
      finished_.wait(hold, [&] { return done_.load(std::memory_order_acquire) >= chunks; });
    }
    std::lock_guard<std::mutex> hold(lock_);
    wanted_ = 0;  // helpers that have not woken yet stay asleep
  }

 private:
  // Claims and runs chunks of the current job until none is left.
  void work() {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = (s >> kCountBits) & kCountMask, chunks = s & kCountMask;
      if (next >= chunks) return;
      if (!state_.compare_exchange_weak(s, s + (uint64_t{1} << kCountBits), std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;
      }
      const int64_t begin = static_cast<int64_t>(next) * grain_;
      body_(context_, begin, std::min(tasks_, begin + grain_));
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int64_t>(chunks)) {
        std::lock_guard<std::mutex> hold(lock_);
        finished_.notify_all();
      }
      s = state_.load(std::memory_order_acquire);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> hold(lock_);
        wake_.wait(hold, [&] { return wake_count_ != seen && wanted_ > 0; });
        seen = wake_count_;
        --wanted_;
      }
      work();
    }
  }

  void spawn(int64_t helpers) {
    while (static_cast<int64_t>(workers_.size()) < helpers) {
      workers_.emplace_back([this] { loop(); });
      workers_.back().detach();  // the pool lives as long as the process
    }
  }

  std::mutex caller_;  // one job at a time
  std::mutex lock_;    // wake_count_, wanted_, and the two condition variables
  std::condition_variable wake_, finished_;
  uint64_t wake_count_ = 0;
  int64_t wanted_ = 0;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  ChunkBody body_ = nullptr;
  void* context_ = nullptr;
  int64_t tasks_ = 0, grain_ = 1;
};

// One pool for compute (memory-bound copies: as many threads as cores) and one for I/O (pread
// workers that block on the disk), kept for the process. A forked child gets copies without their
// threads (and maybe with a held lock): it starts over with new pools, leaking the copies.
Pool* compute_pool = new Pool;
Pool* io_pool = new Pool;
[[maybe_unused]] const int forget_pools_in_child = pthread_atfork(nullptr, nullptr, [] {
  compute_pool = new Pool;
  io_pool = new Pool;
});

}  // namespace

void parallel_chunks(int64_t tasks, int64_t grain, int64_t threads, ChunkBody body, void* context, bool io) {
  if (tasks <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  grain = std::max<int64_t>(grain, (tasks + kMaxChunks - 1) / kMaxChunks);  // the count fits its bits
  threads = std::clamp<int64_t>(threads, 1, kMaxThreads);
  if (threads == 1 || tasks <= grain) return body(context, 0, tasks);
  (io ? io_pool : compute_pool)->run(tasks, grain, threads, body, context, io);
}

}  // namespace latentfast
