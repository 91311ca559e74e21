#include "data/json.h"

#include <gtest/gtest.h>

#include <string>

namespace barqtrain::json {
namespace {

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const JsonError& error) {
    return error.what();
  }
  return "";
}

TEST(Json, ParsesEveryValueType) {
  const Value doc = parse(R"( {"a": [1, -2.5e3, true, false, null], "b": {"c": "d"}} )");
  const auto& a = doc.find("a")->as_array();
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].as_integer(), 1);
  EXPECT_EQ(a[1].as_number(), -2500.0);
  EXPECT_TRUE(a[2].as_bool());
  EXPECT_FALSE(a[3].as_bool());
  EXPECT_TRUE(a[4].is_null());
  EXPECT_EQ(doc.find("b")->find("c")->as_string(), "d");
  EXPECT_EQ(doc.find("missing"), nullptr);
}

TEST(Json, KeepsObjectMembersInDocumentOrder) {
  const Value doc = parse(R"({"z": 0, "a": 1, "m": 2})");
  const auto& members = doc.as_object();
  ASSERT_EQ(members.size(), 3u);
  EXPECT_EQ(members[0].first, "z");
  EXPECT_EQ(members[1].first, "a");
  EXPECT_EQ(members[2].first, "m");
}

TEST(Json, DecodesEscapesAndSurrogatePairs) {
  EXPECT_EQ(parse(R"("\"\\\/\b\f\n\r\t")").as_string(), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(parse(R"("\u0120\u00e9")").as_string(), "\xC4\xA0\xC3\xA9");
  EXPECT_EQ(parse(R"("\ud83d\ude00")").as_string(), "\xF0\x9F\x98\x80");
  EXPECT_EQ(parse("\"\xE4\xB8\xAD\"").as_string(), "\xE4\xB8\xAD");
}

TEST(Json, SyntaxErrorsNameTheLineAndColumn) {
  EXPECT_EQ(error_of("{\n  \"a\": 1,\n  \"b\" 2}"), "JSON syntax error at line 3, column 7: expected ':'");
  EXPECT_NE(error_of("[1, 2"), "");
  EXPECT_NE(error_of("{\"a\": 1} x").find("unexpected text after"), std::string::npos);
  EXPECT_NE(error_of(R"("\ud800")").find("unpaired high surrogate"), std::string::npos);
  EXPECT_NE(error_of(R"("\udc00")").find("unpaired low surrogate"), std::string::npos);
  EXPECT_NE(error_of("\"\xC3\"").find("invalid UTF-8"), std::string::npos);
  EXPECT_NE(error_of("\"a\nb\"").find("control character"), std::string::npos);
  EXPECT_NE(error_of("01").find("unexpected text"), std::string::npos);
  EXPECT_NE(error_of("1.").find("expected a digit"), std::string::npos);
  EXPECT_NE(error_of("tru").find("invalid literal"), std::string::npos);
  EXPECT_NE(error_of("").find("unexpected end of input"), std::string::npos);
}

TEST(Json, RejectsDeepNestingInsteadOfOverflowingTheStack) {
  EXPECT_NE(error_of(std::string(100000, '[')).find("nesting deeper"), std::string::npos);
}

TEST(Json, TypeErrorsNameBothTypes) {
  try {
    parse("[1]").as_object();
    FAIL() << "expected a JsonError";
  } catch (const JsonError& error) {
    EXPECT_STREQ(error.what(), "expected a JSON object, found array");
  }
  EXPECT_THROW(parse("1.5").as_integer(), JsonError);
}

TEST(Json, MissingFileIsAnErrorNamingIt) {
  try {
    parse_file("/nonexistent/tokenizer.json");
    FAIL() << "expected a JsonError";
  } catch (const JsonError& error) {
    EXPECT_STREQ(error.what(), "cannot open /nonexistent/tokenizer.json");
  }
}

}  // namespace
}  // namespace barqtrain::json
