#include "data/readers.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/unicode.h"
#include "data/utf8.h"

namespace barqtrain::data {
namespace {

// A byte-level BPE with no merges: every byte is its own token, so ids are the bytes.
tokenizer::Tokenizer bytes_tokenizer() {
  std::string vocab;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    int cp = b;
    if (!printable) {
      cp = 256;
      for (int c = 0; c < b; ++c) cp += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE);
    }
    std::string ch;
    barqtrain::utf8::append(ch, static_cast<char32_t>(cp));
    if (ch == "\"" || ch == "\\") ch = "\\" + ch;
    vocab += (b ? ", \"" : "\"") + ch + "\": " + std::to_string(b);
  }
  return tokenizer::Tokenizer(json::parse(R"({"added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
              "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
              "vocab": {)" + vocab + R"(}, "merges": []}})"));
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(Readers, AlpacaMasksThePromptAndAppendsEos) {
  const auto tok = bytes_tokenizer();
  ReadOptions options;
  options.format = RecordFormat::kAlpaca;
  options.eos_id = 255;
  const std::string path = write_file("a.jsonl", R"({"instruction": "Add", "input": "1+1", "output": "2"})" "\n");
  TokenizedData data;
  const ReadReport report = read_dataset(path, options, tok, data);
  ASSERT_EQ(report.records, 1u);
  ASSERT_EQ(data.size(), 1u);
  const std::string prompt =
      "Below is an instruction that describes a task, paired with an input that provides further context. "
      "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd\n\n### Input:\n1+1"
      "\n\n### Response:\n";
  ASSERT_EQ(data.tokens.size(), prompt.size() + 2);
  for (size_t i = 0; i < prompt.size(); ++i) {
    ASSERT_EQ(data.tokens[i], static_cast<unsigned char>(prompt[i]));
    ASSERT_EQ(data.labels[i], -100);
  }
  EXPECT_EQ(data.tokens[prompt.size()], '2');
  EXPECT_EQ(data.labels[prompt.size()], '2');
  EXPECT_EQ(data.tokens.back(), 255);
  EXPECT_EQ(data.labels.back(), 255);
}

TEST(Readers, MalformedJsonlLinesNameFileAndLine) {
  const auto tok = bytes_tokenizer();
  const std::string path = write_file("bad.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": 3}\n{\"text\": \"x\"\n{\"text\": \"y\"}\n");
  ReadOptions options;
  TokenizedData data;
  try {
    read_dataset(path, options, tok, data);
    FAIL() << "expected a ReaderError";
  } catch (const ReaderError& e) {
    EXPECT_EQ(std::string(e.what()), path + ":3: field 'text' is a number, expected a string");
  }
  options.on_error = OnError::kSkip;
  TokenizedData kept;
  const ReadReport report = read_dataset(path, options, tok, kept);
  EXPECT_EQ(report.records, 2u);
  EXPECT_EQ(report.skipped, 2u);
  ASSERT_EQ(report.errors.size(), 2u);
  EXPECT_EQ(report.errors[0], path + ":3: field 'text' is a number, expected a string");
  EXPECT_EQ(report.errors[1].rfind(path + ":4: JSON syntax error", 0), 0u) << report.errors[1];
  EXPECT_EQ(kept.size(), 2u);
}

TEST(Readers, JsonArraysTextAndChat) {
  const auto tok = bytes_tokenizer();
  ReadOptions options;
  TokenizedData data;
  EXPECT_EQ(read_dataset(write_file("t.txt", "ab\r\n\n  \ncd"), options, tok, data).records, 2u);
  EXPECT_EQ(data.tokens, (std::vector<int32_t>{'a', 'b', 'c', 'd'}));

  const std::string arr = write_file("m.json", R"([{"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "yo"}]}, {"messages": [{"role": "bot", "content": "x"}]}])");
  options.format = RecordFormat::kMessages;
  try {
    TokenizedData d;
    read_dataset(arr, options, tok, d);
    FAIL();
  } catch (const ReaderError& e) {
    EXPECT_EQ(std::string(e.what()), arr + ": record 1: messages[0]: role 'bot' is not one of system, user, assistant");
  }
  const Example ex = render_record(json::parse(R"({"messages": [{"role": "user", "content": "hi"},
      {"role": "assistant", "content": "yo"}]})"), options);
  std::string trained, all;
  for (const auto& [text, learn] : ex.segments) {
    all += text;
    if (learn) trained += text;
  }
  EXPECT_EQ(all, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n");
  EXPECT_EQ(trained, "yo<|im_end|>");
  options.chat_template = "{% for m in messages %}...";
  EXPECT_THROW(render_record(json::parse(R"({"messages": []})"), options), ReaderError);
  try {
    check_chat_template("gemma");
  } catch (const ReaderError& e) {
    EXPECT_NE(std::string(e.what()).find("not built in"), std::string::npos);
  }
  EXPECT_THROW(read_dataset(::testing::TempDir() + "missing.jsonl", ReadOptions{}, tok, data), ReaderError);
}

// A renderer as barqtrain.data.chat_template is one: "[role]content|" per message, the
// assistant's content and its "|" trained; a record whose first message says "refuse" is refused.
std::vector<RenderedChat> bracket_renderer(const std::vector<const json::Value*>& records) {
  std::vector<RenderedChat> out;
  for (const json::Value* record : records) {
    RenderedChat chat;
    size_t characters = 0;
    for (const json::Value& m : record->find("messages")->as_array()) {
      const std::string& role = m.find("role")->as_string();
      const std::string& content = m.find("content")->as_string();
      if (content == "refuse") chat.error = "the template raised: refused";
      chat.text += "[" + role + "]";
      characters += role.size() + 2;
      const size_t begin = characters;
      chat.text += content + "|";
      for (const char c : content) characters += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
      ++characters;
      if (role == "assistant") chat.trained.emplace_back(begin, characters);
    }
    out.push_back(std::move(chat));
  }
  return out;
}

TEST(Readers, AChatRendererRendersChunksAndItsCharacterRangesMaskByteTokens) {
  const auto tok = bytes_tokenizer();
  ReadOptions options;
  options.format = RecordFormat::kMessages;
  options.chat_template = "not used with a renderer";
  options.on_error = OnError::kSkip;
  options.chunk_records = 2;  // the refused record leaves a chunk short: read() goes on to the next
  options.eos_id = 255;
  size_t calls = 0;
  options.chat_renderer = [&](const std::vector<const json::Value*>& records) {
    ++calls;
    return bracket_renderer(records);
  };
  const std::string path = write_file("chat.jsonl",
      R"({"messages": [{"role": "user", "content": "refuse"}, {"role": "assistant", "content": "no"}]})" "\n"
      R"({"messages": [{"role": "user", "content": "é?"}, {"role": "assistant", "content": "ça"}]})" "\n\n"
      R"({"messages": [{"role": "assistant", "content": "x"}]})" "\n");
  RecordStream stream(path, options, tok);
  TokenizedData data;
  ASSERT_EQ(stream.read(2, data), 2u);
  EXPECT_EQ(calls, 2u);
  EXPECT_EQ(stream.report().skipped, 1u);
  ASSERT_EQ(stream.report().errors.size(), 1u);
  EXPECT_EQ(stream.report().errors[0], path + ":1: the template raised: refused");
  EXPECT_EQ(stream.position().records, 2u);
  const std::string first = "[user]é?|[assistant]ça|";
  const int64_t second = std::string("[assistant]x|").size() + 1;
  ASSERT_EQ(data.offsets, (std::vector<int64_t>{0, static_cast<int64_t>(first.size()) + 1,
                                                 static_cast<int64_t>(first.size()) + 1 + second}));
  std::string learned;
  for (size_t i = 0; i < first.size(); ++i) {
    ASSERT_EQ(data.tokens[i], static_cast<unsigned char>(first[i]));
    if (data.labels[i] != -100) learned += static_cast<char>(data.labels[i]);
  }
  EXPECT_EQ(learned, "ça|");  // the two bytes of ç, both learned
  EXPECT_EQ(data.labels[first.size()], 255);

  options.on_error = OnError::kRaise;
  TokenizedData d;
  try {
    read_dataset(path, options, tok, d);
    FAIL() << "expected a ReaderError";
  } catch (const ReaderError& e) {
    EXPECT_EQ(std::string(e.what()), path + ":1: the template raised: refused");
  }
  options.chat_renderer = [](const std::vector<const json::Value*>& records) {
    std::vector<RenderedChat> out(records.size());
    for (RenderedChat& chat : out) {
      chat.text = "ab";
      chat.trained = {{1, 3}};
    }
    return out;
  };
  EXPECT_THROW(read_dataset(write_file("one.jsonl", "{}\n"), options, tok, d), ReaderError);  // past the end
  EXPECT_THROW(render_record(json::parse(R"({"messages": []})"), options), ReaderError);
}

TEST(Readers, AStreamResumedAtASavedPositionYieldsTheRecordsThatCameNext) {
  const auto tok = bytes_tokenizer();
  std::string jsonl;
  for (int i = 0; i < 50; ++i) {
    jsonl += i == 7 ? "{broken\n" : "{\"text\": \"record " + std::to_string(i) + "\"}\n";
    if (i % 10 == 0) jsonl += "\n";  // blank lines are not records
  }
  const std::string path = write_file("stream.jsonl", jsonl);
  ReadOptions options;
  options.on_error = OnError::kSkip;
  options.chunk_records = 4;
  TokenizedData whole;
  read_dataset(path, options, tok, whole);
  ASSERT_EQ(whole.size(), 49u);

  RecordStream stream(path, options, tok);
  TokenizedData head;
  EXPECT_EQ(stream.read(20, head), 20u);  // the broken line is skipped, not counted
  const StreamPosition saved = stream.position();
  EXPECT_EQ(saved.records, 20u);
  EXPECT_EQ(saved.skipped, 1u);

  RecordStream resumed(path, options, tok);
  resumed.seek(saved);
  TokenizedData tail;
  while (resumed.read(7, tail) > 0) {
  }
  EXPECT_TRUE(resumed.at_end());
  EXPECT_EQ(resumed.report().records, 49u);
  ASSERT_EQ(head.size() + tail.size(), whole.size());
  std::vector<int32_t> joined = head.tokens;
  joined.insert(joined.end(), tail.tokens.begin(), tail.tokens.end());
  EXPECT_EQ(joined, whole.tokens);

  StreamPosition bad = saved;
  bad.offset += 3;  // inside a line
  EXPECT_THROW(resumed.seek(bad), ReaderError);
  bad.offset = jsonl.size() + 10;
  EXPECT_THROW(resumed.seek(bad), ReaderError);
}

TEST(Readers, InMemoryRowsNameTheRowInErrors) {
  const auto tok = bytes_tokenizer();
  ReadOptions options;
  RecordStream rows = RecordStream::jsonl_rows("data.parquet", "{\"text\": \"a\"}\n{\"txt\": 1}\n", 100, options, tok);
  TokenizedData out;
  try {
    rows.read(10, out);
    FAIL() << "no error";
  } catch (const ReaderError& e) {
    EXPECT_EQ(std::string(e.what()), "data.parquet: row 102: missing field 'text'");
  }
}

}  // namespace
}  // namespace barqtrain::data
