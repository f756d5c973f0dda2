#include "base/text.h"

#include <algorithm>

#include "fmt/format.h"

namespace kvagent {

std::string Printable(std::string_view text, size_t max) {
  std::string out;
  out.reserve(std::min(max, text.size()) + 16);
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const bool plain = c >= 0x20 && c < 0x7f && c != '\\';
    if (out.size() + (plain ? 1 : 4) > max) {
      return out + fmt::format("...({} bytes)", text.size());
    }
    if (plain) {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

bool HasControlCharacter(std::string_view text) {
  for (char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) return true;
  }
  return false;
}

}  // namespace kvagent
