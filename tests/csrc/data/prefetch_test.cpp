#include "data/prefetch.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

namespace barqtrain::data {
namespace {

// Sequences of known lengths; read() can be slowed down or made to fail at one sequence.
class TestSource final : public SequenceSource {
 public:
  explicit TestSource(size_t count) : count_(count) {}
  size_t size() const override { return count_; }
  size_t num_tokens() const override { return count_ * 10; }
  size_t length(size_t) const override { return 10; }
  void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const override {
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms.load()));
    if (static_cast<int64_t>(sequence) == fail_at) throw std::runtime_error("disk error at sequence " + std::to_string(sequence));
    for (size_t j = 0; j < count; ++j) ids[j] = labels[j] = static_cast<int64_t>(sequence * 100 + start + j);
  }
  std::atomic<int> delay_ms{0};
  std::atomic<int64_t> fail_at{-1};

 private:
  size_t count_;
};

struct Fixture {
  std::shared_ptr<TestSource> source = std::make_shared<TestSource>(50);
  std::shared_ptr<Packer> packer;
  Fixture() {
    PackOptions o;
    o.seq_length = 32;  // three sequences a row
    o.seed = 5;
    packer = std::make_shared<Packer>(source, o);
  }
};

struct Buffers {
  std::vector<int64_t> ids, labels, pos;
  explicit Buffers(size_t n) : ids(n, -1), labels(n, -1), pos(n, -1) {}
  RowBuffers rows() { return {ids.data(), labels.data(), pos.data()}; }
};

TEST(Prefetch, BatchesMatchCollateInOrderWithEveryWorkerCount) {
  Fixture f;
  const size_t batch_size = 3, L = 32;
  for (const size_t workers : {size_t{1}, size_t{3}}) {
    Prefetcher prefetch(f.packer, batch_size, workers, 4);
    const size_t batches = prefetch.num_batches(false);
    ASSERT_EQ(batches, (f.packer->num_rows() + 2) / 3);
    std::vector<std::unique_ptr<Buffers>> buffers(batches);
    size_t submitted = 0;
    for (size_t b = 0; b < batches; ++b) {
      while (submitted < batches && submitted < b + 4) {
        buffers[submitted] = std::make_unique<Buffers>(prefetch.rows_in(submitted) * L);
        prefetch.submit(submitted, buffers[submitted]->rows());
        ++submitted;
      }
      const CollateInfo info = prefetch.take(b);
      Buffers expected(prefetch.rows_in(b) * L);
      const size_t first = b * batch_size;
      const CollateInfo want = f.packer->collate(first, first + prefetch.rows_in(b), expected.rows());
      EXPECT_EQ(buffers[b]->ids, expected.ids) << "batch " << b;
      EXPECT_EQ(buffers[b]->pos, expected.pos);
      EXPECT_EQ(info.cu_seqlens, want.cu_seqlens);
    }
  }
}

TEST(Prefetch, DepthBoundsWhatIsSubmittedAndMisuseIsAnError) {
  Fixture f;
  Buffers a(64), b(64), c(64);  // before the prefetcher: its workers may write them until it is destroyed
  Prefetcher prefetch(f.packer, 2, 1, 2);
  prefetch.submit(0, a.rows());
  EXPECT_THROW(prefetch.submit(0, a.rows()), PrefetchError);  // twice
  prefetch.submit(1, b.rows());
  EXPECT_THROW(prefetch.submit(2, c.rows()), PrefetchError);  // past the depth
  EXPECT_THROW(prefetch.take(5), PrefetchError);             // never submitted
  EXPECT_THROW(prefetch.rows_in(1000), PrefetchError);
  prefetch.take(0);
  prefetch.submit(2, c.rows());
  EXPECT_EQ(prefetch.outstanding(), 2u);
  EXPECT_THROW(Prefetcher(f.packer, 0, 1, 1), PrefetchError);
}

TEST(Prefetch, AWorkerErrorReachesTakeAndCloseStopsBusyWorkers) {
  Fixture f;
  f.source->fail_at = static_cast<int64_t>(f.packer->row_begin(0)->sequence);
  Prefetcher prefetch(f.packer, 1, 2, 2);
  Buffers a(32), b(32);
  prefetch.submit(0, a.rows());
  prefetch.submit(1, b.rows());
  EXPECT_THROW(prefetch.take(0), std::runtime_error);
  prefetch.take(1);  // the other batch is fine
  f.source->fail_at = -1;

  f.source->delay_ms = 30;
  Buffers c(32);
  prefetch.submit(2, c.rows());
  int polls = 0;
  EXPECT_THROW(prefetch.take(2, [&] { return ++polls >= 1; }), PrefetchError);  // interrupted (Ctrl-C)
  const auto t0 = std::chrono::steady_clock::now();
  prefetch.close();  // waits for the batch in progress, then joins
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_THROW(prefetch.submit(3, c.rows()), PrefetchError);
}

TEST(Prefetch, AForkedChildGetsAClearErrorAndExitsCleanly) {
  Fixture f;
  auto prefetch = std::make_unique<Prefetcher>(f.packer, 2, 2, 2);
  Buffers a(64);
  prefetch->submit(0, a.rows());
  const pid_t child = ::fork();
  if (child == 0) {
    int code = 1;
    try {
      prefetch->take(0);
    } catch (const PrefetchError& e) {
      code = std::string(e.what()).find("forked process") != std::string::npos ? 0 : 2;
    }
    prefetch.reset();  // must neither hang on the parent's threads nor abort
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  prefetch->take(0);  // the parent's prefetcher is untouched
}

}  // namespace
}  // namespace barqtrain::data
