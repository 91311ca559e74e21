#include "data/shards.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "data/json.h"
#include "data/mapped_file.h"

namespace barqtrain::data {
namespace {

constexpr uint64_t kAlign = 64;

uint64_t align_up(uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string system_error(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string parent_directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string join(const std::string& directory, const std::string& name) {
  return !directory.empty() && directory.back() == '/' ? directory + name : directory + "/" + name;
}

// Writes bytes to a temporary file beside path, fsyncs it, renames it over path and fsyncs
// the directory, so path holds either nothing or everything, even across a crash.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)) {
    temp_ = path_ + ".tmp." + std::to_string(::getpid());
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw ShardError(system_error(temp_ + ": cannot create"));
  }
  ~AtomicFile() {
    if (fd_ >= 0) {  // not committed: an error left it half written
      ::close(fd_);
      ::unlink(temp_.c_str());
    }
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw ShardError(system_error(temp_ + ": cannot write"));
      }
      p += n;
      size -= static_cast<size_t>(n);
      written_ += static_cast<uint64_t>(n);
    }
  }
  void pad_to(uint64_t offset) {
    static const char zeros[kAlign] = {};
    while (written_ < offset) write(zeros, std::min<uint64_t>(kAlign, offset - written_));
  }
  uint64_t written() const { return written_; }

  void commit() {
    if (::fsync(fd_) != 0) throw ShardError(system_error(temp_ + ": cannot fsync"));
    if (::close(fd_) != 0) {
      fd_ = -1;
      ::unlink(temp_.c_str());
      throw ShardError(system_error(temp_ + ": cannot close"));
    }
    fd_ = -1;
    if (::rename(temp_.c_str(), path_.c_str()) != 0) {
      const std::string message = system_error(temp_ + ": cannot rename to " + path_);
      ::unlink(temp_.c_str());
      throw ShardError(message);
    }
    const std::string directory = parent_directory(path_);
    const int dir = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) throw ShardError(system_error(directory + ": cannot open to fsync"));
    const int rc = ::fsync(dir);
    ::close(dir);
    if (rc != 0) throw ShardError(system_error(directory + ": cannot fsync"));
  }

 private:
  std::string path_, temp_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

std::string shard_name(size_t index) {
  char name[32];
  std::snprintf(name, sizeof(name), "shard-%05zu.bqt", index);
  return name;
}

bool is_shard_name(const std::string& name) {
  if (name.size() <= 10 || name.compare(0, 6, "shard-") != 0 || name.compare(name.size() - 4, 4, ".bqt") != 0) {
    return false;
  }
  return std::all_of(name.begin() + 6, name.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
}

// The NNNNN of shard-NNNNN.bqt (is_shard_name(name) holds).
size_t shard_index(const std::string& name) { return std::stoull(name.substr(6, name.size() - 10)); }

}  // namespace

uint32_t token_bytes_for(size_t id_bound) { return id_bound <= 65536 ? 2 : 4; }

uint64_t write_shard(const std::string& path, const TokenizedData& data, uint32_t token_bytes) {
  if (token_bytes != 2 && token_bytes != 4) throw ShardError("token_bytes must be 2 or 4");
  const size_t n = data.tokens.size();
  if (data.labels.size() != n) throw ShardError("labels and tokens differ in length");
  if (data.offsets.empty() || data.offsets.front() != 0 || static_cast<size_t>(data.offsets.back()) != n) {
    throw ShardError("offsets must run from 0 to the number of tokens");
  }
  const uint64_t limit = token_bytes == 2 ? 65536 : 4294967296ull;
  bool has_mask = false;
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = data.tokens[i], l = data.labels[i];
    if (t < 0 || static_cast<uint64_t>(t) >= limit) {
      throw ShardError(path + ": token " + std::to_string(t) + " does not fit a " + std::to_string(token_bytes) +
                       "-byte token id");
    }
    if (l == -100) {
      has_mask = true;
    } else if (l != t) {
      throw ShardError(path + ": label " + std::to_string(l) + " at token " + std::to_string(i) +
                       " is neither its token nor -100; a shard stores labels as a mask of the tokens");
    }
  }
  ShardHeader h{};
  std::memcpy(h.magic, kShardMagic, sizeof(h.magic));
  h.version = kShardVersion;
  h.token_bytes = token_bytes;
  h.has_mask = has_mask ? 1 : 0;
  h.sequences = data.size();
  h.tokens = n;
  h.offsets_at = align_up(sizeof(ShardHeader));
  h.tokens_at = align_up(h.offsets_at + data.offsets.size() * sizeof(int64_t));
  h.mask_at = has_mask ? align_up(h.tokens_at + n * token_bytes) : 0;

  AtomicFile file(path);
  file.write(&h, sizeof(h));
  file.pad_to(h.offsets_at);
  file.write(data.offsets.data(), data.offsets.size() * sizeof(int64_t));
  file.pad_to(h.tokens_at);
  constexpr size_t kBlock = 1 << 16;  // converted a block at a time
  if (token_bytes == 2) {
    std::vector<uint16_t> block;
    for (size_t i = 0; i < n; i += kBlock) {
      block.assign(data.tokens.begin() + i, data.tokens.begin() + std::min(n, i + kBlock));
      file.write(block.data(), block.size() * 2);
    }
  } else {
    file.write(data.tokens.data(), n * 4);  // non-negative int32 has the uint32 bytes
  }
  if (has_mask) {
    file.pad_to(h.mask_at);
    std::vector<uint8_t> block;
    for (size_t i = 0; i < n; i += kBlock) {
      block.clear();
      for (size_t j = i; j < std::min(n, i + kBlock); ++j) block.push_back(data.labels[j] != -100);
      file.write(block.data(), block.size());
    }
  }
  const uint64_t bytes = file.written();
  file.commit();
  return bytes;
}

ShardDirectoryWriter::ShardDirectoryWriter(std::string directory, size_t id_bound, size_t shard_tokens,
                                           size_t complete_shards)
    : directory_(std::move(directory)), token_bytes_(token_bytes_for(id_bound)), shard_tokens_(shard_tokens) {
  if (shard_tokens_ == 0) throw ShardError("shard_tokens must be at least 1");
  if (::mkdir(directory_.c_str(), 0755) != 0 && errno != EEXIST) {
    throw ShardError(system_error(directory_ + ": cannot create the directory"));
  }
  DIR* dir = ::opendir(directory_.c_str());
  if (dir == nullptr) throw ShardError(system_error(directory_ + ": cannot open the directory"));
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(dir)) names.emplace_back(entry->d_name);
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    if (name == kShardManifest) {
      throw ShardError(directory_ + ": already holds " + name + " from an earlier, finished run; write to an empty directory");
    }
  }
  if (complete_shards == 0) {
    for (const std::string& name : names) {
      if (is_shard_name(name)) {
        throw ShardError(directory_ + ": already holds " + name + " from an earlier run; write to an empty directory");
      }
    }
    return;
  }
  for (size_t k = 0; k < complete_shards; ++k) {
    const Shard shard(join(directory_, shard_name(k)));
    if (shard.header().token_bytes != token_bytes_) {
      throw ShardError(shard.path() + ": holds " + std::to_string(shard.header().token_bytes) +
                       "-byte token ids, but this tokenizer's need " + std::to_string(token_bytes_));
    }
    files_.push_back({shard_name(k), shard.size(), shard.num_tokens()});
    sequences_ += shard.size();
    tokens_ += shard.num_tokens();
  }
  for (const std::string& name : names) {
    // The interrupted run's later shards (rewritten from the same sequences) and temporaries.
    const bool later_shard = is_shard_name(name) && shard_index(name) >= complete_shards;
    const bool temporary = (name.rfind("shard-", 0) == 0 || name.rfind(kShardManifest, 0) == 0) &&
                           name.find(".tmp.") != std::string::npos;
    if ((later_shard || temporary) && ::unlink(join(directory_, name).c_str()) != 0) {
      throw ShardError(system_error(join(directory_, name) + ": cannot delete"));
    }
  }
}

void ShardDirectoryWriter::add(const TokenizedData& chunk) {
  if (finished_) throw ShardError("ShardDirectoryWriter::add after finish");
  for (size_t s = 0; s < chunk.size(); ++s) {
    const int64_t a = chunk.offsets[s], b = chunk.offsets[s + 1];
    // A full shard closes before the next sequence, even an empty one, exactly as the check
    // after the loop closes it at the end of a chunk.
    if (pending_.size() > 0 && (pending_.tokens.size() >= shard_tokens_ ||
                                pending_.tokens.size() + static_cast<size_t>(b - a) > shard_tokens_)) {
      flush();
    }
    pending_.tokens.insert(pending_.tokens.end(), chunk.tokens.begin() + a, chunk.tokens.begin() + b);
    pending_.labels.insert(pending_.labels.end(), chunk.labels.begin() + a, chunk.labels.begin() + b);
    pending_.offsets.push_back(static_cast<int64_t>(pending_.tokens.size()));
  }
  if (pending_.tokens.size() >= shard_tokens_) flush();
}

void ShardDirectoryWriter::flush() {
  if (pending_.size() == 0) return;
  const std::string name = shard_name(files_.size());
  bytes_ += write_shard(join(directory_, name), pending_, token_bytes_);
  files_.push_back({name, pending_.size(), pending_.tokens.size()});
  sequences_ += pending_.size();
  tokens_ += pending_.tokens.size();
  pending_ = TokenizedData{};
}

void ShardDirectoryWriter::finish(const std::string& metadata_json) {
  if (finished_) throw ShardError("ShardDirectoryWriter::finish called twice");
  try {
    if (!json::parse(metadata_json).is_object()) throw ShardError("the shard metadata must be a JSON object");
  } catch (const json::JsonError& e) {
    throw ShardError(std::string("the shard metadata is not valid JSON: ") + e.what());
  }
  flush();
  finished_ = true;
  std::string manifest = "{\n  \"format\": \"barqtrain-shards\",\n  \"version\": " + std::to_string(kShardVersion) +
                         ",\n  \"sequences\": " + std::to_string(sequences_) + ",\n  \"tokens\": " +
                         std::to_string(tokens_) + ",\n  \"token_bytes\": " + std::to_string(token_bytes_) +
                         ",\n  \"shards\": [";
  for (size_t i = 0; i < files_.size(); ++i) {
    manifest += std::string(i ? "," : "") + "\n    {\"file\": \"" + files_[i].name + "\"" +
                ", \"sequences\": " + std::to_string(files_[i].sequences) +
                ", \"tokens\": " + std::to_string(files_[i].tokens) + "}";
  }
  manifest += "\n  ],\n  \"metadata\": " + metadata_json + "\n}\n";
  AtomicFile file(join(directory_, kShardManifest));
  file.write(manifest.data(), manifest.size());
  bytes_ += file.written();
  file.commit();
}

Shard::Shard(const std::string& path) : path_(path), file_(std::make_unique<MappedFile<ShardError>>(path, MADV_RANDOM)) {
  const std::string_view bytes = file_->view();
  if (bytes.size() < sizeof(ShardHeader) || std::memcmp(bytes.data(), kShardMagic, sizeof(kShardMagic)) != 0) {
    throw ShardError(path + ": not a BarqTrain shard (no BQTSHARD header)");
  }
  std::memcpy(&header_, bytes.data(), sizeof(ShardHeader));
  const ShardHeader& h = header_;
  if (h.version != kShardVersion) {
    throw ShardError(path + ": shard format version " + std::to_string(h.version) + "; this BarqTrain reads version " +
                     std::to_string(kShardVersion));
  }
  if ((h.token_bytes != 2 && h.token_bytes != 4) || h.has_mask > 1) {
    throw ShardError(path + ": corrupt header (token_bytes " + std::to_string(h.token_bytes) + ", has_mask " +
                     std::to_string(h.has_mask) + ")");
  }
  auto section_fits = [&](uint64_t at, uint64_t count, uint64_t size, uint64_t align) {
    return at % align == 0 && at >= sizeof(ShardHeader) && at <= bytes.size() && count <= (bytes.size() - at) / size;
  };
  if (!section_fits(h.offsets_at, h.sequences + 1, 8, 8) || !section_fits(h.tokens_at, h.tokens, h.token_bytes, h.token_bytes) ||
      (h.has_mask && !section_fits(h.mask_at, h.tokens, 1, 1))) {
    throw ShardError(path + ": truncated or corrupt: its sections run past the end of the file (" +
                     std::to_string(bytes.size()) + " bytes)");
  }
  offsets_ = reinterpret_cast<const int64_t*>(bytes.data() + h.offsets_at);
  tokens_ = bytes.data() + h.tokens_at;
  mask_ = h.has_mask ? reinterpret_cast<const uint8_t*>(bytes.data() + h.mask_at) : nullptr;
  if (offsets_[0] != 0 || static_cast<uint64_t>(offsets_[h.sequences]) != h.tokens) {
    throw ShardError(path + ": corrupt offsets (they must run from 0 to " + std::to_string(h.tokens) + ")");
  }
  for (uint64_t i = 0; i < h.sequences; ++i) {
    if (offsets_[i + 1] < offsets_[i]) {
      throw ShardError(path + ": corrupt offsets (offset " + std::to_string(i + 1) + " decreases)");
    }
  }
}

Shard::~Shard() = default;

void Shard::read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const {
  const size_t at = static_cast<size_t>(offsets_[sequence]) + start;
  if (header_.token_bytes == 2) {
    const uint16_t* t = static_cast<const uint16_t*>(tokens_) + at;
    for (size_t j = 0; j < count; ++j) ids[j] = t[j];
  } else {
    const uint32_t* t = static_cast<const uint32_t*>(tokens_) + at;
    for (size_t j = 0; j < count; ++j) ids[j] = t[j];
  }
  if (mask_ == nullptr) {
    std::copy(ids, ids + count, labels);
  } else {
    const uint8_t* m = mask_ + at;
    for (size_t j = 0; j < count; ++j) labels[j] = m[j] ? ids[j] : -100;
  }
}

std::shared_ptr<ShardSet> ShardSet::open(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw ShardError(system_error(path + ": cannot open"));
  std::shared_ptr<ShardSet> set(new ShardSet());
  if (!S_ISDIR(st.st_mode)) {
    set->shards_.push_back(std::make_unique<Shard>(path));
  } else {
    const std::string manifest_path = join(path, kShardManifest);
    if (::access(manifest_path.c_str(), F_OK) != 0) {
      throw ShardError(path + ": no " + std::string(kShardManifest) +
                       ": not a `barqtrain tokenize` output directory, or its run did not finish (rerun the same "
                       "`barqtrain tokenize` command to finish it)");
    }
    json::Value manifest;
    try {
      manifest = json::parse_file(manifest_path);
      if (manifest.find("format") == nullptr || manifest.find("format")->as_string() != "barqtrain-shards") {
        throw ShardError(manifest_path + ": not a BarqTrain shard manifest (no \"format\": \"barqtrain-shards\")");
      }
      const int64_t version = manifest.find("version") ? manifest.find("version")->as_integer() : -1;
      if (version != kShardVersion) {
        throw ShardError(manifest_path + ": shard format version " + std::to_string(version) +
                         "; this BarqTrain reads version " + std::to_string(kShardVersion));
      }
      const json::Value* shards = manifest.find("shards");
      if (shards == nullptr) throw ShardError(manifest_path + ": no \"shards\" list");
      for (const json::Value& entry : shards->as_array()) {
        const json::Value* file = entry.find("file");
        const json::Value* sequences = entry.find("sequences");
        const json::Value* tokens = entry.find("tokens");
        if (file == nullptr || sequences == nullptr || tokens == nullptr) {
          throw ShardError(manifest_path + ": a shard entry lacks file, sequences or tokens");
        }
        auto shard = std::make_unique<Shard>(join(path, file->as_string()));
        if (static_cast<int64_t>(shard->size()) != sequences->as_integer() ||
            static_cast<int64_t>(shard->num_tokens()) != tokens->as_integer()) {
          throw ShardError(shard->path() + ": holds " + std::to_string(shard->size()) + " sequences and " +
                           std::to_string(shard->num_tokens()) + " tokens, but " + kShardManifest + " says " +
                           std::to_string(sequences->as_integer()) + " and " + std::to_string(tokens->as_integer()) +
                           ": the directory mixes files of different runs");
        }
        set->shards_.push_back(std::move(shard));
      }
    } catch (const json::JsonError& e) {
      throw ShardError(manifest_path + ": " + e.what());
    }
  }
  for (const auto& shard : set->shards_) {
    set->starts_.push_back(set->starts_.back() + shard->size());
    set->tokens_ += shard->num_tokens();
  }
  return set;
}

size_t ShardSet::locate(size_t sequence, size_t* local) const {
  // The last shard starting at or before the sequence.
  const size_t k = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), sequence) - starts_.begin()) - 1;
  *local = sequence - starts_[k];
  return k;
}

size_t ShardSet::length(size_t sequence) const {
  size_t local;
  const Shard& shard = *shards_[locate(sequence, &local)];
  return static_cast<size_t>(shard.offsets()[local + 1] - shard.offsets()[local]);
}

void ShardSet::read(size_t sequence, size_t start, size_t count, int64_t* ids, int64_t* labels) const {
  size_t local;
  shards_[locate(sequence, &local)]->read(local, start, count, ids, labels);
}

}  // namespace barqtrain::data
