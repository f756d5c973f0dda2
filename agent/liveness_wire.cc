#include "agent/liveness_wire.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdlib>
#include <cstring>

namespace kvagent::agent {
namespace {

// Layout (little-endian): magic u32, version u8, kind u8, reserved u16 (0), key id
// u64, incarnation u64, nonce u64, seq u64, then HMAC-SHA256 of those 40 bytes.
constexpr uint32_t kMagic = 0x504C564B;  // "KVLP"
constexpr uint8_t kVersion = 1;
constexpr size_t kSignedBytes = 40;
static_assert(kSignedBytes + 32 == kLivenessDatagramBytes);

void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// HMAC-SHA256(key, label): derivations from the issued secret, done once per key.
std::array<uint8_t, 32> Derive(std::string_view secret, std::string_view label) {
  std::array<uint8_t, 32> out{};
  unsigned int n = 0;
  if (HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
           reinterpret_cast<const unsigned char*>(label.data()), label.size(), out.data(),
           &n) == nullptr) {
    std::abort();  // SHA-256 is always there: nothing can be signed without it
  }
  return out;
}

struct MdCtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
using MdCtxPtr = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

}  // namespace

const char* LivenessVerdictName(LivenessVerdict verdict) {
  switch (verdict) {
    case LivenessVerdict::kOk: return "ok";
    case LivenessVerdict::kMalformed: return "malformed";
    case LivenessVerdict::kUnknownKey: return "unknown key";
    case LivenessVerdict::kBadMac: return "bad MAC";
    case LivenessVerdict::kWrongIncarnation: return "wrong incarnation";
    case LivenessVerdict::kReplayed: return "replayed";
  }
  return "unknown";
}

// The digests after the inner and outer pads (RFC 2104), and a scratch context the
// one thread that uses this key copies them into.
struct LivenessKey::State {
  MdCtxPtr inner{EVP_MD_CTX_new()};
  MdCtxPtr outer{EVP_MD_CTX_new()};
  MdCtxPtr scratch{EVP_MD_CTX_new()};
};

LivenessKey::LivenessKey(std::string_view secret) : state_(std::make_unique<State>()) {
  const std::array<uint8_t, 32> key = Derive(secret, "kvagent liveness key v1");
  const std::array<uint8_t, 32> id = Derive(secret, "kvagent liveness id v1");
  id_ = Get64(id.data());
  uint8_t ipad[64], opad[64];
  for (size_t i = 0; i < 64; ++i) {
    const uint8_t k = i < key.size() ? key[i] : 0;
    ipad[i] = k ^ 0x36;
    opad[i] = k ^ 0x5c;
  }
  if (!state_->inner || !state_->outer || !state_->scratch ||
      EVP_DigestInit_ex(state_->inner.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(state_->inner.get(), ipad, sizeof ipad) != 1 ||
      EVP_DigestInit_ex(state_->outer.get(), EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(state_->outer.get(), opad, sizeof opad) != 1) {
    std::abort();
  }
}

LivenessKey::~LivenessKey() = default;

void LivenessKey::Mac(const uint8_t* data, size_t n, uint8_t mac[32]) const {
  EVP_MD_CTX* c = state_->scratch.get();
  uint8_t inner[32];
  unsigned int len = 0;
  if (EVP_MD_CTX_copy_ex(c, state_->inner.get()) != 1 || EVP_DigestUpdate(c, data, n) != 1 ||
      EVP_DigestFinal_ex(c, inner, &len) != 1 || EVP_MD_CTX_copy_ex(c, state_->outer.get()) != 1 ||
      EVP_DigestUpdate(c, inner, sizeof inner) != 1 || EVP_DigestFinal_ex(c, mac, &len) != 1) {
    std::abort();
  }
}

void LivenessKey::Encode(const LivenessMessage& message,
                         uint8_t out[kLivenessDatagramBytes]) const {
  std::memset(out, 0, kLivenessDatagramBytes);
  out[0] = kMagic & 0xff;
  out[1] = (kMagic >> 8) & 0xff;
  out[2] = (kMagic >> 16) & 0xff;
  out[3] = (kMagic >> 24) & 0xff;
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(message.kind);
  Put64(out + 8, id_);
  Put64(out + 16, message.incarnation);
  Put64(out + 24, message.nonce);
  Put64(out + 32, message.seq);
  Mac(out, kSignedBytes, out + kSignedBytes);
}

bool LivenessKey::Verify(const uint8_t datagram[kLivenessDatagramBytes]) const {
  uint8_t mac[32];
  Mac(datagram, kSignedBytes, mac);
  uint8_t diff = 0;
  for (size_t i = 0; i < sizeof mac; ++i) diff |= mac[i] ^ datagram[kSignedBytes + i];
  return diff == 0;
}

LivenessVerdict ParseLivenessDatagram(const uint8_t* data, size_t n, LivenessMessage* message) {
  if (n != kLivenessDatagramBytes) return LivenessVerdict::kMalformed;
  const uint32_t magic = static_cast<uint32_t>(data[0]) | (static_cast<uint32_t>(data[1]) << 8) |
                         (static_cast<uint32_t>(data[2]) << 16) |
                         (static_cast<uint32_t>(data[3]) << 24);
  if (magic != kMagic || data[4] != kVersion || data[6] != 0 || data[7] != 0) {
    return LivenessVerdict::kMalformed;
  }
  if (data[5] != static_cast<uint8_t>(LivenessKind::kPing) &&
      data[5] != static_cast<uint8_t>(LivenessKind::kAnswer)) {
    return LivenessVerdict::kMalformed;
  }
  message->kind = static_cast<LivenessKind>(data[5]);
  message->key_id = Get64(data + 8);
  message->incarnation = Get64(data + 16);
  message->nonce = Get64(data + 24);
  message->seq = Get64(data + 32);
  return LivenessVerdict::kOk;
}

LivenessVerdict CheckPing(const uint8_t* data, size_t n, uint64_t incarnation,
                          absl::FunctionRef<const LivenessKey*(uint64_t key_id)> find,
                          LivenessMessage* ping, const LivenessKey** key) {
  *key = nullptr;
  LivenessVerdict verdict = ParseLivenessDatagram(data, n, ping);
  if (verdict != LivenessVerdict::kOk) return verdict;
  if (ping->kind != LivenessKind::kPing) return LivenessVerdict::kMalformed;
  if (ping->incarnation != incarnation) return LivenessVerdict::kWrongIncarnation;
  const LivenessKey* found = find(ping->key_id);
  if (found == nullptr || found->id() != ping->key_id) return LivenessVerdict::kUnknownKey;
  if (!found->Verify(data)) return LivenessVerdict::kBadMac;
  *key = found;
  return LivenessVerdict::kOk;
}

LivenessVerdict CheckAnswer(
    const uint8_t* data, size_t n,
    absl::FunctionRef<const LivenessExpectation*(uint64_t nonce)> find,
    LivenessMessage* answer) {
  LivenessVerdict verdict = ParseLivenessDatagram(data, n, answer);
  if (verdict != LivenessVerdict::kOk) return verdict;
  if (answer->kind != LivenessKind::kAnswer) return LivenessVerdict::kMalformed;
  const LivenessExpectation* expect = find(answer->nonce);
  if (expect == nullptr || expect->key == nullptr || expect->key->id() != answer->key_id) {
    return LivenessVerdict::kUnknownKey;
  }
  if (!expect->key->Verify(data)) return LivenessVerdict::kBadMac;
  if (answer->incarnation != expect->incarnation) return LivenessVerdict::kWrongIncarnation;
  if (answer->seq <= expect->answered_seq || answer->seq > expect->sent_seq ||
      expect->sent_seq - answer->seq >= expect->window) {
    return LivenessVerdict::kReplayed;
  }
  return LivenessVerdict::kOk;
}

}  // namespace kvagent::agent
