// The CLI's JSON writer (tools/json_writer.hpp, over nlohmann::json): escapes, numbers,
// nested documents, invalid UTF-8 replaced rather than passed through, misuse refused.
#include "json_writer.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

namespace sluice::cli {
namespace {

std::string quoted(const std::string& text) {
  JsonWriter w;
  w.value(text);
  return w.str();
}

TEST(JsonWriter, QuotesAndEscapes) {
  EXPECT_EQ(quoted("plain"), "\"plain\"");
  EXPECT_EQ(quoted("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(quoted("line\nnext\ttab\rret"), "\"line\\nnext\\ttab\\rret\"");
  EXPECT_EQ(quoted(std::string("\x01\x1f\b\f", 4)), "\"\\u0001\\u001f\\b\\f\"");
  EXPECT_EQ(quoted(std::string("nul\0x", 5)), "\"nul\\u0000x\"");
  EXPECT_EQ(quoted("caf\xc3\xa9 \xe2\x86\x92"), "\"caf\xc3\xa9 \xe2\x86\x92\"");  // UTF-8 kept
  EXPECT_EQ(quoted("/"), "\"/\"");
}

TEST(JsonWriter, InvalidUtf8IsReplacedNotPassedThrough) {
  // A file name in Latin-1, a lone continuation byte, a truncated sequence.
  for (const std::string bad :
       {std::string("caf\xe9.csv"), std::string("x\x80y"), std::string("end\xe2\x86")}) {
    const std::string out = quoted(bad);
    EXPECT_NE(out.find("\xef\xbf\xbd"), std::string::npos) << out;  // U+FFFD
    EXPECT_NO_THROW((void)nlohmann::json::parse(out)) << out;
  }
}

TEST(JsonWriter, NumbersRoundTripAndNaNIsNull) {
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(3.0), "3");
  EXPECT_EQ(json_number(-0.0), "0");
  EXPECT_EQ(json_number(std::nan("")), "null");
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
  for (const double v : {1.0 / 3, 2.5e-300, 1.7976931348623157e308, -123456.789, 5.8e15}) {
    EXPECT_EQ(std::stod(json_number(v)), v) << json_number(v);
    JsonWriter w;
    w.value(v);
    EXPECT_EQ(std::stod(w.str()), v) << w.str();
  }
}

TEST(JsonWriter, BuildsNestedDocuments) {
  JsonWriter w;
  w.begin_object();
  w.field("name", "a \"quoted\" name");
  w.field("count", std::int64_t{9007199254740993});
  w.field("small", 7);
  w.field("big", std::uint64_t{18446744073709551615u});
  w.field("ratio", 0.25);
  w.field("missing", std::nan(""));
  w.field("ok", true);
  w.key("empty").begin_array().end_array();
  w.key("nested").begin_array();
  w.begin_object().field("x", 1).end_object();
  w.value(2.5).null();
  w.end_array();
  w.key("obj").begin_object().end_object();
  w.end_object();
  EXPECT_EQ(w.str(),
            "{\"name\":\"a \\\"quoted\\\" name\",\"count\":9007199254740993,\"small\":7,"
            "\"big\":18446744073709551615,\"ratio\":0.25,\"missing\":null,\"ok\":true,"
            "\"empty\":[],\"nested\":[{\"x\":1},2.5,null],\"obj\":{}}");

  JsonWriter pretty(2);
  pretty.begin_object().field("a", 1).key("b").begin_array().value(1).value(2).end_array();
  pretty.end_object();
  EXPECT_EQ(pretty.str(), "{\n  \"a\": 1,\n  \"b\": [\n    1,\n    2\n  ]\n}");
}

TEST(JsonWriter, RefusesMisuse) {
  {
    JsonWriter w;
    w.begin_object();
    EXPECT_THROW(w.value(1), std::logic_error);     // value without key
    EXPECT_THROW(w.end_array(), std::logic_error);  // wrong bracket
    EXPECT_THROW((void)w.str(), std::logic_error);  // incomplete
    w.key("k");
    EXPECT_THROW(w.key("again"), std::logic_error);  // key after key
    EXPECT_THROW(w.end_object(), std::logic_error);  // key without value
    w.value(1);
    w.key("k");
    EXPECT_THROW(w.value(2), std::logic_error);  // the same key twice
  }
  {
    JsonWriter w;
    w.begin_array();
    EXPECT_THROW(w.key("k"), std::logic_error);  // key in an array
    w.end_array();
    EXPECT_THROW(w.value(1), std::logic_error);  // second root
    EXPECT_EQ(w.str(), "[]");
  }
  EXPECT_THROW((void)JsonWriter().str(), std::logic_error);  // nothing written
}

}  // namespace
}  // namespace sluice::cli
