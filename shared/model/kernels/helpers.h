// Helper threads for an engine held to one torch thread (shared by the CPU kernels).
//
// The calling thread can be joined by helper threads that run at a low priority and take
// chunks of the work from a shared counter. They only use cores nobody else wants: the caller
// never waits for a helper that has not started, only for a chunk one has taken (small), so
// a call is never much slower than the caller alone, and faster whenever a core is idle. A
// fork-join team (OpenMP) instead stalls every call on its slowest, possibly descheduled,
// thread. Each chunk is computed whole by one thread: results do not depend on who took it.
#pragma once

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>
#include <torch/csrc/utils/pybind.h>

namespace pdd {

using Chunks = c10::function_ref<void(int64_t, int64_t)>;  // fn(begin, end): a reference, no allocation

namespace {  // in each kernel library; the pool itself is shared (helpers() below)

class Helpers {
 public:
  ~Helpers() { resize(0, 0); }

  void resize(int count, int nice) {
    std::lock_guard<std::mutex> no_job(job_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      stop_flag_.store(true);
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_ = false;
    stop_flag_.store(false);
    for (int i = 0; i < count; ++i) threads_.emplace_back([this, nice] { loop(nice); });
  }

  int count() const { return static_cast<int>(threads_.size()); }

  // fn(begin, end) over [0, n) in chunks of `chunk`, by the caller and whichever helpers come.
  // One job at a time: a caller that finds the helpers taken (another engine thread in this
  // process) runs its job alone.
  void run(int64_t n, int64_t chunk, Chunks fn) {
    std::unique_lock<std::mutex> mine(job_mu_, std::try_to_lock);
    if (!mine.owns_lock()) {
      fn(0, n);
      return;
    }
    const int64_t chunks = (n + chunk - 1) / chunk;
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = ++gen_;
      fn_ = fn;
      n_ = n;
      chunk_ = chunk;
      done_.store(0, std::memory_order_relaxed);
      next_.store(gen << kIndexBits, std::memory_order_release);
    }
    wake_.notify_all();
    work(gen, fn, n, chunk);
    if (done_.load(std::memory_order_acquire) < chunks) {  // a helper still has a chunk
      std::unique_lock<std::mutex> lock(mu_);
      finished_.wait(lock, [&] { return done_.load(std::memory_order_acquire) >= chunks; });
    }
  }

 private:
  static constexpr int kIndexBits = 24;  // the counter: generation << 24 | next chunk
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  static constexpr int kSpinUs = 200;

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // Takes chunks of job `gen` until none is left (or another job has begun).
  void work(uint64_t gen, Chunks fn, int64_t n, int64_t chunk) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      int64_t i;
      do {
        if ((v >> kIndexBits) != gen || static_cast<int64_t>(v & kIndexMask) >= chunks) return;
        i = static_cast<int64_t>(v & kIndexMask);
      } while (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel));
      fn(i * chunk, std::min(n, (i + 1) * chunk));
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller may be waiting for this one
        finished_.notify_all();
      }
    }
  }

  void loop(int nice) {
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
    uint64_t seen = 0;
    for (;;) {
      Chunks fn;
      int64_t n, chunk;
      uint64_t gen;
      // A decode step's calls come a few microseconds apart: watch for the next one a while
      // before sleeping (waking from a futex takes longer than such a call).
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
      while ((next_.load(std::memory_order_acquire) >> kIndexBits) == seen && !stop_flag_.load() &&
             std::chrono::steady_clock::now() < until) {
        pause();
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen = gen_;
        fn = fn_;
        n = n_;
        chunk = chunk_;
      }
      // The job's function lives until its last taken chunk is done: work() checks the
      // generation before taking one, so a late helper never runs a job that has ended.
      work(gen, fn, n, chunk);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex job_mu_;  // held by the caller whose job the helpers are on
  std::mutex mu_;
  std::condition_variable wake_, finished_;
  bool stop_ = false;
  std::atomic<bool> stop_flag_{false};
  uint64_t gen_ = 0;
  Chunks fn_;  // the current job's: called only for a chunk taken while the job runs
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
};

// One pool per process: the library whose set_helpers ran last owns it, the other kernel
// libraries share it (share_helpers, given its capsule), so one helper thread follows the
// engine thread from a product to the attention and back, awake between its calls. A pool
// per library would leave each helper asleep through the others' calls, to be woken late
// for its own (a decode step of 8 sequences, one thread and a helper: 10.6-11.1 ms against
// 9.3-9.8 with the pool shared).
Helpers& own_helpers() {
  static Helpers h;
  return h;
}

Helpers*& shared_helpers() {
  static Helpers* pool = nullptr;  // another library's, or null: this one's own
  return pool;
}

Helpers& helpers() {
  Helpers* pool = shared_helpers();
  return pool ? *pool : own_helpers();
}

// fn over [0, n): with helpers in a one-thread engine, in about kChunksPerCall chunks (at
// least `grain` each, a chunk small enough that waiting for one is short); otherwise
// at::parallel_for's split over torch's threads, `grain` at least per task.
constexpr int64_t kChunksPerCall = 16;

inline void parallel(int64_t n, int64_t grain, Chunks fn) {
  if (helpers().count() > 0 && at::get_num_threads() == 1 && n > grain) {
    helpers().run(n, std::max(grain, (n + kChunksPerCall - 1) / kChunksPerCall), fn);
  } else {
    at::parallel_for(0, n, grain, fn);
  }
}

// count helpers (0 = none) at niceness `nice` in this library's own pool, replacing those
// there were; it stops sharing another's.
void set_helpers(int64_t count, int64_t nice) {
  TORCH_CHECK(count >= 0 && count <= 64, "set_helpers: count must be in 0..64");
  shared_helpers() = nullptr;
  own_helpers().resize(static_cast<int>(count), static_cast<int>(nice));
}

constexpr const char* kCapsule = "pdd.helpers";

// The set_helpers / helpers_capsule / share_helpers functions of one kernel library.
void def_helpers(pybind11::module_& m) {
  m.def("set_helpers", &set_helpers, "low-priority helper threads (count, nice) for one-thread engines",
        pybind11::arg("count"), pybind11::arg("nice") = 10);
  m.def("helpers_capsule", [] { return pybind11::capsule(&own_helpers(), kCapsule); },
        "this library's helper pool, for another kernel library of this process to share");
  m.def("share_helpers", [](const pybind11::capsule& pool) {
    TORCH_CHECK(pool.name() != nullptr && std::string(pool.name()) == kCapsule, "share_helpers: not a helper pool");
    own_helpers().resize(0, 0);
    shared_helpers() = pool.get_pointer<Helpers>();
  }, "use another kernel library's helper pool (its helpers_capsule) instead of this one's");
}

}  // namespace
}  // namespace pdd
