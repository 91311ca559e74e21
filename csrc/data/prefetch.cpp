#include "data/prefetch.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace barqtrain::data {

struct Prefetcher::State {
  struct Job {
    RowBuffers buffers{};
    bool done = false;
    CollateInfo info;
    std::exception_ptr error;
  };
  std::mutex mutex;
  std::condition_variable work;      // workers: a job was queued, or closing
  std::condition_variable finished;  // the consumer: a job is done
  std::deque<size_t> queue;          // submitted batches no worker has started
  std::map<size_t, Job> jobs;        // submitted and not yet taken
  bool closing = false;
  std::vector<std::thread> workers;
};

Prefetcher::Prefetcher(std::shared_ptr<const Packer> packer, size_t batch_size, size_t num_workers, size_t depth)
    : owner_pid_(::getpid()), batch_size_(batch_size), packer_(std::move(packer)), state_(new State) {
  if (!packer_) {
    delete state_;
    throw PrefetchError("the packer is null");
  }
  if (batch_size < 1 || num_workers < 1 || depth < 1) {
    delete state_;
    throw PrefetchError("batch_size, num_workers and depth must be at least 1 (got " + std::to_string(batch_size) +
                        ", " + std::to_string(num_workers) + ", " + std::to_string(depth) + ")");
  }
  depth_ = depth;
  State* s = state_;
  const Packer* p = packer_.get();
  const size_t bs = batch_size_;
  for (size_t w = 0; w < num_workers; ++w) {
    s->workers.emplace_back([s, p, bs] {
      std::unique_lock<std::mutex> lock(s->mutex);
      for (;;) {
        s->work.wait(lock, [s] { return s->closing || !s->queue.empty(); });
        if (s->closing) return;
        const size_t batch = s->queue.front();
        s->queue.pop_front();
        State::Job& job = s->jobs.at(batch);  // std::map nodes stay put while others come and go
        const RowBuffers buffers = job.buffers;
        lock.unlock();
        CollateInfo info;
        std::exception_ptr error;
        try {
          const size_t first = batch * bs;
          info = p->collate(first, std::min(first + bs, p->num_rows()), buffers);
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        job.info = std::move(info);
        job.error = error;
        job.done = true;
        s->finished.notify_all();
      }
    });
  }
}

Prefetcher::~Prefetcher() {
  if (::getpid() != owner_pid_) return;  // a forked child: the threads and locks are not ours
  close();
  delete state_;
}

void Prefetcher::check_process() const {
  if (::getpid() != owner_pid_) {
    throw PrefetchError("this prefetcher was started in process " + std::to_string(owner_pid_) +
                        " and cannot run in the forked process " + std::to_string(::getpid()) +
                        ", which has none of its threads: start a new one in the child");
  }
}

size_t Prefetcher::num_batches(bool drop_last) const {
  const size_t rows = packer_->num_rows();
  return drop_last ? rows / batch_size_ : (rows + batch_size_ - 1) / batch_size_;
}

size_t Prefetcher::rows_in(size_t batch) const {
  const size_t first = batch * batch_size_;
  if (first >= packer_->num_rows()) {
    throw PrefetchError("batch " + std::to_string(batch) + " is past the last batch (" +
                        std::to_string(num_batches(false)) + " batches)");
  }
  return std::min(batch_size_, packer_->num_rows() - first);
}

void Prefetcher::submit(size_t batch, const RowBuffers& buffers) {
  check_process();
  rows_in(batch);  // in range
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->closing) throw PrefetchError("the prefetcher is closed");
  if (state_->jobs.size() >= depth_) {
    throw PrefetchError("already " + std::to_string(depth_) + " batches submitted and not taken (the depth): take one first");
  }
  if (!state_->jobs.emplace(batch, State::Job{buffers}).second) {
    throw PrefetchError("batch " + std::to_string(batch) + " is already submitted");
  }
  state_->queue.push_back(batch);
  state_->work.notify_one();
}

CollateInfo Prefetcher::take(size_t batch, const std::function<bool()>& should_stop) {
  check_process();
  std::unique_lock<std::mutex> lock(state_->mutex);
  auto it = state_->jobs.find(batch);
  if (it == state_->jobs.end()) {
    throw PrefetchError("batch " + std::to_string(batch) + " was never submitted (or was already taken)");
  }
  while (!it->second.done) {
    if (state_->closing) throw PrefetchError("the prefetcher was closed while waiting for batch " + std::to_string(batch));
    state_->finished.wait_for(lock, std::chrono::milliseconds(20));
    if (should_stop && !it->second.done) {
      lock.unlock();
      const bool stop = should_stop();
      lock.lock();
      if (stop) throw PrefetchError("interrupted while waiting for batch " + std::to_string(batch));
      it = state_->jobs.find(batch);
    }
  }
  State::Job job = std::move(it->second);
  state_->jobs.erase(it);
  if (job.error) std::rethrow_exception(job.error);
  return std::move(job.info);
}

void Prefetcher::close() {
  check_process();
  std::vector<std::thread> workers;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closing = true;
    state_->queue.clear();
    workers.swap(state_->workers);
  }
  state_->work.notify_all();
  state_->finished.notify_all();
  for (std::thread& t : workers) t.join();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->jobs.clear();
}

size_t Prefetcher::outstanding() const {
  check_process();
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->jobs.size();
}

}  // namespace barqtrain::data
