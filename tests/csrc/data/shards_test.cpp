#include "data/shards.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace barqtrain::data {
namespace {

// Sequence s has s + 1 tokens 1000 * s + j; every third token is masked.
TokenizedData corpus(size_t count, int32_t base = 1000) {
  TokenizedData d;
  for (size_t s = 0; s < count; ++s) {
    for (size_t j = 0; j <= s; ++j) {
      const int32_t t = static_cast<int32_t>(base * s + j);
      d.tokens.push_back(t);
      d.labels.push_back(j % 3 == 0 ? -100 : t);
    }
    d.offsets.push_back(static_cast<int64_t>(d.tokens.size()));
  }
  return d;
}

// The test binary's scratch directory, removed with everything under it when the binary exits.
class ScratchRoot {
 public:
  ScratchRoot() : path_(::testing::TempDir() + "barqtrain-shards-XXXXXX") {
    if (::mkdtemp(path_.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + path_);
  }
  ~ScratchRoot() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchRoot(const ScratchRoot&) = delete;
  ScratchRoot& operator=(const ScratchRoot&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A new empty directory each call (mkdtemp), inside this run's scratch root: a name made from the
// process id could be an earlier run's directory, still holding its files.
std::string fresh_dir(const std::string& name) {
  static const ScratchRoot root;
  std::string dir = root.path() + "/" + name + "-XXXXXX";
  if (::mkdtemp(dir.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + dir);
  return dir;
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') names.push_back(e->d_name);
  }
  ::closedir(d);
  return names;
}

void expect_same(const SequenceSource& source, const TokenizedData& data) {
  ASSERT_EQ(source.size(), data.size());
  ASSERT_EQ(source.num_tokens(), data.tokens.size());
  for (size_t s = 0; s < data.size(); ++s) {
    const size_t n = source.length(s);
    ASSERT_EQ(n, static_cast<size_t>(data.offsets[s + 1] - data.offsets[s]));
    std::vector<int64_t> ids(n), labels(n);
    source.read(s, 0, n, ids.data(), labels.data());
    for (size_t j = 0; j < n; ++j) {
      ASSERT_EQ(ids[j], data.tokens[data.offsets[s] + j]) << "sequence " << s;
      ASSERT_EQ(labels[j], data.labels[data.offsets[s] + j]) << "sequence " << s;
    }
  }
}

TEST(Shards, WrittenShardsReadBackAcrossFilesWithMasksAndBothTokenWidths) {
  for (const size_t id_bound : {size_t{60000}, size_t{200000}}) {
    const std::string dir = fresh_dir("shards-" + std::to_string(id_bound));
    const TokenizedData data = corpus(40, id_bound > 65536 ? 3000 : 1000);
    ShardDirectoryWriter writer(dir, id_bound, 100);  // ~100 tokens a shard: several files
    TokenizedData first, second;
    for (size_t s = 0; s < data.size(); ++s) {
      TokenizedData& part = s < 25 ? first : second;
      for (int64_t i = data.offsets[s]; i < data.offsets[s + 1]; ++i) {
        part.tokens.push_back(data.tokens[i]);
        part.labels.push_back(data.labels[i]);
      }
      part.offsets.push_back(static_cast<int64_t>(part.tokens.size()));
    }
    writer.add(first);
    writer.add(second);
    writer.finish(R"({"note": "test"})");
    EXPECT_GT(writer.shards(), 3u);
    for (const std::string& name : files_in(dir)) EXPECT_EQ(name.find(".tmp"), std::string::npos) << name;
    const auto set = ShardSet::open(dir);
    EXPECT_EQ(set->shards().size(), writer.shards());
    EXPECT_EQ(set->shards()[0]->header().token_bytes, id_bound > 65536 ? 4u : 2u);
    expect_same(*set, data);
    // Reading part of a sequence, as the packer does for split sequences.
    std::vector<int64_t> ids(3), labels(3);
    set->read(39, 10, 3, ids.data(), labels.data());
    EXPECT_EQ(ids[0], data.tokens[data.offsets[39] + 10]);
  }
}

TEST(Shards, AllLearnedTokensNeedNoMaskAndASingleFileOpens) {
  TokenizedData data = corpus(5);
  data.labels = data.tokens;
  const std::string path = fresh_dir("single") + "/one.bqt";
  write_shard(path, data, 2);
  const auto set = ShardSet::open(path);
  EXPECT_EQ(set->shards()[0]->mask(), nullptr);
  expect_same(*set, data);
}

TEST(Shards, BadDataAndBadFilesAreClearErrors) {
  const std::string dir = fresh_dir("bad");
  TokenizedData data = corpus(3);
  data.tokens[1] = 70000;
  data.labels[1] = 70000;
  EXPECT_THROW(write_shard(dir + "/wide.bqt", data, 2), ShardError);
  data = corpus(3);
  data.labels[1] = 5;
  try {
    write_shard(dir + "/labels.bqt", data, 4);
    FAIL() << "a label that is not its token was stored";
  } catch (const ShardError& e) {
    EXPECT_NE(std::string(e.what()).find("neither its token nor -100"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(files_in(dir).empty()) << "a failed write left a file behind";

  write_shard(dir + "/good.bqt", corpus(10), 4);
  std::ifstream in(dir + "/good.bqt", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(dir + "/truncated.bqt", std::ios::binary) << bytes.substr(0, bytes.size() - 8);
  std::ofstream(dir + "/garbage.bqt", std::ios::binary) << "not a shard at all, just text";
  auto message = [](const std::string& path) {
    try {
      ShardSet::open(path);
    } catch (const ShardError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(dir + "/truncated.bqt").find("truncated or corrupt"), std::string::npos);
  EXPECT_NE(message(dir + "/garbage.bqt").find("not a BarqTrain shard"), std::string::npos);
  EXPECT_NE(message(dir).find("no shards.json"), std::string::npos);
  EXPECT_NE(message(dir + "/missing.bqt").find("cannot open"), std::string::npos);

  const std::string done = fresh_dir("done");
  ShardDirectoryWriter writer(done, 1000, 1 << 20);
  writer.add(corpus(3));
  writer.finish("{}");
  EXPECT_THROW(ShardDirectoryWriter(done, 1000, 1 << 20), ShardError);  // holds an earlier run
  EXPECT_THROW(ShardDirectoryWriter(fresh_dir("meta"), 1000, 16).finish("[1, 2"), ShardError);
}

// Sequences [first, last) of data as a chunk of their own.
TokenizedData slice(const TokenizedData& data, size_t first, size_t last) {
  TokenizedData out;
  const int64_t a = data.offsets[first], b = data.offsets[last];
  out.tokens.assign(data.tokens.begin() + a, data.tokens.begin() + b);
  out.labels.assign(data.labels.begin() + a, data.labels.begin() + b);
  for (size_t s = first; s < last; ++s) out.offsets.push_back(data.offsets[s + 1] - a);
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(Shards, WhereShardsEndDoesNotDependOnHowTheSequencesWereAdded) {
  TokenizedData data = corpus(40);
  data.offsets.insert(data.offsets.begin() + 11, data.offsets[10]);  // an empty sequence after sequence 9
  const std::string whole = fresh_dir("whole"), pieces = fresh_dir("pieces");
  ShardDirectoryWriter a(whole, 100000, 55);  // sequence 9 ends exactly at 55 tokens: a full shard
  a.add(data);
  a.finish("{}");
  ShardDirectoryWriter b(pieces, 100000, 55);
  for (size_t s = 0; s < data.size(); s += 5) b.add(slice(data, s, std::min(data.size(), s + 5)));  // a chunk ends at 9
  b.finish("{}");
  ASSERT_EQ(a.shards(), b.shards());
  for (size_t k = 0; k < a.shards(); ++k) {
    char name[32];
    std::snprintf(name, sizeof(name), "/shard-%05zu.bqt", k);
    EXPECT_EQ(read_file(whole + name), read_file(pieces + name)) << name;
  }
}

TEST(Shards, AWriterContinuesAnInterruptedRunAfterItsCompleteShards) {
  const TokenizedData data = corpus(40);
  const std::string whole = fresh_dir("resume-whole"), cut = fresh_dir("resume-cut");
  ShardDirectoryWriter a(whole, 1000, 100);
  a.add(data);
  a.finish("{}");
  // The interrupted run wrote three shards and had started a fourth when it was killed.
  size_t kept_sequences = 0;
  {
    ShardDirectoryWriter b(cut, 1000, 100);
    for (size_t s = 0; b.shards() < 4; ++s) b.add(slice(data, s, s + 1));
    kept_sequences = ShardSet::open(cut + "/shard-00000.bqt")->size() + ShardSet::open(cut + "/shard-00001.bqt")->size() +
                     ShardSet::open(cut + "/shard-00002.bqt")->size();
    std::ofstream(cut + "/shard-00004.bqt.tmp.99") << "half written";
  }
  EXPECT_THROW(ShardDirectoryWriter(cut, 1000, 100), ShardError);  // holds shards: not a fresh run
  ShardDirectoryWriter resumed(cut, 1000, 100, 3);
  EXPECT_EQ(resumed.sequences(), kept_sequences);
  const auto names = files_in(cut);
  EXPECT_EQ(std::count(names.begin(), names.end(), "shard-00003.bqt"), 0);  // rewritten from the sequences
  EXPECT_EQ(std::count(names.begin(), names.end(), "shard-00004.bqt.tmp.99"), 0);
  resumed.add(slice(data, kept_sequences, data.size()));
  resumed.finish("{}");
  ASSERT_EQ(resumed.shards(), a.shards());
  for (size_t k = 0; k < a.shards(); ++k) {
    char name[32];
    std::snprintf(name, sizeof(name), "/shard-%05zu.bqt", k);
    EXPECT_EQ(read_file(whole + name), read_file(cut + name)) << name;
  }
  EXPECT_THROW(ShardDirectoryWriter(cut, 1000, 100, 3), ShardError);  // finished: shards.json is there
  EXPECT_THROW(ShardDirectoryWriter(fresh_dir("resume-none"), 1000, 100, 1), ShardError);  // no shard 0
  const std::string narrow = fresh_dir("resume-narrow");
  ShardDirectoryWriter(narrow, 1000, 100).add(data);  // 2-byte ids; never finished
  EXPECT_THROW(ShardDirectoryWriter(narrow, 100000, 100, 1), ShardError);  // a tokenizer needing 4 bytes
}

TEST(Shards, PackingShardsGivesTheSameRowsAsPackingTheArrays) {
  const std::string dir = fresh_dir("pack");
  const TokenizedData data = corpus(60);
  ShardDirectoryWriter writer(dir, 100000, 300);
  writer.add(data);
  writer.finish("{}");
  PackOptions options;
  options.seq_length = 64;
  options.seed = 3;
  const Packer from_shards(ShardSet::open(dir), options);
  const Packer from_memory(data.tokens.data(), data.labels.data(), data.offsets.data(), data.size(), options);
  ASSERT_EQ(from_shards.num_rows(), from_memory.num_rows());
  const size_t n = from_shards.num_rows() * 64;
  std::vector<int64_t> a(3 * n), b(3 * n);
  const CollateInfo ia = from_shards.collate(0, from_shards.num_rows(), {a.data(), a.data() + n, a.data() + 2 * n});
  const CollateInfo ib = from_memory.collate(0, from_memory.num_rows(), {b.data(), b.data() + n, b.data() + 2 * n});
  EXPECT_EQ(a, b);
  EXPECT_EQ(ia.cu_seqlens, ib.cu_seqlens);
}

}  // namespace
}  // namespace barqtrain::data
