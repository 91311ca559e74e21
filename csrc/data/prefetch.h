// Prefetch: background threads collate packed batches ahead of the training loop.
//
//   Prefetcher prefetch(packer, batch_size, /*num_workers=*/2, /*depth=*/4);
//   prefetch.submit(0, buffers0);  prefetch.submit(1, buffers1);    // up to depth batches ahead
//   CollateInfo info = prefetch.take(0, should_stop);               // waits; batch 0 is in buffers0
//
// The caller owns the buffers: Python allocates each batch's tensors (pinned when a GPU is
// there) and submits them, so a batch handed out is never written again and no framework
// is linked here. At most depth batches are submitted and not yet taken (back-pressure:
// workers sleep when every submitted batch is done). Batch b holds rows
// [b * batch_size, min((b + 1) * batch_size, rows)) of the packer.
//
// A worker's exception is rethrown by take() of its batch. close() (and the destructor)
// stops the workers after the batch each is collating and joins them. A Prefetcher belongs to
// the process that made it: after fork() the child has none of its threads, so every call
// there is a PrefetchError and the destructor lets the state go without touching its locks.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <stdexcept>

#include "data/packing.h"

namespace barqtrain::data {

class PrefetchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Prefetcher {
 public:
  Prefetcher(std::shared_ptr<const Packer> packer, size_t batch_size, size_t num_workers, size_t depth);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  size_t num_batches(bool drop_last) const;  // of the whole packing
  size_t rows_in(size_t batch) const;        // rows of batch (the last one may be short)

  // Queues batch to be collated into buffers of rows_in(batch) * seq_length values each; a
  // worker may write them until take(batch) returns or close() (or the destructor) has joined
  // the workers, so they must stay valid until then.
  void submit(size_t batch, const RowBuffers& buffers);
  // Waits until batch is collated and returns its cu_seqlens. should_stop is called every few
  // milliseconds while waiting; when it returns true the wait ends with a PrefetchError (the
  // binding checks for Ctrl-C there). Rethrows the batch's worker exception.
  CollateInfo take(size_t batch, const std::function<bool()>& should_stop = {});
  void close();

  size_t outstanding() const;  // submitted and not yet taken

 private:
  struct State;
  void check_process() const;

  pid_t owner_pid_;
  size_t batch_size_;
  size_t depth_;
  std::shared_ptr<const Packer> packer_;
  State* state_;  // owned; deliberately leaked in a forked child (see the file comment)
};

}  // namespace barqtrain::data
