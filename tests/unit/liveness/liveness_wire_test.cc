// The liveness datagram format and both sides' checks (agent/liveness_wire.h): a good
// ping is accepted and its answer too; a bad MAC, an unknown key, a wrong incarnation,
// a short or long datagram, a wrong kind and a replayed or unsent answer are refused
// with the verdict the door and the prober count.
#include <cstring>
#include <string>

#include "agent/liveness_wire.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

constexpr uint64_t kIncarnation = 0x1234abcd5678ef90;

struct Datagram {
  uint8_t bytes[kLivenessDatagramBytes + 8] = {};
};

Datagram Ping(const LivenessKey& key, uint64_t seq, uint64_t incarnation = kIncarnation,
              uint64_t nonce = 77) {
  Datagram d;
  key.Encode({LivenessKind::kPing, key.id(), incarnation, nonce, seq}, d.bytes);
  return d;
}

Datagram Answer(const LivenessKey& key, uint64_t seq, uint64_t incarnation = kIncarnation,
                uint64_t nonce = 77) {
  Datagram d;
  key.Encode({LivenessKind::kAnswer, key.id(), incarnation, nonce, seq}, d.bytes);
  return d;
}

LivenessVerdict DoorCheck(const Datagram& d, const LivenessKey* known,
                          size_t n = kLivenessDatagramBytes) {
  LivenessMessage ping;
  const LivenessKey* key = nullptr;
  LivenessVerdict verdict = CheckPing(
      d.bytes, n, kIncarnation,
      [&](uint64_t id) { return known != nullptr && known->id() == id ? known : nullptr; },
      &ping, &key);
  if (verdict == LivenessVerdict::kOk) {
    CHECK(key == known);
  }
  return verdict;
}

TEST_CASE("both sides derive the same key from one secret, and other secrets differ") {
  LivenessKey watcher("secret-of-sixteen");
  LivenessKey door("secret-of-sixteen");
  LivenessKey other("secret-of-seventeen");
  CHECK(watcher.id() == door.id());
  CHECK(watcher.id() != other.id());
  Datagram d = Ping(watcher, 1);
  CHECK(door.Verify(d.bytes));
  CHECK_FALSE(other.Verify(d.bytes));
  // The secret itself never goes on the wire.
  const std::string secret = "secret-of-sixteen";
  CHECK(std::string(reinterpret_cast<const char*>(d.bytes), kLivenessDatagramBytes).find(secret) ==
        std::string::npos);
}

TEST_CASE("the door accepts a good ping and refuses every bad one with its reason") {
  LivenessKey key("s3cr3t");
  LivenessKey stranger("another");
  Datagram good = Ping(key, 5);
  CHECK(DoorCheck(good, &key) == LivenessVerdict::kOk);

  SECTION("bad MAC: a bit of the signed part flipped") {
    Datagram d = good;
    d.bytes[33] ^= 0x01;  // the sequence number
    CHECK(DoorCheck(d, &key) == LivenessVerdict::kBadMac);
  }
  SECTION("bad MAC: a bit of the MAC flipped") {
    Datagram d = good;
    d.bytes[kLivenessDatagramBytes - 1] ^= 0x80;
    CHECK(DoorCheck(d, &key) == LivenessVerdict::kBadMac);
  }
  SECTION("signed by a key the door did not issue") {
    CHECK(DoorCheck(Ping(stranger, 5), &key) == LivenessVerdict::kUnknownKey);
    CHECK(DoorCheck(good, nullptr) == LivenessVerdict::kUnknownKey);
  }
  SECTION("a key id that names the door's key, signed by another") {
    Datagram d = Ping(stranger, 5);
    const uint64_t id = key.id();
    for (int i = 0; i < 8; ++i) d.bytes[8 + i] = static_cast<uint8_t>(id >> (8 * i));
    CHECK(DoorCheck(d, &key) == LivenessVerdict::kBadMac);
  }
  SECTION("for another incarnation of the door's agent") {
    CHECK(DoorCheck(Ping(key, 5, kIncarnation + 1), &key) == LivenessVerdict::kWrongIncarnation);
  }
  SECTION("truncated, oversized, empty") {
    CHECK(DoorCheck(good, &key, kLivenessDatagramBytes - 1) == LivenessVerdict::kMalformed);
    CHECK(DoorCheck(good, &key, kLivenessDatagramBytes + 1) == LivenessVerdict::kMalformed);
    CHECK(DoorCheck(good, &key, 0) == LivenessVerdict::kMalformed);
  }
  SECTION("wrong magic, version, reserved bits or kind") {
    for (size_t at : {0, 4, 6, 7}) {
      Datagram d = good;
      d.bytes[at] ^= 0x10;
      CHECK(DoorCheck(d, &key) == LivenessVerdict::kMalformed);
    }
    Datagram d = good;
    d.bytes[5] = 9;
    CHECK(DoorCheck(d, &key) == LivenessVerdict::kMalformed);
    // An answer sent to the door is no ping (no reflection of answers as pings).
    CHECK(DoorCheck(Answer(key, 5), &key) == LivenessVerdict::kMalformed);
  }
}

TEST_CASE("the watcher accepts an answer to a ping it sent once, and nothing else") {
  LivenessKey key("s3cr3t");
  LivenessExpectation expect{&key, kIncarnation, /*answered_seq=*/10, /*sent_seq=*/12, 16};
  auto check = [&](const Datagram& d, uint64_t nonce = 77) {
    LivenessMessage answer;
    return CheckAnswer(
        d.bytes, kLivenessDatagramBytes,
        [&](uint64_t n) { return n == nonce ? &expect : nullptr; }, &answer);
  };
  CHECK(check(Answer(key, 11)) == LivenessVerdict::kOk);
  CHECK(check(Answer(key, 12)) == LivenessVerdict::kOk);
  // Answered already, or an old answer played again.
  CHECK(check(Answer(key, 10)) == LivenessVerdict::kReplayed);
  CHECK(check(Answer(key, 3)) == LivenessVerdict::kReplayed);
  // For a ping not sent yet.
  CHECK(check(Answer(key, 13)) == LivenessVerdict::kReplayed);
  // Another watcher's nonce (another agent, or this one before a restart).
  CHECK(check(Answer(key, 11), /*nonce=*/78) == LivenessVerdict::kUnknownKey);
  // A ping sent back is no answer (no reflection).
  CHECK(check(Ping(key, 11)) == LivenessVerdict::kMalformed);
  // From another incarnation of the peer, forged, or with another key.
  CHECK(check(Answer(key, 11, kIncarnation ^ 1)) == LivenessVerdict::kWrongIncarnation);
  Datagram forged = Answer(key, 11);
  forged.bytes[45] ^= 0x04;
  CHECK(check(forged) == LivenessVerdict::kBadMac);
  LivenessKey other("other");
  CHECK(check(Answer(other, 11)) == LivenessVerdict::kUnknownKey);
  // Pings too old for the window no longer count.
  expect.answered_seq = 0;
  expect.sent_seq = 40;
  CHECK(check(Answer(key, 24)) == LivenessVerdict::kReplayed);
  CHECK(check(Answer(key, 25)) == LivenessVerdict::kOk);
}

TEST_CASE("every verdict has a name") {
  for (LivenessVerdict v : {LivenessVerdict::kOk, LivenessVerdict::kMalformed,
                            LivenessVerdict::kUnknownKey, LivenessVerdict::kBadMac,
                            LivenessVerdict::kWrongIncarnation, LivenessVerdict::kReplayed}) {
    CHECK(std::string(LivenessVerdictName(v)) != "unknown");
  }
}

}  // namespace
}  // namespace kvagent::agent
