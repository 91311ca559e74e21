// Dataset readers: JSONL (memory-mapped, a line at a time), JSON arrays and plain text, in
// the formats raw text, alpaca (instruction/input/output) and chat messages; each record is
// tokenized with the prompt masked out of the loss (-100) and EOS appended. Chat messages are
// rendered by a built-in template (chatml, llama3) or by a ChatRenderer: the model's own
// Jinja template, rendered in Python a chunk of records at a time, then tokenized here.
//
//   ReadOptions options;  options.format = RecordFormat::kAlpaca;  options.eos_id = 128001;
//   TokenizedData data;
//   ReadReport report = read_dataset("train.jsonl", options, tokenizer, data);
//
// A malformed line or record is a ReaderError naming the file and line (JSONL, text) or
// record (JSON arrays); with OnError::kSkip it is counted in the report instead, with the
// first messages kept, and reading goes on. Nothing is dropped without being counted.
//
// RecordStream reads the same a chunk of records at a time, with a position that can be
// saved and sought back to: a file larger than RAM streams through the page cache, and a
// stopped job continues with exactly the records that would have come next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
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

// A conversation rendered outside C++: the text, tokenized whole (as transformers tokenizes
// apply_chat_template's rendering: no post-processor tokens, the template writes its own), and
// the character ranges of it the model learns; a token overlapping one is learned.
struct RenderedChat {
  std::string text;  // UTF-8
  std::vector<std::pair<size_t, size_t>> trained;  // [begin, end) in characters (code points), ascending
  std::string error;  // not empty: the record cannot be rendered; says why
};

// Renders records (JSON objects) of the messages format, one RenderedChat each, in order.
using ChatRenderer = std::function<std::vector<RenderedChat>(const std::vector<const json::Value*>& records)>;

struct ReadOptions {
  FileKind kind = FileKind::kAuto;  // kAuto: by extension (.jsonl/.ndjson, .json, else text)
  RecordFormat format = RecordFormat::kText;
  OnError on_error = OnError::kRaise;
  TextUnit text_unit = TextUnit::kLine;
  std::string text_field = "text";         // the field of a JSON record in the text format
  std::string chat_template = "chatml";    // built in: "chatml", "llama3"; ignored with a chat_renderer
  ChatRenderer chat_renderer;              // set: renders the messages format (add_special_tokens unused)
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

// Where a RecordStream stands: enough to continue right after the last record it returned.
struct StreamPosition {
  uint64_t offset = 0;   // JSONL and text lines: byte offset of the next line; JSON array: index of
                         // the next record; text document: 0 before it, 1 after
  uint64_t line = 0;     // lines (or records) consumed, for error messages
  uint64_t records = 0;  // records returned so far
  uint64_t skipped = 0;  // malformed records skipped so far (OnError::kSkip)
};

class RecordStream {
 public:
  // A dataset file, memory-mapped; the tokenizer must outlive the stream.
  RecordStream(const std::string& path, const ReadOptions& options, const tokenizer::Tokenizer& tokenizer);
  // JSONL records held in memory (a Parquet record batch); an error names "name: row N" with
  // N = first_row + the line's index.
  static RecordStream jsonl_rows(std::string name, std::string records, uint64_t first_row, const ReadOptions& options,
                                 const tokenizer::Tokenizer& tokenizer);
  RecordStream(RecordStream&&) noexcept;
  RecordStream& operator=(RecordStream&&) noexcept;
  ~RecordStream();

  // Reads, renders and tokenizes up to max_records records, appending them to out; returns
  // how many were appended (0: the end). Skipped records are not counted against max_records.
  size_t read(size_t max_records, TokenizedData& out);
  bool at_end() const;
  const StreamPosition& position() const;
  // Continues from a position() of a stream over the same file; one that cannot be (past the
  // end, not at the start of a line) is a ReaderError. The report's error messages restart.
  void seek(const StreamPosition& position);
  const ReadReport& report() const;
  uint64_t size_bytes() const;  // of the file or buffer

 private:
  struct Impl;
  explicit RecordStream(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace barqtrain::data
