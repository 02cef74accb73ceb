// The native library's thread pool: no OpenMP, no at::parallel_for barrier.
//
// run(tasks, threads, body) calls body(begin, end) over [0, tasks) split into small chunks. The chunks
// are handed out by one atomic counter; the calling thread takes chunks too and, when none are left,
// waits only for chunks other threads have already claimed. A worker that is descheduled (the cores
// are busy with other processes, as under DataLoader workers or other ranks) claims nothing while it
// is off the CPU, so the caller does its share instead of waiting for it: there is no barrier at which
// every thread must arrive. Workers sleep on a condition variable between jobs (no spinning).
#pragma once

#include <cstdint>

namespace latentfast {

using ChunkBody = void (*)(void* context, int64_t begin, int64_t end);

// Runs body over [0, tasks) on the calling thread and at most threads - 1 pool workers, in chunks of
// `grain` tasks (>= 1). A call made while the pool serves another caller runs on the calling thread
// alone (for `io` jobs, which block on the disk, it waits for the pool instead).
void parallel_chunks(int64_t tasks, int64_t grain, int64_t threads, ChunkBody body, void* context, bool io = false);

// parallel_chunks with a lambda: fn(begin, end).
template <typename Fn>
void parallel_for(int64_t tasks, int64_t grain, int64_t threads, const Fn& fn, bool io = false) {
  parallel_chunks(
      tasks, grain, threads,
      [](void* context, int64_t begin, int64_t end) { (*static_cast<const Fn*>(context))(begin, end); },
      const_cast<Fn*>(&fn), io);
}

}  // namespace latentfast
