// Fuzz target: the liveness door's datagrams (agent/liveness_wire.h) through both
// checks the agent applies, the door's (CheckPing) and the prober's (CheckAnswer),
// raw or signed with the real key and then damaged (fuzz/liveness_input.proto).
// Whatever the bytes, nothing crashes, and:
//   - the door accepts only a 72-byte ping for its incarnation signed by the key it
//     holds, and that datagram is exactly what the key encodes for its fields (no
//     second form of a valid ping);
//   - the prober accepts only an answer with the watched peer's nonce, key and
//     incarnation to a ping sent and not yet answered, in its window; once accepted,
//     the same datagram again is refused as replayed;
//   - a datagram signed by a stranger's key, or damaged after signing, is never
//     accepted by either side.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>

#include "agent/liveness_wire.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "fuzz/liveness_input.pb.h"

namespace kvagent::fuzz {
namespace {

using agent::CheckAnswer;
using agent::CheckPing;
using agent::kLivenessDatagramBytes;
using agent::LivenessExpectation;
using agent::LivenessKey;
using agent::LivenessKind;
using agent::LivenessMessage;
using agent::LivenessVerdict;

constexpr uint64_t kIncarnation = 0x6b76616c69766521;
constexpr uint64_t kNonce = 0x1122334455667788;
constexpr uint64_t kWindow = 16;

const LivenessKey& Watcher() {
  static const LivenessKey* key = new LivenessKey("the secret issued to the watcher");
  return *key;
}
const LivenessKey& Stranger() {
  static const LivenessKey* key = new LivenessKey("a key nobody issued");
  return *key;
}

// The datagram `d` describes, and whether it may ever be accepted (a stranger's key or
// damage after signing may not).
std::string Build(const LivenessInput::Datagram& d, bool* may_pass) {
  *may_pass = true;
  if (!d.sign()) return d.raw();
  std::string out(kLivenessDatagramBytes, '\0');
  const LivenessKey& key = d.stranger() ? Stranger() : Watcher();
  key.Encode({static_cast<LivenessKind>(d.kind() & 0xff), key.id(), d.incarnation(), d.nonce(),
              d.seq()},
             reinterpret_cast<uint8_t*>(out.data()));
  if (d.stranger()) *may_pass = false;
  if (d.flip() != 0 && d.flip_at() < out.size() && (d.flip() & 0xff) != 0) {
    out[d.flip_at()] = static_cast<char>(out[d.flip_at()] ^ (d.flip() & 0xff));
    *may_pass = false;
  }
  if (d.truncate_to() != 0 && d.truncate_to() < out.size()) {
    out.resize(d.truncate_to());
    *may_pass = false;
  }
  return out;
}

// The bytes `key` writes for `m`: a valid datagram has no other form.
bool Canonical(const LivenessKey& key, const LivenessMessage& m, const uint8_t* data) {
  uint8_t again[kLivenessDatagramBytes];
  key.Encode(m, again);
  return std::memcmp(again, data, kLivenessDatagramBytes) == 0;
}

void Run(const LivenessInput& input) {
  LivenessExpectation expect{&Watcher(), kIncarnation, input.answered_seq(), input.sent_seq(),
                             kWindow};
  for (const auto& d : input.datagrams()) {
    bool may_pass = true;
    const std::string bytes = Build(d, &may_pass);
    const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());

    LivenessMessage ping;
    const LivenessKey* key = nullptr;
    const LivenessVerdict door = CheckPing(
        data, bytes.size(), kIncarnation,
        [](uint64_t id) { return id == Watcher().id() ? &Watcher() : nullptr; }, &ping, &key);
    if (door == LivenessVerdict::kOk) {
      FUZZ_CHECK(may_pass, "the door accepted a {}-byte datagram signed by a stranger or damaged",
                 bytes.size());
      FUZZ_CHECK(bytes.size() == kLivenessDatagramBytes, "the door accepted {} bytes",
                 bytes.size());
      FUZZ_CHECK(key == &Watcher(), "the door accepted a ping without its key");
      FUZZ_CHECK(ping.kind == LivenessKind::kPing, "the door accepted kind {}",
                 static_cast<int>(ping.kind));
      FUZZ_CHECK(ping.incarnation == kIncarnation, "the door accepted incarnation {:x}",
                 ping.incarnation);
      FUZZ_CHECK(Canonical(Watcher(), ping, data), "the door accepted a non-canonical ping");
    } else {
      FUZZ_CHECK(key == nullptr, "a refused ping left a key");
    }

    LivenessMessage answer;
    const LivenessVerdict prober = CheckAnswer(
        data, bytes.size(), [&](uint64_t nonce) { return nonce == kNonce ? &expect : nullptr; },
        &answer);
    if (prober == LivenessVerdict::kOk) {
      FUZZ_CHECK(may_pass, "the prober accepted a datagram signed by a stranger or damaged");
      FUZZ_CHECK(bytes.size() == kLivenessDatagramBytes, "the prober accepted {} bytes",
                 bytes.size());
      FUZZ_CHECK(answer.kind == LivenessKind::kAnswer && answer.nonce == kNonce &&
                     answer.incarnation == kIncarnation,
                 "the prober accepted kind {} nonce {:x} incarnation {:x}",
                 static_cast<int>(answer.kind), answer.nonce, answer.incarnation);
      FUZZ_CHECK(answer.seq > expect.answered_seq && answer.seq <= expect.sent_seq &&
                     expect.sent_seq - answer.seq < kWindow,
                 "the prober accepted seq {} (answered {}, sent {})", answer.seq,
                 expect.answered_seq, expect.sent_seq);
      FUZZ_CHECK(Canonical(Watcher(), answer, data), "the prober accepted a non-canonical answer");
      expect.answered_seq = answer.seq;  // as the prober records it
      LivenessMessage again;
      FUZZ_CHECK(CheckAnswer(data, bytes.size(),
                             [&](uint64_t nonce) { return nonce == kNonce ? &expect : nullptr; },
                             &again) == LivenessVerdict::kReplayed,
                 "an answer accepted twice (seq {})", answer.seq);
    }
    FUZZ_CHECK(std::string(agent::LivenessVerdictName(door)) != "unknown" &&
                   std::string(agent::LivenessVerdictName(prober)) != "unknown",
               "a verdict without a name");
  }
}

}  // namespace

const google::protobuf::Message& InputPrototype() { return LivenessInput::default_instance(); }
const char* TargetName() { return "liveness"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvagent::fuzz::LivenessInput input;
  if (!input.ParseFromArray(data, static_cast<int>(std::min<size_t>(size, 1 << 20)))) {
    // Not an input message: the bytes themselves as one datagram.
    input.Clear();
    input.set_sent_seq(3);
    input.add_datagrams()->set_raw(reinterpret_cast<const char*>(data), size);
  }
  kvagent::fuzz::Run(input);
  return 0;
}
