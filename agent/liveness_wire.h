// The liveness door's datagrams: a watching agent's ping and the watched agent's
// answer, both signed with HMAC-SHA256 under a key derived from the secret the
// watched agent issued the watcher (AgentMetadata.notify_secret). Used by
// agent/liveness (both sides), cli/bench_peers (fake watchers) and the fuzz target.
// Pure functions and a key: no sockets, no threads.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"

namespace kvagent::agent {

// Every datagram is exactly this long; any other length is dropped unread.
inline constexpr size_t kLivenessDatagramBytes = 72;

enum class LivenessKind : uint8_t { kPing = 1, kAnswer = 2 };

// What a datagram says, once its MAC checked out.
struct LivenessMessage {
  LivenessKind kind = LivenessKind::kPing;
  // Which watcher key signed it: derived from the secret (LivenessKey::id), so the
  // datagram carries neither the secret nor the watcher's name.
  uint64_t key_id = 0;
  uint64_t incarnation = 0;  // the watched agent's incarnation
  uint64_t nonce = 0;        // the watcher's, random per watched peer and incarnation
  uint64_t seq = 0;          // increases with every ping; the answer repeats it
};

// Why a datagram was dropped (kOk: it was not).
enum class LivenessVerdict {
  kOk,
  kMalformed,         // wrong length, magic, version, kind or reserved bits
  kUnknownKey,        // no watcher holds that key id (the door's side)
  kBadMac,            // not signed by the key its id names
  kWrongIncarnation,  // meant for another incarnation of the watched agent
  kReplayed,          // an answer to a ping that was answered already (or never sent)
};
const char* LivenessVerdictName(LivenessVerdict verdict);

// The key both sides derive from one issued secret: HMAC-SHA256 prekeyed (the inner
// and outer pad digests computed once), so signing a datagram costs two short
// SHA-256 compressions and no allocation of key material.
class LivenessKey {
 public:
  // `secret` is the notify_secret (any length but empty).
  explicit LivenessKey(std::string_view secret);
  ~LivenessKey();
  LivenessKey(const LivenessKey&) = delete;
  LivenessKey& operator=(const LivenessKey&) = delete;

  uint64_t id() const { return id_; }
  // Writes the datagram for `message` (signed) into `out`.
  void Encode(const LivenessMessage& message, uint8_t out[kLivenessDatagramBytes]) const;
  // True when `datagram`'s MAC is this key's (constant-time compare). Encode and
  // Verify use one scratch context: one thread at a time per key.
  bool Verify(const uint8_t datagram[kLivenessDatagramBytes]) const;

 private:
  void Mac(const uint8_t* data, size_t n, uint8_t mac[32]) const;
  uint64_t id_ = 0;
  struct State;
  std::unique_ptr<State> state_;
};

// Checks the fixed fields of `data` (length, magic, version, kind, reserved) and
// reads them into `message`; the MAC is not checked (LivenessKey::Verify, once the
// key id found a key). kMalformed or kOk.
LivenessVerdict ParseLivenessDatagram(const uint8_t* data, size_t n, LivenessMessage* message);

// The door's whole check of one datagram of `n` bytes: a ping, for `incarnation`,
// whose key id `find` knows (null: unknown) and whose MAC is that key's. Cheap
// refusals first: a datagram costs a MAC only once its id names a key.
LivenessVerdict CheckPing(const uint8_t* data, size_t n, uint64_t incarnation,
                          absl::FunctionRef<const LivenessKey*(uint64_t key_id)> find,
                          LivenessMessage* ping, const LivenessKey** key);

// What a watcher expects of an answer from one watched peer.
struct LivenessExpectation {
  const LivenessKey* key = nullptr;
  uint64_t incarnation = 0;
  uint64_t answered_seq = 0;  // the newest ping answered already
  uint64_t sent_seq = 0;      // the newest ping sent
  uint64_t window = 16;       // pings older than sent_seq - window + 1 no longer count
};
// The watcher's whole check of one datagram: an answer whose nonce `find` knows (null:
// unknown), signed by that peer's key, from its incarnation, to a ping sent and not
// answered yet (kReplayed otherwise: an old answer played again proves nothing).
LivenessVerdict CheckAnswer(
    const uint8_t* data, size_t n,
    absl::FunctionRef<const LivenessExpectation*(uint64_t nonce)> find,
    LivenessMessage* answer);

}  // namespace kvagent::agent
