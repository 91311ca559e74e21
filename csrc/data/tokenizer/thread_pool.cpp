#include "data/tokenizer/thread_pool.h"

#include <pthread.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace barqtrain::tokenizer {
namespace {

class ThreadPool {
 public:
  void run(size_t threads, const std::function<void()>& job) {
    if (threads <= 1 || inside_job) {
      job();
      return;
    }
    const std::lock_guard<std::mutex> turn(run_mutex_);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Workers are never stopped: they are detached and end with the process.
      while (workers_ < threads - 1) {
        std::thread([this] { work(); }).detach();
        ++workers_;
      }
      job_ = &job;
      wanted_ = threads - 1;
      remaining_ = threads - 1;
      ++generation_;
    }
    wake_.notify_all();
    inside_job = true;
    job();
    inside_job = false;
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return remaining_ == 0; });
    job_ = nullptr;
  }

 private:
  void work() {
    inside_job = true;  // a worker only ever runs jobs
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen && wanted_ > 0; });
      seen = generation_;
      --wanted_;
      const std::function<void()>* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  static thread_local bool inside_job;
  std::mutex run_mutex_;  // one batch at a time
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  size_t workers_ = 0;
  const std::function<void()>* job_ = nullptr;
  size_t wanted_ = 0;     // workers still to join the current job
  size_t remaining_ = 0;  // workers still running it
  uint64_t generation_ = 0;
};

thread_local bool ThreadPool::inside_job = false;

ThreadPool* pool = nullptr;
std::once_flag pool_once;

ThreadPool& shared_pool() {
  std::call_once(pool_once, [] {
    pool = new ThreadPool;  // leaked on purpose: its threads outlive static destruction
    // A forked child (a DataLoader worker) has none of the parent's threads: give it a
    // fresh pool instead of one whose workers do not exist.
    pthread_atfork(nullptr, nullptr, [] { pool = new ThreadPool; });
  });
  return *pool;
}

}  // namespace

void parallel_run(size_t threads, const std::function<void()>& job) { shared_pool().run(threads, job); }

}  // namespace barqtrain::tokenizer
