#include "data/readers.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include "data/mapped_file.h"
#include "data/tokenizer/tokenizer.h"

namespace barqtrain::data {
namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

const std::string& string_field(const json::Value& record, const char* name, bool required, const std::string& empty) {
  const json::Value* v = record.find(name);
  if (v == nullptr || v->is_null()) {
    if (required) throw ReaderError(std::string("missing field '") + name + "'");
    return empty;
  }
  if (!v->is_string()) {
    throw ReaderError(std::string("field '") + name + "' is a " + v->type_name() + ", expected a string");
  }
  return v->as_string();
}

constexpr const char* kAlpacaWithInput =
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n### Instruction:\n";
constexpr const char* kAlpacaNoInput =
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n";

std::string_view strip(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string_view::npos) return {};
  const size_t b = s.find_last_not_of(ws);
  return s.substr(a, b - a + 1);
}

Example render_messages(const json::Value& record, const std::string& chat_template) {
  const json::Value* messages = record.find("messages");
  if (messages == nullptr) throw ReaderError("missing field 'messages'");
  if (!messages->is_array()) {
    throw ReaderError(std::string("field 'messages' is a ") + messages->type_name() + ", expected an array");
  }
  if (messages->as_array().empty()) throw ReaderError("field 'messages' is empty");
  const bool llama3 = chat_template == "llama3";
  Example ex;
  bool any_assistant = false;
  size_t i = 0;
  static const std::string kEmpty;
  for (const json::Value& m : messages->as_array()) {
    if (!m.is_object()) {
      throw ReaderError("messages[" + std::to_string(i) + "] is a " + m.type_name() + ", expected an object");
    }
    std::string role, content;
    try {
      role = string_field(m, "role", true, kEmpty);
      content = string_field(m, "content", true, kEmpty);
    } catch (const ReaderError& e) {
      throw ReaderError("messages[" + std::to_string(i) + "]: " + e.what());
    }
    if (role != "system" && role != "user" && role != "assistant") {
      throw ReaderError("messages[" + std::to_string(i) + "]: role '" + role +
                        "' is not one of system, user, assistant");
    }
    const bool trained = role == "assistant";
    any_assistant |= trained;
    if (llama3) {
      // Meta's template: the BOS comes from the tokenizer's post-processor; content is stripped.
      ex.segments.emplace_back("<|start_header_id|>" + role + "<|end_header_id|>\n\n", false);
      ex.segments.emplace_back(std::string(strip(content)) + "<|eot_id|>", trained);
    } else {
      ex.segments.emplace_back("<|im_start|>" + role + "\n", false);
      ex.segments.emplace_back(content + "<|im_end|>", trained);
      ex.segments.emplace_back("\n", false);
    }
    ++i;
  }
  if (!any_assistant) throw ReaderError("no assistant message: nothing to learn");
  return ex;
}

}  // namespace

FileKind parse_file_kind(const std::string& name) {
  if (name == "auto") return FileKind::kAuto;
  if (name == "jsonl") return FileKind::kJsonl;
  if (name == "json") return FileKind::kJson;
  if (name == "text") return FileKind::kText;
  throw ReaderError("unknown file kind '" + name + "': expected auto, jsonl, json or text");
}

RecordFormat parse_record_format(const std::string& name) {
  if (name == "text") return RecordFormat::kText;
  if (name == "alpaca") return RecordFormat::kAlpaca;
  if (name == "messages") return RecordFormat::kMessages;
  throw ReaderError("unknown format '" + name + "': expected text, alpaca or messages");
}

OnError parse_on_error(const std::string& name) {
  if (name == "raise") return OnError::kRaise;
  if (name == "skip") return OnError::kSkip;
  throw ReaderError("unknown on_error '" + name + "': expected raise or skip");
}

void check_chat_template(const std::string& name) {
  if (name == "chatml" || name == "llama3") return;
  throw ReaderError("chat template '" + (name.size() > 60 ? name.substr(0, 60) + "..." : name) +
                    "' is not built in: the C++ reader renders only 'chatml' (Qwen, no default system prompt) and "
                    "'llama3'; a model's Jinja template is rendered through a ChatRenderer (barqtrain.data.read_dataset "
                    "with chat_template='model')");
}

Example render_record(const json::Value& record, const ReadOptions& options) {
  if (!record.is_object()) {
    throw ReaderError(std::string("the record is a ") + record.type_name() + ", expected an object");
  }
  static const std::string kEmpty;
  Example ex;
  switch (options.format) {
    case RecordFormat::kText:
      ex.segments.emplace_back(string_field(record, options.text_field.c_str(), true, kEmpty), true);
      break;
    case RecordFormat::kAlpaca: {
      const std::string& instruction = string_field(record, "instruction", true, kEmpty);
      const std::string& input = string_field(record, "input", false, kEmpty);
      const std::string& output = string_field(record, "output", true, kEmpty);
      std::string prompt = input.empty() ? kAlpacaNoInput : kAlpacaWithInput;
      prompt += instruction;
      if (!input.empty()) prompt += "\n\n### Input:\n" + input;
      prompt += "\n\n### Response:\n";
      ex.segments.emplace_back(std::move(prompt), false);
      ex.segments.emplace_back(output, true);
      break;
    }
    case RecordFormat::kMessages:
      if (options.chat_renderer) {
        throw ReaderError("render_record renders the built-in chat templates; a chat_renderer renders a chunk of records");
      }
      check_chat_template(options.chat_template);
      return render_messages(record, options.chat_template);
  }
  return ex;
}

namespace {

// Tokenizes examples and appends them to out: each segment separately (so the mask falls
// exactly on segment boundaries), the first with the post-processor's tokens, then EOS.
void tokenize_examples(const std::vector<Example>& examples, const ReadOptions& options,
                       const tokenizer::Tokenizer& tok, TokenizedData& out) {
  if (examples.empty()) return;
  std::vector<std::string_view> first, rest;
  for (const Example& ex : examples) {
    for (size_t s = 0; s < ex.segments.size(); ++s) (s == 0 ? first : rest).push_back(ex.segments[s].first);
  }
  const auto first_ids = tok.encode_batch(first, {options.add_special_tokens, false}, options.num_threads);
  const auto rest_ids = tok.encode_batch(rest, {false, false}, options.num_threads);
  size_t f = 0, r = 0;
  for (const Example& ex : examples) {
    for (size_t s = 0; s < ex.segments.size(); ++s) {
      const auto& ids = s == 0 ? first_ids[f++] : rest_ids[r++];
      const bool trained = ex.segments[s].second;
      for (const auto id : ids) {
        out.tokens.push_back(static_cast<int32_t>(id));
        out.labels.push_back(trained ? static_cast<int32_t>(id) : -100);
      }
    }
    if (options.eos_id >= 0) {
      out.tokens.push_back(static_cast<int32_t>(options.eos_id));
      out.labels.push_back(static_cast<int32_t>(options.eos_id));
    }
    out.offsets.push_back(static_cast<int64_t>(out.tokens.size()));
  }
}

using ByteRanges = std::vector<std::pair<size_t, size_t>>;

// A RenderedChat's character ranges as byte ranges of its UTF-8 text; ranges out of order or
// past the end are a ReaderError (the renderer's fault, named as such).
ByteRanges trained_bytes(const RenderedChat& chat) {
  ByteRanges bytes;
  size_t character = 0, byte = 0, previous_end = 0;
  auto byte_at = [&](size_t target) {
    while (character < target && byte < chat.text.size()) {
      ++byte;
      while (byte < chat.text.size() && (static_cast<unsigned char>(chat.text[byte]) & 0xC0) == 0x80) ++byte;
      ++character;
    }
    if (character < target) {
      throw ReaderError("the chat renderer's trained range ends at character " + std::to_string(target) +
                        ", past the end of its text (" + std::to_string(character) + " characters)");
    }
    return byte;
  };
  for (const auto& [begin, end] : chat.trained) {
    if (begin < previous_end || end < begin) {
      throw ReaderError("the chat renderer's trained ranges are not ascending and disjoint: [" + std::to_string(begin) +
                        ", " + std::to_string(end) + ") after one ending at " + std::to_string(previous_end));
    }
    const size_t first = byte_at(begin);
    bytes.emplace_back(first, byte_at(end));
    previous_end = end;
  }
  return bytes;
}

}  // namespace

struct RecordStream::Impl {
  const ReadOptions options;
  const tokenizer::Tokenizer& tokenizer;
  const std::string name;
  const bool rows;  // locations are "name: row N" (an in-memory batch), else "name:N"
  const uint64_t first_row = 0;
  FileKind kind = FileKind::kJsonl;
  std::unique_ptr<MappedFile<ReaderError>> file;
  std::string buffer;
  std::string_view text;
  json::Value document;  // FileKind::kJson: the whole array, parsed once
  StreamPosition position;
  ReadReport report;

  // A record of the messages format waiting for options.chat_renderer, and where it came from.
  struct PendingChat {
    json::Value record;
    std::string location;
  };

  Impl(const ReadOptions& o, const tokenizer::Tokenizer& t, std::string n, bool r, uint64_t first)
      : options(o), tokenizer(t), name(std::move(n)), rows(r), first_row(first) {
    if (options.format == RecordFormat::kMessages && !options.chat_renderer) check_chat_template(options.chat_template);
    report.path = name;
  }

  bool renders_chats() const { return options.format == RecordFormat::kMessages && bool(options.chat_renderer); }

  std::string line_location(uint64_t line) const {
    return rows ? name + ": row " + std::to_string(first_row + line) : name + ":" + std::to_string(line);
  }
  std::string record_location(uint64_t index) const { return name + ": record " + std::to_string(index); }

  void open_json_document() {
    try {
      document = json::parse(text);
    } catch (const json::JsonError& e) {
      throw ReaderError(name + ": " + e.what());  // a broken document cannot be read past
    }
    if (!document.is_array()) {
      throw ReaderError(name + ": the JSON document is a " + document.type_name() + ", expected an array of records");
    }
  }

  bool lines() const { return kind == FileKind::kJsonl || (kind == FileKind::kText && options.text_unit == TextUnit::kLine); }

  uint64_t end() const {
    if (kind == FileKind::kJson) return document.as_array().size();
    if (!lines()) return 1;
    return text.size();
  }

  void fail(const std::string& message) {
    if (options.on_error == OnError::kRaise) throw ReaderError(message);
    ++report.skipped;
    ++position.skipped;
    if (report.errors.size() < options.max_reported_errors) report.errors.push_back(message);
  }

  void count_records(size_t n) {
    report.records += n;
    position.records += n;
  }

  size_t read(size_t max_records, TokenizedData& out) {
    const size_t chunk_records = std::max<size_t>(options.chunk_records, 1);
    size_t added = 0;
    while (added < max_records && position.offset < end()) {
      added += read_chunk(std::min(max_records - added, chunk_records), out);
    }
    return added;
  }

  // Reads records until `wanted` are rendered (or pending for the chat renderer) or the input
  // ends, then tokenizes them into out; returns how many were appended, fewer than wanted when
  // the input ended or the chat renderer refused some (skipped: OnError::kSkip).
  size_t read_chunk(size_t wanted, TokenizedData& out) {
    std::vector<Example> examples;
    std::vector<PendingChat> chats;
    const bool rendering = renders_chats();
    auto take = [&](const json::Value& record, const auto& location) {
      if (rendering) {  // a copy: rendering in Python costs far more
        chats.push_back({record, location()});
        return;
      }
      try {
        examples.push_back(render_record(record, options));
      } catch (const ReaderError& e) {
        fail(location() + ": " + e.what());
      }
    };
    const uint64_t stop = end();
    while (examples.size() + chats.size() < wanted && position.offset < stop) {
      if (kind == FileKind::kJson) {
        const uint64_t index = position.offset++;
        ++position.line;
        take(document.as_array()[index], [&] { return record_location(index); });
        continue;
      }
      if (!lines()) {  // a text file as one document
        position.offset = 1;
        ++position.line;
        if (strip(text).empty()) continue;
        Example ex;
        ex.segments.emplace_back(std::string(text), true);
        examples.push_back(std::move(ex));
        continue;
      }
      size_t line_end = text.find('\n', position.offset);
      if (line_end == std::string_view::npos) line_end = text.size();
      std::string_view line = text.substr(position.offset, line_end - position.offset);
      position.offset = std::min<uint64_t>(line_end + 1, text.size());
      const uint64_t line_no = ++position.line;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (strip(line).empty()) continue;
      if (kind == FileKind::kText) {
        Example ex;
        ex.segments.emplace_back(std::string(line), true);
        examples.push_back(std::move(ex));
        continue;
      }
      json::Value record;
      try {
        record = json::parse(line);
      } catch (const json::JsonError& e) {
        fail(line_location(line_no) + ": " + e.what());
        continue;
      }
      take(record, [&] { return line_location(line_no); });
    }
    tokenize_examples(examples, options, tokenizer, out);
    count_records(examples.size());
    return examples.size() + tokenize_chats(chats, out);
  }

  // Renders chats through options.chat_renderer and tokenizes each rendering whole; a token is
  // learned where it overlaps a trained range. A chat the renderer refuses is a failure at its
  // location. Returns how many were appended.
  size_t tokenize_chats(const std::vector<PendingChat>& chats, TokenizedData& out) {
    if (chats.empty()) return 0;
    std::vector<const json::Value*> records;
    records.reserve(chats.size());
    for (const PendingChat& chat : chats) records.push_back(&chat.record);
    const std::vector<RenderedChat> rendered = options.chat_renderer(records);
    if (rendered.size() != chats.size()) {
      throw ReaderError(name + ": the chat renderer returned " + std::to_string(rendered.size()) + " results for " +
                        std::to_string(chats.size()) + " records");
    }
    std::vector<std::string_view> texts;
    std::vector<ByteRanges> trained;
    for (size_t i = 0; i < chats.size(); ++i) {
      if (!rendered[i].error.empty()) {
        fail(chats[i].location + ": " + rendered[i].error);
        continue;
      }
      trained.push_back(trained_bytes(rendered[i]));
      texts.push_back(rendered[i].text);
    }
    const auto encodings = tokenizer.encode_batch_with_offsets(texts, {false, false}, options.num_threads);
    for (size_t i = 0; i < encodings.size(); ++i) {
      const auto& [ids, spans] = encodings[i];
      const ByteRanges& ranges = trained[i];
      size_t r = 0;  // the first range not wholly before the current token (offsets ascend)
      for (size_t t = 0; t < ids.size(); ++t) {
        while (r < ranges.size() && ranges[r].second <= spans[t].start) ++r;
        const bool learned = r < ranges.size() && spans[t].end > ranges[r].first && spans[t].start < ranges[r].second;
        out.tokens.push_back(static_cast<int32_t>(ids[t]));
        out.labels.push_back(learned ? static_cast<int32_t>(ids[t]) : -100);
      }
      if (options.eos_id >= 0) {
        out.tokens.push_back(static_cast<int32_t>(options.eos_id));
        out.labels.push_back(static_cast<int32_t>(options.eos_id));
      }
      out.offsets.push_back(static_cast<int64_t>(out.tokens.size()));
    }
    count_records(encodings.size());
    return encodings.size();
  }

  void seek(const StreamPosition& to) {
    if (to.offset > end()) {
      throw ReaderError(name + ": cannot continue at " + std::to_string(to.offset) + ", past the end (" +
                        std::to_string(end()) + "): is it the same file as when the position was saved?");
    }
    if (lines() && to.offset > 0 && text[to.offset - 1] != '\n' && to.offset != text.size()) {
      throw ReaderError(name + ": position " + std::to_string(to.offset) +
                        " is not at the start of a line: is it the same file as when the position was saved?");
    }
    position = to;
    report.records = to.records;
    report.skipped = to.skipped;
    report.errors.clear();
  }
};

RecordStream::RecordStream(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RecordStream::RecordStream(RecordStream&&) noexcept = default;
RecordStream& RecordStream::operator=(RecordStream&&) noexcept = default;
RecordStream::~RecordStream() = default;

RecordStream::RecordStream(const std::string& path, const ReadOptions& options, const tokenizer::Tokenizer& tokenizer)
    : impl_(std::make_unique<Impl>(options, tokenizer, path, false, 0)) {
  Impl& s = *impl_;
  s.kind = options.kind;
  if (s.kind == FileKind::kAuto) {
    s.kind = ends_with(path, ".jsonl") || ends_with(path, ".ndjson") ? FileKind::kJsonl
             : ends_with(path, ".json")                               ? FileKind::kJson
                                                                      : FileKind::kText;
  }
  if (s.kind == FileKind::kText && options.format != RecordFormat::kText) {
    throw ReaderError(path + ": plain text files hold the text format only, not alpaca or messages");
  }
  s.file = std::make_unique<MappedFile<ReaderError>>(path);
  s.text = s.file->view();
  if (s.kind == FileKind::kJson) s.open_json_document();
}

RecordStream RecordStream::jsonl_rows(std::string name, std::string records, uint64_t first_row,
                                      const ReadOptions& options, const tokenizer::Tokenizer& tokenizer) {
  auto impl = std::make_unique<Impl>(options, tokenizer, std::move(name), true, first_row);
  impl->kind = FileKind::kJsonl;
  impl->buffer = std::move(records);
  impl->text = impl->buffer;
  return RecordStream(std::move(impl));
}

size_t RecordStream::read(size_t max_records, TokenizedData& out) { return impl_->read(max_records, out); }
bool RecordStream::at_end() const { return impl_->position.offset >= impl_->end(); }
const StreamPosition& RecordStream::position() const { return impl_->position; }
void RecordStream::seek(const StreamPosition& position) { impl_->seek(position); }
const ReadReport& RecordStream::report() const { return impl_->report; }
uint64_t RecordStream::size_bytes() const { return impl_->text.size(); }

ReadReport read_dataset(const std::string& path, const ReadOptions& options, const tokenizer::Tokenizer& tokenizer,
                        TokenizedData& out) {
  RecordStream stream(path, options, tokenizer);
  stream.read(SIZE_MAX, out);
  return stream.report();
}

}  // namespace barqtrain::data
