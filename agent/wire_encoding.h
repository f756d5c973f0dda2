// Protobuf encoding written by hand where a message of many already-serialized entries
// is built (NoticeBatch in the engine, TransferAckBatch in the Inbox): appending each
// entry's bytes gives what serializing the message would, with no message built.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvagent::agent {

// Appends field `field` as a length-delimited entry holding `body` (tag, varint length,
// the bytes) to `out`.
inline void AppendLengthDelimited(uint32_t field, std::string_view body, std::string* out) {
  auto varint = [out](uint64_t value) {
    while (value >= 0x80) {
      out->push_back(static_cast<char>(value | 0x80));
      value >>= 7;
    }
    out->push_back(static_cast<char>(value));
  };
  varint((uint64_t{field} << 3) | 2);  // wire type 2: length-delimited
  varint(body.size());
  out->append(body);
}

}  // namespace kvagent::agent
