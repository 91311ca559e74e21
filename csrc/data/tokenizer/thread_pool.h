// A process-wide pool of worker threads for the tokenizer's batch calls. The threads live
// as long as the process, so their per-thread pre-token caches stay warm from one batch to
// the next, and a batch call costs two condition-variable handoffs instead of spawning
// threads.
#pragma once

#include <cstddef>
#include <functional>

namespace barqtrain::tokenizer {

// Runs job() on `threads` threads at once, the calling thread being one of them, and returns
// when every call has returned. job must not throw. Calls from several threads take turns;
// a job that calls parallel_run again runs that inner job on its own thread only.
void parallel_run(size_t threads, const std::function<void()>& job);

}  // namespace barqtrain::tokenizer
