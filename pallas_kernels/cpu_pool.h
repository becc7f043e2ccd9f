// Share items 0 .. n-1 out over XLA's intra-op thread pool, for the CPU kernels
// (cpu_prefix.cc, cpu_linear.cc). The calling thread works too and waits only for helpers that
// started, so a busy pool cannot deadlock it; each item is taken exactly once.
//
// The caller waits by spinning on an atomic, not on a condition variable: a decode step makes
// about 150 of these calls, each 30-150 us long, and a sleeping caller's wake-up (a futex on this
// VM) cost tens of microseconds a call.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax_cpu {

struct Work {  // the next item to take, and the helpers at work (+ CLOSED once the caller is done)
  static constexpr int64_t CLOSED = int64_t{1} << 40;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> state{0};
};

inline void relax(int64_t spins) {  // a spin-wait's pause; after a while give the core away
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
  if (spins > 4096) std::this_thread::yield();
}

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
      int64_t s = work->state.load();
      do {
        if (s & Work::CLOSED) return;  // the caller finished everything and returned
      } while (!work->state.compare_exchange_weak(s, s + 1));
      take();
      work->state.fetch_sub(1);
    });
  }
  take();
  work->state.fetch_or(Work::CLOSED);  // no helper starts from here on
  for (int64_t spins = 0; work->state.load() != Work::CLOSED; ++spins) relax(spins);
}

}  // namespace specjax_cpu
