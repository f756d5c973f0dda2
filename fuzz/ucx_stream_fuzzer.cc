// Fuzz target: a connection's bytes to UCX's TCP port as the agent's stream check
// (transport/ucx_tcp_guard.h, internal::FeedStream) reads them before UCT does:
// frames of any id and length, lying lengths, raw tails, an IPv6 interface, another
// receive buffer, a connection this agent's UCX dialled, and the reads cut anywhere
// (fuzz/ucx_stream_input.proto). Whatever
// the bytes, nothing crashes, and:
//   - the verdict does not depend on how the stream is cut into reads: fed in the
//     input's pieces, or in one, or a byte at a time, it passes or is refused with the
//     same reason (UCT reads in whatever pieces the kernel gives);
//   - once refused, a stream stays refused, whatever comes after;
//   - a refusal says why.
// Which frames UCT itself aborts on is tests/security:uct_frames_test's part.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/ucx_stream_input.pb.h"
#include "transport/ucx_tcp_guard.h"
#include "uct/api/uct_def.h"

namespace kvagent::fuzz {
namespace {

using transport::internal::FeedStream;
using transport::internal::StreamCheck;
using transport::internal::StreamRules;

constexpr size_t kMaxStream = 1 << 20;

std::string Build(const UcxStreamInput& input) {
  std::string out = input.dialled()     ? std::string()
                    : input.bad_magic() ? std::string(8, 'x')
                                        : std::string("\x78\x56\x34\x12\xbe\xba\xfe\xca", 8);
  for (int i = 0; i < input.frames_size(); ++i) {
    const std::string& frame = input.frames(i);
    const std::string body = frame.empty() ? std::string() : frame.substr(1);
    const uint32_t length = i < input.lengths_size() && input.lengths(i) != 0
                                ? static_cast<uint32_t>(input.lengths(i))
                                : static_cast<uint32_t>(body.size());
    out += frame.empty() ? '\0' : frame[0];
    out.append(reinterpret_cast<const char*>(&length), 4);
    out += body;
    if (out.size() > kMaxStream) break;
  }
  out += input.tail();
  if (out.size() > kMaxStream) out.resize(kMaxStream);
  return out;
}

// The check of the input's connection: accepted, or dialled (to 127.0.0.1:40000 or
// [fd77::1]:40000, after UCT sent what the input says).
StreamCheck CheckOf(const UcxStreamInput& input) {
  if (!input.dialled()) {
    StreamCheck check;
    check.request_bytes =
        transport::internal::ConnectionRequestBytes(input.ipv6() ? AF_INET6 : AF_INET);
    return check;
  }
  sockaddr_in6 to6{};
  to6.sin6_family = AF_INET6;
  to6.sin6_port = htons(40000);
  to6.sin6_addr.s6_addr[0] = 0xfd;
  to6.sin6_addr.s6_addr[1] = 0x77;
  to6.sin6_addr.s6_addr[15] = 1;
  sockaddr_in to4{};
  to4.sin_family = AF_INET;
  to4.sin_port = htons(40000);
  to4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  StreamCheck check =
      input.ipv6()
          ? transport::internal::DialledStreamCheck(reinterpret_cast<sockaddr*>(&to6), sizeof to6)
          : transport::internal::DialledStreamCheck(reinterpret_cast<sockaddr*>(&to4), sizeof to4);
  check.request_bytes =
      transport::internal::ConnectionRequestBytes(input.ipv6() ? AF_INET6 : AF_INET);
  std::string sent = input.sent();
  if (sent.empty()) {
    // UCT's magic number, then its request: event 1, flags 0, the connection, its address.
    sent = std::string("\x78\x56\x34\x12\xbe\xba\xfe\xca", 8);
    const uint32_t length = check.request_bytes;
    sent += static_cast<char>(UCT_AM_ID_MAX);
    sent.append(reinterpret_cast<const char*>(&length), 4);
    const uint32_t event = 1;
    sent.append(reinterpret_cast<const char*>(&event), 4);
    sent += '\0';
    const uint64_t connection = input.own_connection();
    sent.append(reinterpret_cast<const char*>(&connection), 8);
    to4.sin_port = to6.sin6_port = htons(41000);
    sent += input.ipv6() ? std::string(reinterpret_cast<const char*>(&to6), sizeof to6)
                         : std::string(reinterpret_cast<const char*>(&to4), sizeof to4);
  }
  transport::internal::NoteSent(&check, reinterpret_cast<const uint8_t*>(sent.data()),
                                sent.size());
  return check;
}

// The first refusal feeding `stream` in pieces of `cuts` (cycled; 0 counts as 1), or "".
std::string Feed(const std::string& stream, const UcxStreamInput& input, const StreamRules& rules,
                 const std::vector<size_t>& cuts) {
  StreamCheck check = CheckOf(input);
  size_t at = 0, i = 0;
  std::string refused;
  while (at < stream.size()) {
    const size_t piece = std::min(stream.size() - at, std::max<size_t>(1, cuts[i++ % cuts.size()]));
    const std::string why =
        FeedStream(&check, reinterpret_cast<const uint8_t*>(stream.data() + at), piece, rules);
    at += piece;
    if (refused.empty() && !why.empty()) {
      refused = why;
    } else if (!refused.empty()) {
      FUZZ_CHECK(!why.empty(), "a refused stream passed {} more bytes at {}", piece, at - piece);
    }
  }
  if (!refused.empty()) {
    const uint8_t more = 0;
    FUZZ_CHECK(!FeedStream(&check, &more, 1, rules).empty(),
               "a stream refused for '{}' took another byte", refused);
  }
  return refused;
}

void Run(const UcxStreamInput& input) {
  std::optional<StreamRules> rules = transport::internal::RulesForRxSegSize(
      input.rx_seg_size().empty() ? nullptr : input.rx_seg_size().c_str());
  if (!rules) return;  // a size the agent does not read (it then refuses no length)
  const std::string stream = Build(input);
  std::vector<size_t> cuts;
  for (uint64_t cut : input.cuts()) {
    cuts.push_back(static_cast<size_t>(std::min<uint64_t>(cut, kMaxStream)));
    if (cuts.size() == 64) break;
  }
  if (cuts.empty()) cuts.push_back(1);
  const std::string whole = Feed(stream, input, *rules, {stream.size()});
  const std::string cut = Feed(stream, input, *rules, cuts);
  const std::string bytes = Feed(stream, input, *rules, {1});
  FUZZ_CHECK(cut == whole, "fed whole: '{}'; fed in the input's pieces: '{}'", whole, cut);
  FUZZ_CHECK(bytes == whole, "fed whole: '{}'; fed a byte at a time: '{}'", whole, bytes);
}

}  // namespace

const google::protobuf::Message& InputPrototype() { return UcxStreamInput::default_instance(); }
const char* TargetName() { return "ucx_stream"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvagent::fuzz::UcxStreamInput input;
  if (!input.ParseFromArray(data, static_cast<int>(std::min<size_t>(size, 1 << 20)))) {
    // Not an input message: the bytes themselves after the magic number, cut in 7s.
    input.Clear();
    input.set_tail(reinterpret_cast<const char*>(data), size);
    input.add_cuts(7);
  }
  kvagent::fuzz::Run(input);
  return 0;
}
