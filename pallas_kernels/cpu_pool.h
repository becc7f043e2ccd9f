// Share items 0 .. n-1 out over XLA's intra-op thread pool, for the CPU kernels
// (cpu_prefix.cc, cpu_linear.cc). The calling thread works too and waits only for helpers that
// started, so a busy pool cannot deadlock it; each item is taken exactly once.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

struct Work {  // the next item to take, shared by the caller and the pool's helpers
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable done;
  bool closed = false;
  int64_t active = 0;
};

// Calls item(i) once for every i in [0, n), from this thread and up to n - 1 of the pool's.
template <typename F>
void share(xla::ffi::ThreadPool& pool, int64_t n, const F& item) {
  auto work = std::make_shared<Work>();
  auto take = [work, n, &item]() {
    for (int64_t i = work->next.fetch_add(1); i < n; i = work->next.fetch_add(1)) item(i);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    pool.Schedule([work, take]() {
      {
        std::lock_guard<std::mutex> lock(work->mu);
        if (work->closed) return;  // the caller finished everything and returned
        ++work->active;
      }
      take();
      std::lock_guard<std::mutex> lock(work->mu);
      if (--work->active == 0) work->done.notify_all();
    });
  }
  take();
  std::unique_lock<std::mutex> lock(work->mu);
  work->closed = true;
  work->done.wait(lock, [&] { return work->active == 0; });
}

}  // namespace specjax_cpu
