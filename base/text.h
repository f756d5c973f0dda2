// Printable: how errors and logs echo untrusted text (names, paths, labels, peers'
// and clients' strings): a bounded prefix with control and non-ASCII bytes escaped,
// so a hostile name cannot forge log lines or blow up a message. Used everywhere.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kvagent {

// At most `max` bytes of `text` as printable ASCII: bytes below 0x20, 0x7f, bytes
// from 0x80 and the backslash become "\xNN". When the escaped text would exceed `max`
// bytes it is cut there (never inside an escape) and "...(N bytes)" is appended, N
// being the size of the whole input.
std::string Printable(std::string_view text, size_t max = 128);

// True when `text` holds a NUL or another control byte (below 0x20, or 0x7f).
bool HasControlCharacter(std::string_view text);

}  // namespace kvagent
