// The threads of one native call made of many small dependent steps (the one-call decode step: about 150 per
// token), run by the calling thread and a pool of workers kept between calls, not a parallel region per op. The
// work is a sequence of phases, each cut into chunks that the threads claim one at a time from an atomic counter; a
// phase begins once every chunk of the one before is done.
//
// Why claimed chunks and not a fixed share per thread: where the cores are shared with other work, a thread can lose
// its core for a scheduler time slice (milliseconds) at any moment. With fixed shares every barrier waits for the
// slowest thread, so one descheduled thread stalls the whole step; with claimed chunks the threads that run take its
// share, and a phase waits only for a chunk a descheduled thread already holds. A waiting thread spins briefly (a
// phase takes microseconds) and then yields its core, so it does not burn the time slice that the thread it waits for
// needs.
#pragma once
#include <ATen/Parallel.h>

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <new>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace gqa_cpu {

// A spin-wait iteration: tells the core (and its hyper-thread sibling) that this thread only waits.
inline void spin_pause() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

// Threads kept for PhasedWork between calls: at::get_num_threads() - 1 workers that wait for a job, spinning a little
// and then asleep, and join a job whenever they get a core; the calling thread works on the job too. Unlike a
// parallel region (OpenMP's, at::parallel_for's), a call does not wait for every thread to arrive and leave: a worker
// that has no core when a job starts neither delays it nor holds up its end, and one that wakes after the job is done
// finds nothing left to do. One job at a time: a call made while another is running runs on its own thread alone.
class WorkerPool {
 public:
  struct Job {
    virtual void work() = 0;
    virtual ~Job() = default;
  };

  static WorkerPool& get() {
    static WorkerPool* pool = [] {
      // A fork waits for a running job. The child has none of the parent's threads, so it starts over: new locks,
      // a new condition variable (the parent's may list waiters the child will never have, and a notify would wait
      // for them forever) and no workers; its first job starts new ones.
      pthread_atfork([] { instance()->lock_all(); }, [] { instance()->unlock_all(); },
                     [] { instance()->start_over(); });
      return instance();
    }();
    return *pool;
  }

  // job.work() on the calling thread and on every worker that gets a core before it is done; returns when the
  // calling thread's work() returns and no worker is inside the job any more.
  void run(Job& job) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    if (!busy.owns_lock() || threads == 1 || at::in_parallel_region()) {
      job.work();
      return;
    }
    resize(threads - 1);
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    try {
      job.work();
    } catch (...) {
      retire();
      throw;
    }
    retire();
  }

 private:
  static constexpr int IDLE_SPINS = 20000;  // 0.5-2 ms of pauses (PAUSE: 25-100 ns) before a worker sleeps

  static WorkerPool* instance() {
    static WorkerPool* pool = new WorkerPool();  // never destroyed: workers may still wait on it at exit
    return pool;
  }
  void lock_all() {
    run_mutex_.lock();
    sleep_mutex_.lock();
  }
  void unlock_all() {
    sleep_mutex_.unlock();
    run_mutex_.unlock();
  }

  // In a forked child: the same pool, empty. The parent's threads are not here, so their std::thread objects are
  // dropped without a join or detach (the vector's old buffer is leaked), and the locks and condition variable are
  // constructed anew rather than unlocked.
  void start_over() {
    new (&workers_) std::vector<std::thread>();
    new (&run_mutex_) std::mutex();
    new (&sleep_mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    job_.store(nullptr);
    active_.store(0);
    sleepers_.store(0);
    stop_.store(false);
  }

  void retire() {
    job_.store(nullptr);
    while (active_.load() > 0) std::this_thread::yield();  // workers inside the job finish their last chunk
  }

  void resize(int64_t workers) {
    if (static_cast<int64_t>(workers_.size()) == workers) return;
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      generation_.fetch_add(1);
      wake_.notify_all();
    }
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    stop_.store(false);
    // A worker starts from the generation current when it was made, not when its thread first runs: one that gets
    // its first time slice only after a later resize's stop signal still sees that signal (and returns).
    const uint64_t now = generation_.load();
    for (int64_t i = 0; i < workers; ++i) workers_.emplace_back([this, now] { loop(now); });
  }

  void loop(uint64_t seen) {
    for (;;) {
      for (int spins = 0; generation_.load() == seen && !stop_.load(); ++spins) {
        if (spins < IDLE_SPINS) {
          spin_pause();
        } else {
          std::unique_lock<std::mutex> lock(sleep_mutex_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
          sleepers_.fetch_sub(1);
        }
      }
      seen = generation_.load();
      if (stop_.load()) return;
      active_.fetch_add(1);  // before reading the job: retire() then either sees us or we see its nullptr
      Job* job = job_.load();
      if (job != nullptr) {
        try {
          job->work();
        } catch (...) {  // the job keeps its own error (PhasedWork rethrows it on the calling thread)
        }
      }
      active_.fetch_sub(1);
    }
  }

  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> active_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
};

class PhasedWork : public WorkerPool::Job {
 public:
  // chunks[p]: how many chunks phase p has (0 is allowed).
  explicit PhasedWork(std::vector<int64_t> chunks)
      : chunks_(std::move(chunks)), counters_(new Counters[chunks_.size()]) {}

  // run(state, phase, chunk, first) for every chunk of every phase, phases in order, on the calling thread and the
  // WorkerPool's; each thread has its own default-constructed State, and `first` is true for the first chunk a
  // thread takes in a phase (where it prepares what its chunks of the phase share). The first exception a chunk
  // throws stops the work and is rethrown here.
  template <typename State, typename Run>
  void run(const Run& run_chunk) {
    body_ = [this, &run_chunk] {
      State state;
      phases(state, run_chunk);
    };
    WorkerPool::get().run(*this);
    if (error_) std::rethrow_exception(error_);
  }

  void work() override { body_(); }

 private:
  struct alignas(64) Counter {
    std::atomic<int64_t> value{0};
  };
  struct Counters {
    Counter claimed, done;
  };
  static constexpr int SPINS = 256;  // pauses (25-100 ns each) before a waiting thread starts yielding its core

  template <typename State, typename Run>
  void phases(State& state, const Run& run_chunk) {
    for (size_t p = 0; p < chunks_.size(); ++p) {
      Counters& c = counters_[p];
      bool first = true;
      for (int64_t chunk; !failed_.load(std::memory_order_relaxed) &&
                          (chunk = c.claimed.value.fetch_add(1, std::memory_order_relaxed)) < chunks_[p];) {
        try {
          run_chunk(state, p, chunk, first);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true);
        }
        first = false;
        c.done.value.fetch_add(1, std::memory_order_release);
      }
      for (int spins = 0; c.done.value.load(std::memory_order_acquire) < chunks_[p]; ++spins) {
        if (failed_.load(std::memory_order_relaxed)) return;
        if (spins < SPINS) {
          spin_pause();
        } else {
          std::this_thread::yield();
        }
      }
      if (failed_.load(std::memory_order_relaxed)) return;
    }
  }

  std::vector<int64_t> chunks_;
  std::unique_ptr<Counters[]> counters_;
  std::function<void()> body_;
  std::atomic<bool> failed_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

}  // namespace gqa_cpu
