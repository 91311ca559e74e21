// Pre-tokenized shards: tokenized sequences on disk in a compact binary format, written
// atomically and memory-mapped back, so training reads them without tokenizing again and
// without loading them into RAM.
//
//   ShardDirectoryWriter writer("out/", id_bound, 1 << 26);   // at most 2^26 tokens a shard
//   writer.add(chunk);                                          // TokenizedData, as readers make
//   writer.finish(R"({"tokenizer": "..."})");                   // the last shard, then shards.json
//   auto shards = ShardSet::open("out/");                       // a SequenceSource for the Packer
//
// A shard file (little-endian; every section starts on a 64-byte boundary):
//   header   64 bytes, ShardHeader below
//   offsets  int64[sequences + 1]: sequence i is tokens [offsets[i], offsets[i + 1])
//   tokens   uint16 or uint32 [tokens] (token_bytes: 2 when every id of the tokenizer fits)
//   mask     uint8[tokens], 1 where the token is learned (its label is the token), 0 where the
//            loss is masked (-100); absent when every token is learned (has_mask = 0)
//
// A directory holds shard-NNNNN.bqt files and shards.json, which lists them with their
// counts and carries the writer's metadata (tokenizer, format, sources). Every file is
// written to a temporary name, fsynced and renamed, and shards.json comes last: a directory
// with shards.json is complete, one without it is an error when opened.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/packing.h"
#include "data/readers.h"

namespace barqtrain::data {

class ShardError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

constexpr char kShardMagic[8] = {'B', 'Q', 'T', 'S', 'H', 'A', 'R', 'D'};
constexpr uint32_t kShardVersion = 1;
constexpr const char* kShardManifest = "shards.json";

struct ShardHeader {
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;  // 2 or 4
  uint32_t has_mask;     // 0 or 1
  uint32_t reserved;     // 0
  uint64_t sequences;
  uint64_t tokens;
  uint64_t offsets_at;  // byte offsets of the sections in the file
  uint64_t tokens_at;
  uint64_t mask_at;  // 0 without a mask
};
static_assert(sizeof(ShardHeader) == 64, "the shard header is 64 bytes on disk");

// 2 when every id below id_bound fits in uint16, else 4.
uint32_t token_bytes_for(size_t id_bound);

// Writes data as one shard file at path, atomically (temporary file, fsync, rename, fsync of
// the directory). A token >= 2^(8 * token_bytes) or a label other than its token or -100 is a
// ShardError. Returns the bytes written.
uint64_t write_shard(const std::string& path, const TokenizedData& data, uint32_t token_bytes);

// Cuts tokenized chunks into shards of at most shard_tokens tokens (a longer sequence gets a
// shard of its own) and writes them into a directory. Where a shard ends depends only on the
// sequences, never on how they were split into add() calls, so a rerun that adds the same
// sequences after the shards it kept writes the same files.
class ShardDirectoryWriter {
 public:
  // The directory is created if missing. With complete_shards 0 it must hold no shards.json
  // or shard files yet. With complete_shards k > 0 the writer continues an interrupted run:
  // shard-00000 .. shard-(k-1) are kept (opened and checked, and their width must be this
  // tokenizer's), later shard files and temporaries are deleted, and the next add() starts
  // shard k; a shards.json there is an error (the run finished).
  ShardDirectoryWriter(std::string directory, size_t id_bound, size_t shard_tokens, size_t complete_shards = 0);
  void add(const TokenizedData& chunk);
  // Writes the pending shard and then shards.json with metadata_json (a JSON object) under
  // "metadata". No add() after it.
  void finish(const std::string& metadata_json);

  size_t sequences() const { return sequences_ + pending_.size(); }  // added so far
  size_t tokens() const { return tokens_ + pending_.tokens.size(); }
  size_t shards() const { return files_.size(); }
  size_t sequences_in_shards() const { return sequences_; }  // in the shard files written so far
  uint64_t bytes_written() const { return bytes_; }

 private:
  void flush();

  std::string directory_;
  uint32_t token_bytes_;
  size_t shard_tokens_;
  TokenizedData pending_;
  struct File {
    std::string name;
    size_t sequences, tokens;
  };
  std::vector<File> files_;
  size_t sequences_ = 0, tokens_ = 0;  // in the shards written
  uint64_t bytes_ = 0;
  bool finished_ = false;
};

// One memory-mapped shard file, validated on open (magic, version, sizes, offsets).
template <typename Error>
class MappedFile;

class Shard {
 public:
  explicit Shard(const std::string& path);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const std::string& path() const { return path_; }
  const ShardHeader& header() const { return header_; }
  size_t size() const { return header_.sequences; }
  size_t num_tokens() const { return header_.tokens; }
  const int64_t* offsets() const { return offsets_; }
  const void* tokens() const { return tokens_; }  // uint16 or uint32 (header().token_bytes)
  const uint8_t* mask() const { return mask_; }   // nullptr: every token is learned
  void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile<ShardError>> file_;
  ShardHeader header_{};
  const int64_t* offsets_ = nullptr;
  const void* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;
};

// The shards of a directory (in shards.json's order) or a single shard file, as one
// SequenceSource: sequence numbers run on from one shard to the next.
class ShardSet final : public SequenceSource {
 public:
  static std::shared_ptr<ShardSet> open(const std::string& path);
  ShardSet(const ShardSet&) = delete;
  ShardSet& operator=(const ShardSet&) = delete;

  size_t size() const override { return starts_.back(); }
  size_t num_tokens() const override { return tokens_; }
  size_t length(size_t sequence) const override;
  void read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const override;

  const std::vector<std::unique_ptr<Shard>>& shards() const { return shards_; }

 private:
  ShardSet() = default;
  size_t locate(size_t sequence, size_t* local) const;

  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<size_t> starts_{0};  // shard k holds sequences [starts_[k], starts_[k + 1])
  size_t tokens_ = 0;
};

}  // namespace barqtrain::data
