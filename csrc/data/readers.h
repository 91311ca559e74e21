// Dataset readers: JSONL (memory-mapped, a line at a time), JSON arrays and plain text, in
// the formats raw text, alpaca (instruction/input/output) and chat messages; each record is
// tokenized with the prompt masked out of the loss (-100) and EOS appended.
//
//   ReadOptions options;  options.format = RecordFormat::kAlpaca;  options.eos_id = 128001;
//   TokenizedData data;
//   ReadReport report = read_dataset("train.jsonl", options, tokenizer, data);
//
// A malformed line or record is a ReaderError naming the file and line (JSONL, text) or
// record (JSON arrays); with OnError::kSkip it is counted in the report instead, with the
// first messages kept, and reading goes on. Nothing is dropped without being counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "data/json.h"

namespace barqtrain::tokenizer {
class Tokenizer;
}

namespace barqtrain::data {

class ReaderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class FileKind { kAuto, kJsonl, kJson, kText };
enum class RecordFormat { kText, kAlpaca, kMessages };
enum class OnError { kRaise, kSkip };
enum class TextUnit { kLine, kDocument };  // plain text: one record per non-empty line, or per file

FileKind parse_file_kind(const std::string& name);  // "auto", "jsonl", "json", "text"
RecordFormat parse_record_format(const std::string& name);  // "text", "alpaca", "messages"
OnError parse_on_error(const std::string& name);  // "raise", "skip"

struct ReadOptions {
  FileKind kind = FileKind::kAuto;  // kAuto: by extension (.jsonl/.ndjson, .json, else text)
  RecordFormat format = RecordFormat::kText;
  OnError on_error = OnError::kRaise;
  TextUnit text_unit = TextUnit::kLine;
  std::string text_field = "text";         // the field of a JSON record in the text format
  std::string chat_template = "chatml";    // built in: "chatml", "llama3"
  int64_t eos_id = -1;                     // appended to every example (trained); -1: none
  bool add_special_tokens = true;          // the post-processor's tokens (BOS) on the first segment
  size_t max_reported_errors = 20;
  size_t chunk_records = 4096;  // records tokenized together (on every core)
  size_t num_threads = 0;       // for the tokenizer; 0: every core
};

// Text pieces of one example and whether the model learns each.
struct Example {
  std::vector<std::pair<std::string, bool>> segments;
};

// Renders one JSON record in a format; a ReaderError names what is wrong with it.
Example render_record(const json::Value& record, const ReadOptions& options);

// Checks that a chat template is built in; the error says what is and what is not.
void check_chat_template(const std::string& name);

struct TokenizedData {
  std::vector<int32_t> tokens;
  std::vector<int32_t> labels;  // -100 where the loss is masked
  std::vector<int64_t> offsets{0};
  size_t size() const { return offsets.size() - 1; }
};

struct ReadReport {
  std::string path;
  size_t records = 0;  // examples appended
  size_t skipped = 0;  // malformed lines/records skipped (OnError::kSkip)
  std::vector<std::string> errors;  // the first max_reported_errors messages
};

// Reads, renders and tokenizes every record of path, appending to out.
ReadReport read_dataset(const std::string& path, const ReadOptions& options, const tokenizer::Tokenizer& tokenizer,
                        TokenizedData& out);

}  // namespace barqtrain::data
