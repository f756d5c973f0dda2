#include "base/text.h"

#include <string>

#include "catch2/catch.hpp"
#include "tests/unit/text_count.h"

namespace kvagent {
namespace {

TEST_CASE("Printable keeps plain text and escapes control, non-ASCII and backslash bytes") {
  CHECK(Printable("k.L0") == "k.L0");
  CHECK(Printable("") == "");
  CHECK(Printable(std::string("a\0b", 3)) == "a\\x00b");
  CHECK(Printable("line\nforged: ok") == "line\\x0aforged: ok");
  CHECK(Printable("\x7f\x80\xff") == "\\x7f\\x80\\xff");
  CHECK(Printable("a\\x41") == "a\\x5cx41");  // an escape in the input stays unambiguous
}

TEST_CASE("Printable bounds its output and says how long the input was") {
  const std::string big(10240, 'n');
  const std::string shown = Printable(big);
  CHECK(shown == std::string(128, 'n') + "...(10240 bytes)");
  CHECK(Printable(std::string(128, 'x')) == std::string(128, 'x'));  // fits: not cut
  CHECK(Printable("abcdef", 4) == "abcd...(6 bytes)");
  // Never cut inside an escape.
  CHECK(Printable("ab\ncd", 4) == "ab...(5 bytes)");
  const std::string controls(10000, '\n');
  CHECK(Printable(controls).size() < 128 + 20);
}

TEST_CASE("Occurrences (tests' line counter) counts overlapping matches, none for empty") {
  using testing::Occurrences;
  CHECK(Occurrences("refused; refused; ok", "refused") == 2);
  CHECK(Occurrences("aaa", "aa") == 2);
  CHECK(Occurrences("abc", "x") == 0);
  CHECK(Occurrences("", "x") == 0);
  CHECK(Occurrences("abc", "") == 0);
  CHECK(Occurrences(std::string("a\0a\0", 4), std::string("\0", 1)) == 2);
}

TEST_CASE("HasControlCharacter finds NUL, control bytes and DEL only") {
  CHECK_FALSE(HasControlCharacter("k.L0 /dev/shm/x"));
  CHECK_FALSE(HasControlCharacter("\xc3\xa9"));  // UTF-8 is not control
  CHECK(HasControlCharacter(std::string("a\0", 2)));
  CHECK(HasControlCharacter("a\tb"));
  CHECK(HasControlCharacter("\x7f"));
}

}  // namespace
}  // namespace kvagent
