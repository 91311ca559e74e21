// The decoders of SentencePiece-style tokenizers (Replace, ByteFallback, Fuse, Strip,
// Metaspace and Sequences of them), which work on token strings as Hugging Face's
// decode_chain does: each step maps the list of token strings to a new list, and the
// result is their concatenation. (ByteLevel decoding lives with the BPE model.)
#pragma once

#include <string>
#include <vector>

#include "data/json.h"
#include "data/tokenizer/pre_tokenizer.h"

namespace barqtrain::tokenizer {

class DecoderChain {
 public:
  // Reads a tokenizer.json "decoder"; throws TokenizerError naming anything unsupported.
  explicit DecoderChain(const json::Value& config);

  std::string decode(std::vector<std::string> tokens) const;

 private:
  struct Step {
    enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
    std::string pattern;  // kReplace
    std::string content;  // kReplace: the replacement; kStrip: the character stripped
    size_t start = 0, stop = 0;  // kStrip: at most this many characters from each end
    Metaspace metaspace;         // kMetaspace
  };
  void read(const json::Value& config);

  std::vector<Step> steps_;
};

}  // namespace barqtrain::tokenizer
