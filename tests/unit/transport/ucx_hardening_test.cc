// HardenUcxForPeers in a process of its own (it changes UCP's handler table for the
// whole process): its outcome, and what a worker created afterwards does with a stock
// UCX peer's software RMA (inside and outside memory registered for peers), tagged
// messages, and memory retired while a get reply may still read it. The same against a
// real agent, with atomics and stream data too: tests/security:forgery_test.
#include "transport/ucx_hardening.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/stock_ucx_peer.h"
#include "tests/security/stock_uct.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::transport {
namespace {

using testing::StockUcxPeer;

struct Hardened {
  std::unique_ptr<UcxContext> context;
  std::unique_ptr<UcxWorker> worker;
  static Hardened Make() {
    absl::Status hardened = HardenUcxForPeers();
    INFO(hardened.ToString());
    REQUIRE(hardened.ok());
    // No grace after a pid's last hold (SetSameHostGrace), but in the grace's own test:
    // these cases check that forgetting a pid refuses it.
    SetSameHostGrace(std::chrono::seconds(0));
    Hardened h;
    auto context = UcxContext::Create();
    REQUIRE(context.ok());
    h.context = std::move(*context);
    CHECK(h.context->takes_tags());
    auto worker = UcxWorker::Create(*h.context, "hardened");
    REQUIRE(worker.ok());
    h.worker = std::move(*worker);
    return h;
  }
};

// Waits up to 10 s for `done`.
template <typename F>
bool Eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST_CASE("HardenUcxForPeers checks and patches UCP's table once, and names what it refuses") {
  // An operator's UCX_PROTO_INDIRECT_ID=off is overridden (the id check needs every id
  // indirect): set here when this case is the first to harden the process.
  const bool hardens_first = !UcxHardenedForPeers();
  if (hardens_first) {
    setenv("UCX_PROTO_INDIRECT_ID", "off", /*overwrite=*/1);
    setenv("UCX_MAX_EAGER_LANES", "2", /*overwrite=*/1);
  }
  absl::Status first = HardenUcxForPeers();
  INFO(first.ToString());
  REQUIRE(first.ok());
  CHECK(UcxHardenedForPeers());
  CHECK(HardenUcxForPeers().ok());  // later calls return the first outcome
  const std::vector<std::string> refused = UcxRefusedProtocols();
  CHECK(refused.size() == 21);
  for (const char* name :
       {"put (software RMA) outside peer memory", "get request (software RMA) outside peer memory",
        "atomic request", "atomic reply", "stream data", "tagged send's first fragment",
        "tagged send's later fragment",
        "any of 15 protocols naming an endpoint or request id this agent did not give out",
        "synchronous tagged send's first fragment",
        "active message or rendezvous request whose user header, data, fragment or kind does "
        "not fit the message it came in (UCX 1.13 would abort or copy past its buffer)",
        "fragment of an active message that does not follow the data so far, or first "
        "fragment of one past what this agent assembles (UCX 1.13 would copy it past its "
        "buffer or abort)",
        "put or get (software RMA) whose endpoint has 65536 replies waiting unread "
        "(--ucx-held-replies)",
        "wireup request or endpoint check that would have UCX make an endpoint past the 1024 "
        "it holds for peers (--ucx-peer-endpoints)",
        "remote key whose entry names a shared memory segment to attach (UCX's posix or sysv "
        "domain)",
        "remote key whose entry UCX cannot unpack (UCX 1.13 would crash releasing it)",
        "shared memory attach, TCP connection or cma read or write to a process of this "
        "host no door proved (a peer's worker address naming another process)",
        "peer's posix FIFO in a directory this agent's UCX cannot attach (UCX 1.13 would "
        "abort)",
        "wireup request whose address lists no transport this agent reaches, or that would "
        "give an endpoint a second configuration, and (made a repeat of the peer's own) a "
        "reply whose sender contradicts the endpoint's peer (UCX 1.13 would abort)",
        "worker address entry without the device or interface address its transport reads "
        "(taken as unreachable; UCX 1.13's tcp would read through it)",
        "put completion (software RMA) that comes while the worker has no put in flight (UCX "
        "1.13 would abort)"}) {
    CHECK(std::find(refused.begin(), refused.end(), name) != refused.end());
  }
  // Every endpoint and request id a context gives out from here on is indirect.
  INFO("this case hardened the process first: " << hardens_first);
  const char* indirect = std::getenv("UCX_PROTO_INDIRECT_ID");
  REQUIRE(indirect != nullptr);
  CHECK(std::string(indirect) == "on");
  // A message's fragments on one lane, in order, as the assembly takes them.
  const char* eager_lanes = std::getenv("UCX_MAX_EAGER_LANES");
  REQUIRE(eager_lanes != nullptr);
  CHECK(std::string(eager_lanes) == "1");
}

// UCP's entry for one of its protocols (ucp_am_handler_t's first two fields): its
// callback is what UCT calls with each message of that id, the worker as `arg`.
struct UcpProtocolEntry {
  uint64_t features;
  ucs_status_t (*cb)(void* arg, void* data, size_t length, unsigned flags);
};

// The 8 bytes of `v` as UCP's messages carry it.
std::string U64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

// Has `worker` hand each whole active message of UCP id 7 to `cb`.
void TakeActiveMessage7(ucp_worker_h worker, ucp_am_recv_callback_t cb) {
  ucp_am_handler_param_t handler{};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB;
  handler.id = 7;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = cb;
  REQUIRE(ucp_worker_set_am_recv_handler(worker, &handler) == UCS_OK);
}

TEST_CASE(
    "a hardened worker drops a peer's message naming an endpoint or request id it did not "
    "give out, instead of dereferencing it") {
  Hardened h = Hardened::Make();
  // A worker of the hardened context that nothing progresses: each message is fed to
  // the callback UCT would call, on this thread, as a hostile peer could send it.
  ucp_worker_params_t params{};
  ucp_worker_h worker = nullptr;
  REQUIRE(ucp_worker_create(h.context->get(), &params, &worker) == UCS_OK);
  // The region a forged put or get names is registered for peers: only the id is wrong.
  std::vector<char> region(4096, 'r');
  AllowPeerRange(region.data(), region.size(), UCS_MEMORY_TYPE_HOST);
  // Ids UCX 1.13 would take as pointers (0 it asserts against, which aborts): one to
  // unmapped memory, one to memory of this process (a request it would complete).
  void* gone = mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(gone != MAP_FAILED);
  munmap(gone, 4096);
  std::vector<uint64_t> fake_request(64, 0);
  const uint64_t forged[] = {0, reinterpret_cast<uint64_t>(gone),
                             reinterpret_cast<uint64_t>(fake_request.data())};
  // Where UCX 1.13 looks each id up: bytes from the start, or back from the end (a
  // footer); `sender_at`: the sender's own request or endpoint id, which UCX asserts is
  // not 0.
  struct Case {
    const char* symbol;
    size_t id_at;
    bool from_end;
    size_t length;
    int sender_at;
  };
  const Case cases[] = {
      {"PUT", 8, false, 20 + 64, -1},
      {"GET_REQ", 16, false, 36, -1},
      {"GET_REP", 0, false, 8 + 64, -1},
      {"CMPL", 0, false, 8, -1},
      {"EAGER_SYNC_ONLY", 8, false, 24 + 64, 16},
      {"EAGER_SYNC_ACK", 0, false, 16, -1},
      {"RNDV_RTS", 8, false, 96, -1},
      {"RNDV_ATS", 0, false, 16, -1},
      {"RNDV_ATP", 0, false, 16, -1},
      {"RNDV_RTR", 0, false, 48, -1},
      {"RNDV_DATA", 0, false, 16 + 64, -1},
      {"AM_FIRST", 16, true, 64, -1},
      {"AM_MIDDLE", 8, true, 64, -1},
      {"AM_SINGLE_REPLY", 8, true, 64, -1},
      {"WIREUP", 12, false, 128, 4},
  };
  for (const Case& c : cases) {
    const std::string symbol = std::string("ucp_am_handler_UCP_AM_ID_") + c.symbol;
    auto* entry = static_cast<UcpProtocolEntry*>(dlsym(RTLD_DEFAULT, symbol.c_str()));
    REQUIRE(entry != nullptr);
    const bool wireup = std::string(c.symbol) == "WIREUP";
    std::vector<uint8_t> message(c.length, 0);
    const auto address = reinterpret_cast<uint64_t>(region.data());
    if (std::string(c.symbol) == "PUT" || std::string(c.symbol) == "GET_REQ") {
      std::memcpy(message.data(), &address, 8);  // inside the region: only the id is wrong
    }
    if (std::string(c.symbol) == "GET_REQ") {
      const uint64_t length = 64;
      std::memcpy(message.data() + 8, &length, 8);
      const uint64_t reply_to = 0x41;
      std::memcpy(message.data() + 24, &reply_to, 8);
    }
    if (wireup) {
      message[0] = 2;  // a reply: it names the endpoint it answers
      // Its address: a header, the worker's uuid, then no device (UCP reads no further).
      message[20] = 0x20;
      message[29] = static_cast<char>(0xff);
    }
    if (std::string(c.symbol) == "AM_FIRST") {
      const uint64_t whole = 1024;  // its whole message: more than this fragment's data
      std::memcpy(message.data() + c.length - 8, &whole, 8);
    }
    const uint64_t sender = 0x1234;
    if (c.sender_at >= 0) std::memcpy(message.data() + c.sender_at, &sender, 8);
    const size_t id_at = c.from_end ? c.length - c.id_at : c.id_at;
    for (uint64_t id : forged) {
      INFO(c.symbol << " naming id " << std::hex << id);
      std::memcpy(message.data() + id_at, &id, 8);
      const uint64_t before = UcxRefusedMessages();
      CHECK(entry->cb(worker, message.data(), message.size(), 0) == UCS_OK);
      CHECK(UcxRefusedMessages() - before == 1);
    }
    const uint64_t before = UcxRefusedMessages();
    {
      // Too short to hold the id: dropped unread too.
      INFO(c.symbol << " cut short");
      const size_t short_length = c.from_end ? c.id_at - 1 : c.id_at + 7;
      CHECK(entry->cb(worker, message.data(), short_length, 0) == UCS_OK);
      CHECK(UcxRefusedMessages() - before == 1);
    }
    // An indirect id goes on to UCP, which looks it up, finds none, and drops it.
    // Fragments are assembled by the check itself: a first one starts a message (of
    // 1,024 bytes here), and a later one that does not follow it (its offset is 0 here)
    // is dropped; so is a put's completion, as this worker has no put in flight.
    INFO(c.symbol << " naming an indirect id no endpoint or request has");
    const uint64_t unknown = 0x41;
    std::memcpy(message.data() + id_at, &unknown, 8);
    CHECK(entry->cb(worker, message.data(), message.size(), 0) == UCS_OK);
    const bool dropped_here =
        std::string(c.symbol) == "AM_MIDDLE" || std::string(c.symbol) == "CMPL";
    CHECK(UcxRefusedMessages() - before == (dropped_here ? 2u : 1u));
    if (c.sender_at >= 0) {
      INFO(c.symbol << " whose sender's own request id is 0");
      const uint64_t zero = 0;
      std::memcpy(message.data() + c.sender_at, &zero, 8);
      CHECK(entry->cb(worker, message.data(), message.size(), 0) == UCS_OK);
      CHECK(UcxRefusedMessages() - before == 2);
    }
  }
  CHECK(std::all_of(fake_request.begin(), fake_request.end(), [](uint64_t v) { return v == 0; }));
  CHECK(std::all_of(region.begin(), region.end(), [](char v) { return v == 'r'; }));
  ForbidPeerRange(region.data(), region.size());
  ucp_worker_destroy(worker);
}

// kvagent's own protocol is UCP's active messages, whose messages give lengths UCX 1.13
// trusts: a user header longer than the message, a message shorter than its header and
// footer, a first fragment longer than the whole message it starts. An 8-byte AM_SINGLE
// message naming a 100-byte user header made a stock UCP abort (its assertion
// total_length >= header_length + sizeof(ucp_am_hdr_t)); an AM_MIDDLE of 13 bytes too
// (am_length > 24), an EAGER_FIRST of 13 bytes (req->recv.remaining >= length), and a
// rendezvous request (RNDV_RTS) of a kind other than a tagged send's or an active
// message's (ucp_rndv_rts_is_tag(rts_hdr)): each from any peer whose messages reach the
// worker. An active message's rendezvous request naming a user header longer than the
// message aborts too once it names a real endpoint (the next case). Each is dropped
// unread and
// counted; one that fits goes on to UCP. Fed to the callbacks UCT calls, as in the case
// above (each would abort this test's process without the checks).
TEST_CASE("a hardened worker drops a peer's active message whose lengths do not fit it") {
  Hardened h = Hardened::Make();
  ucp_worker_params_t params{};
  ucp_worker_h worker = nullptr;
  REQUIRE(ucp_worker_create(h.context->get(), &params, &worker) == UCS_OK);
  // UCP's active message 7 is counted here (a message that fits and names no endpoint
  // reaches it).
  static int delivered = 0;
  TakeActiveMessage7(worker,
                     [](void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
                       ++delivered;
                       return UCS_OK;
                     });
  // ucp_am_hdr_t: UCP's active message id 7, flags 0,
  // `user_header` bytes of user header; then `data` bytes; then `footer`.
  auto message = [](uint32_t user_header, size_t data, const std::string& footer) {
    std::string out(8, '\0');
    out[0] = 7;
    std::memcpy(out.data() + 4, &user_header, 4);
    return out + std::string(data, 'd') + footer;
  };
  const uint64_t indirect = 0x41;  // an id UCP looks up (and finds no endpoint for)
  const std::string id = U64(indirect);
  auto first_footer = [&](uint64_t whole) { return id + id + U64(whole); };
  auto middle = [&](uint64_t offset, size_t data) {
    return U64(offset) + std::string(data, 'm') + id + id;
  };
  // ucp_rndv_rts_hdr_t: ucp_am_hdr_t (id 7, its user header length) or a tag, endpoint
  // id, request id, address, size, kind; then `rest` (a packed key, a user header).
  auto rts = [&](uint32_t user_header, uint8_t kind, const std::string& rest) {
    std::string out(8, '\0');
    out[0] = 7;
    std::memcpy(out.data() + 4, &user_header, 4);
    const uint64_t size = 64;
    return out + id + id + std::string(8, '\0') + U64(size) +
           std::string(1, static_cast<char>(kind)) + rest;
  };
  struct Case {
    const char* symbol;
    std::string what;
    std::string bytes;
    bool dropped;  // by the check (else UCP takes it: delivered, or no endpoint has the id)
  };
  const std::vector<Case> cases = {
      {"AM_SINGLE", "8 bytes naming a 100-byte user header", message(100, 0, ""), true},
      {"AM_SINGLE", "7 bytes", message(0, 0, "").substr(0, 7), true},
      {"AM_SINGLE", "0 bytes", "", true},
      {"AM_SINGLE", "a 4-byte user header in 12 bytes", message(4, 0, "") + "uhdr", false},
      {"AM_SINGLE", "a 5-byte user header in 12 bytes", message(5, 0, "") + "uhdr", true},
      {"AM_SINGLE_REPLY", "15 bytes", message(0, 7, ""), true},
      {"AM_SINGLE_REPLY", "a user header running into the footer", message(9, 8, id), true},
      {"AM_SINGLE_REPLY", "a user header that fits", message(8, 8, id), false},
      {"AM_FIRST", "31 bytes", message(0, 0, first_footer(64)).substr(0, 31), true},
      {"AM_FIRST", "a user header running into the footer", message(1, 0, first_footer(64)),
       true},
      {"AM_FIRST", "16 bytes of data of a message said to hold 8",
       message(0, 16, first_footer(8)), true},
      {"AM_FIRST", "a message said to hold 2^63 bytes", message(0, 16, first_footer(1ull << 63)),
       true},
      {"AM_FIRST", "16 bytes of data of a message of 64", message(0, 16, first_footer(64)),
       false},
      {"AM_MIDDLE", "13 bytes", std::string("\x01\x02\x03\x04\x05\x06\x07\x08probe", 13),
       true},
      {"AM_MIDDLE", "24 bytes (no data)", middle(16, 0), true},
      {"AM_MIDDLE", "one byte of data, next in the message", middle(16, 1), false},
      {"EAGER_FIRST", "13 bytes", std::string("\x01\x02\x03\x04\x05\x06\x07\x08probe", 13),
       true},
      {"EAGER_MIDDLE", "1 byte", "P", true},
      {"EAGER_SYNC_FIRST", "any (its later fragments are dropped)", std::string(104, 'S'),
       true},
      {"RNDV_RTS", "40 bytes", rts(0, 0, "").substr(0, 40), true},
      {"RNDV_RTS", "of kind 0x50", rts(0, 0x50, ""), true},
      {"RNDV_RTS", "an active message's, naming a 100-byte user header in 16", rts(100, 1, id + id),
       true},
      {"RNDV_RTS", "an active message's with a user header that fits", rts(16, 1, id + id), false},
      {"RNDV_RTS", "a tagged send's", rts(0, 0, ""), false},
  };
  for (const Case& c : cases) {
    INFO(c.symbol << ": " << c.what);
    const std::string symbol = std::string("ucp_am_handler_UCP_AM_ID_") + c.symbol;
    auto* entry = static_cast<UcpProtocolEntry*>(dlsym(RTLD_DEFAULT, symbol.c_str()));
    REQUIRE(entry != nullptr);
    std::vector<uint8_t> bytes(c.bytes.begin(), c.bytes.end());
    bytes.reserve(1);  // a non-null buffer for the empty message
    const uint64_t before = UcxRefusedMessages();
    const int delivered_before = delivered;
    CHECK(entry->cb(worker, bytes.data(), bytes.size(), 0) == UCS_OK);
    CHECK(UcxRefusedMessages() - before == (c.dropped ? 1u : 0u));
    // Only AM_SINGLE names no endpoint: the others' id 0x41 is no endpoint's (the
    // fragments' message is not whole).
    const bool delivers = !c.dropped && std::string(c.symbol) == "AM_SINGLE";
    CHECK(delivered - delivered_before == (delivers ? 1 : 0));
  }
  ucp_worker_destroy(worker);
}

// A peer's active message bigger than its transport's segment comes in fragments: a
// first that says how big the whole is, then later ones, each giving its offset. UCX
// 1.13 copied a later fragment to the offset it gave in the buffer the first allocated,
// unchecked, and stopped on an assertion when a first fragment came twice for a message
// it was assembling. The hardened worker assembles them itself: fed to the callbacks UCT
// calls, as above, each fragment that does not follow its message is dropped, and whole
// messages reach the application's handler byte for byte.
TEST_CASE("a hardened worker assembles a peer's fragmented active message itself and drops "
          "fragments that do not follow it") {
  Hardened h = Hardened::Make();
  ucp_worker_params_t params{};
  ucp_worker_h worker = nullptr;
  REQUIRE(ucp_worker_create(h.context->get(), &params, &worker) == UCS_OK);
  static std::vector<std::pair<std::string, std::string>> delivered;  // user header, data
  delivered.clear();
  TakeActiveMessage7(worker, [](void*, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t*) {
    delivered.emplace_back(std::string(static_cast<const char*>(header), header_length),
                           std::string(static_cast<const char*>(data), length));
    return UCS_OK;
  });
  auto* first_entry =
      static_cast<UcpProtocolEntry*>(dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_AM_FIRST"));
  auto* middle_entry =
      static_cast<UcpProtocolEntry*>(dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_AM_MIDDLE"));
  REQUIRE(first_entry != nullptr);
  REQUIRE(middle_entry != nullptr);
  const uint64_t endpoint = 0x41;  // indirect; no endpoint has it (only a reply needs one)
  // UCP's layouts: ucp_am_hdr_t (id 7, flags, user header length), the data, the user
  // header, then message id, endpoint id and the whole message's size.
  auto first = [&](uint64_t message, uint64_t whole, const std::string& data,
                   const std::string& user_header = "") {
    std::string out(8, '\0');
    out[0] = 7;
    const auto length = static_cast<uint32_t>(user_header.size());
    std::memcpy(out.data() + 4, &length, 4);
    return out + data + user_header + U64(message) + U64(endpoint) + U64(whole);
  };
  // Its offset, its data, then message id and endpoint id.
  auto middle = [&](uint64_t message, uint64_t offset, const std::string& data) {
    return U64(offset) + data + U64(message) + U64(endpoint);
  };
  // Feeds one fragment; returns how many messages were dropped for it.
  auto feed = [&](UcpProtocolEntry* entry, const std::string& fragment) {
    std::vector<uint8_t> bytes(fragment.begin(), fragment.end());
    const uint64_t before = UcxRefusedMessages();
    CHECK(entry->cb(worker, bytes.data(), bytes.size(), 0) == UCS_OK);
    return UcxRefusedMessages() - before;
  };
  const AmAssembly before = AmAssemblyNow();
  const std::string data = "0123456789abcdefghijklmnopqrstuvwxyzABCD";  // 40 bytes

  {
    INFO("a message of 40 bytes and a 4-byte user header, in three fragments");
    CHECK(feed(first_entry, first(0x1001, 40, data.substr(0, 16), "uhdr")) == 0);
    CHECK(AmAssemblyNow().messages - before.messages == 1);
    CHECK(AmAssemblyNow().bytes - before.bytes == 8 + 40 + 4);
    CHECK(feed(middle_entry, middle(0x1001, 16, data.substr(16, 16))) == 0);
    CHECK(delivered.empty());
    CHECK(feed(middle_entry, middle(0x1001, 32, data.substr(32))) == 0);
    REQUIRE(delivered.size() == 1);
    CHECK(delivered[0].first == "uhdr");
    CHECK(delivered[0].second == data);
    CHECK(AmAssemblyNow().assembled - before.assembled == 1);
    CHECK(AmAssemblyNow().messages == before.messages);
    CHECK(AmAssemblyNow().bytes == before.bytes);
  }
  delivered.clear();
  {
    INFO("a later fragment naming an offset 1 TiB past its message's start");
    CHECK(feed(first_entry, first(0x1002, 40, data.substr(0, 16))) == 0);
    CHECK(feed(middle_entry, middle(0x1002, 1ull << 40, data.substr(16, 16))) == 1);
    // Its message is dropped: the honest fragment after it has no first any more.
    CHECK(feed(middle_entry, middle(0x1002, 16, data.substr(16))) == 1);
  }
  {
    INFO("a later fragment behind the data so far (overlapping it)");
    CHECK(feed(first_entry, first(0x1003, 40, data.substr(0, 16))) == 0);
    CHECK(feed(middle_entry, middle(0x1003, 8, data.substr(8, 16))) == 1);
  }
  {
    INFO("a later fragment ahead of the data so far (a hole before it)");
    CHECK(feed(first_entry, first(0x1004, 40, data.substr(0, 16))) == 0);
    CHECK(feed(middle_entry, middle(0x1004, 24, data.substr(24))) == 1);
  }
  {
    INFO("a later fragment running past its message's end");
    CHECK(feed(first_entry, first(0x1005, 40, data.substr(0, 16))) == 0);
    CHECK(feed(middle_entry, middle(0x1005, 16, data.substr(16) + "overrun")) == 1);
  }
  {
    INFO("a later fragment whose message never started");
    CHECK(feed(middle_entry, middle(0x1006, 16, data.substr(16))) == 1);
  }
  CHECK(delivered.empty());
  {
    INFO("a first fragment again for a message being assembled (UCX 1.13 aborts on it)");
    CHECK(feed(first_entry, first(0x1007, 40, data.substr(0, 16))) == 0);
    CHECK(feed(first_entry, first(0x1007, 24, std::string(24, 'x'))) == 1);
    // The message being assembled goes on.
    CHECK(feed(middle_entry, middle(0x1007, 16, data.substr(16))) == 0);
    REQUIRE(delivered.size() == 1);
    CHECK(delivered[0].second == data);
  }
  delivered.clear();
  {
    INFO("a first fragment holding its whole message");
    CHECK(feed(first_entry, first(0x1008, 40, data, "h")) == 0);
    REQUIRE(delivered.size() == 1);
    CHECK(delivered[0] == std::make_pair(std::string("h"), data));
  }
  delivered.clear();
  CHECK(AmAssemblyNow().messages == before.messages);
  CHECK(AmAssemblyNow().bytes == before.bytes);
  {
    INFO("the bounds: a message over the most one may hold, over the bytes and the number "
         "held for all");
    AmAssemblyLimits limits;
    limits.max_message_bytes = 64;
    limits.max_bytes = (before.bytes + 150);
    limits.idle = std::chrono::hours(1);
    SetAmAssemblyLimits(limits);
    CHECK(feed(first_entry, first(0x1009, 60, data.substr(0, 16), "12345")) == 1);  // 65
    CHECK(feed(first_entry, first(0x100a, 60, data.substr(0, 16))) == 0);  // 68 bytes held
    CHECK(feed(first_entry, first(0x100b, 60, data.substr(0, 16))) == 0);  // 136
    CHECK(feed(first_entry, first(0x100c, 60, data.substr(0, 16))) == 1);  // 204: over 150
    limits.max_bytes = 1 << 20;
    limits.max_messages = before.messages + 2;
    SetAmAssemblyLimits(limits);
    CHECK(feed(first_entry, first(0x100c, 60, data.substr(0, 16))) == 1);  // a third
    const std::string rest(44, 'r');
    CHECK(feed(middle_entry, middle(0x100a, 16, rest)) == 0);
    CHECK(feed(first_entry, first(0x100c, 60, data.substr(0, 16))) == 0);  // room again
    CHECK(feed(middle_entry, middle(0x100b, 16, rest)) == 0);
    CHECK(feed(middle_entry, middle(0x100c, 16, rest)) == 0);
    CHECK(delivered.size() == 3);
    CHECK(AmAssemblyNow().peak_bytes >= before.bytes + 136);
  }
  delivered.clear();
  {
    INFO("a message with no fragment for its idle time is dropped as another one starts");
    AmAssemblyLimits limits;
    limits.idle = std::chrono::milliseconds(1);
    SetAmAssemblyLimits(limits);
    CHECK(feed(first_entry, first(0x100d, 40, data.substr(0, 16))) == 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // past the sweeps' pace
    const uint64_t abandoned = AmAssemblyNow().abandoned;
    CHECK(feed(first_entry, first(0x100e, 40, data.substr(0, 16))) == 0);
    // (and any an earlier case left unfinished on this thread)
    CHECK(AmAssemblyNow().abandoned - abandoned >= 1);
    CHECK(feed(middle_entry, middle(0x100d, 16, data.substr(16))) == 1);
    CHECK(feed(middle_entry, middle(0x100e, 16, data.substr(16))) == 0);
    CHECK(delivered.size() == 1);
  }
  SetAmAssemblyLimits(AmAssemblyLimits{});
  CHECK(AmAssemblyNow().messages <= before.messages);
  CHECK(AmAssemblyNow().bytes <= before.bytes);
  ucp_worker_destroy(worker);
}

// The same from a stock UCX peer that sends for real: its active messages of 300 KiB go
// in fragments of about 8 KiB (over shared memory, and over tcp with peer error
// handling), and arrive whole at the hardened worker's handler, with the endpoint to
// reply on when the sender asked for one.
TEST_CASE("a stock peer's fragmented active messages arrive whole, with their reply endpoint") {
  Hardened h = Hardened::Make();
  absl::Mutex mu;
  std::vector<std::tuple<std::string, std::string, bool>> got;  // header, data, reply
  h.worker->SetAmDataHandler(7, [&](const AmMessage& message) {
    absl::MutexLock lock(&mu);
    got.emplace_back(std::string(message.header), std::string(message.data),
                     static_cast<bool>(message.reply_ep));
    return false;
  });
  std::string data(300 << 10, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 131 + (i >> 9));
  const std::string header = "a user header";
  for (bool peer_errors : {false, true}) {
    INFO((peer_errors ? "peer error handling (tcp)" : "no error handling (shared memory)"));
    {
      absl::MutexLock lock(&mu);
      got.clear();
    }
    const AmAssembly before = AmAssemblyNow();
    StockUcxPeer peer(h.worker->address(), peer_errors, "");
    for (bool reply : {false, true}) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_AM_SEND_FLAG_EAGER | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
      peer.Track(ucp_am_send_nbx(peer.ep(), 7, header.data(), header.size(), data.data(),
                                 data.size(), &param));
    }
    peer.Progress(10000);
    CHECK(peer.Status(0) == UCS_OK);
    CHECK(peer.Status(1) == UCS_OK);
    CHECK(Eventually([&] {
      absl::MutexLock lock(&mu);
      return got.size() == 2;
    }));
    absl::MutexLock lock(&mu);
    REQUIRE(got.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
      INFO("message " << i);
      CHECK(std::get<0>(got[i]) == header);
      CHECK(std::get<1>(got[i]) == data);  // byte for byte
      CHECK(std::get<2>(got[i]) == (i == 1));
    }
    CHECK(AmAssemblyNow().assembled - before.assembled == 2);
    CHECK(AmAssemblyNow().refused == before.refused);
    CHECK_FALSE(peer.failed());
  }
}

// A bare worker of a hardened context (progressed on this thread) that takes UCP's
// active message 7, and a stock UCP peer connected to it, wired up by a first message
// with reply. Messages are fed to the callbacks UCT would call, as a hostile peer could
// send them; `Endpoint` finds the worker's endpoint to the peer as such a peer could,
// trying each odd id in a message with reply until one reaches the handler with it.
// Has `peer` send active message 7 with reply on `ep`, eagerly, carrying `length` bytes
// at `data` (which outlive the send); the request's index in the peer's tracked ones.
// UCP sends an endpoint's wireup request with the first message that needs the other
// side's endpoint, as this one does.
size_t SendWithReply(StockUcxPeer& peer, ucp_ep_h ep, const void* data, size_t length) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  return peer.Track(ucp_am_send_nbx(ep, 7, nullptr, 0, data, length, &param));
}

// With `incoming` (which outlives it), the worker records each wireup message it takes
// in there (UCP's handler table is read as the worker opens its interfaces).
//
// RecordingWireup runs `open`, which opens UCX interfaces (a worker's as it is created,
// a peer's as it connects), with UCP's wireup handler recording into `into` each wireup
// message those interfaces take in, for as long as they live: UCP copies its handler
// table into an interface as it opens it. Each call site (its own `Open`) keeps its own
// record.
template <typename Open>
void RecordingWireup(std::vector<std::string>* into, Open open) {
  static std::vector<std::string>* record = nullptr;
  static ucs_status_t (*hardened)(void*, void*, size_t, unsigned) = nullptr;
  auto* wireup =
      static_cast<UcpProtocolEntry*>(dlsym(RTLD_DEFAULT, "ucp_am_handler_UCP_AM_ID_WIREUP"));
  REQUIRE(wireup != nullptr);
  record = into;
  hardened = wireup->cb;
  wireup->cb = [](void* arg, void* data, size_t length, unsigned flags) {
    record->emplace_back(static_cast<const char*>(data), length);
    return hardened(arg, data, length, flags);
  };
  open();
  wireup->cb = hardened;
}

class WorkerWithPeer {
 public:
  explicit WorkerWithPeer(const Hardened& h, std::vector<std::string>* incoming = nullptr) {
    ucp_worker_params_t params{};
    ucs_status_t created = UCS_ERR_NO_ELEM;
    auto create = [&] { created = ucp_worker_create(h.context->get(), &params, &worker_); };
    if (incoming != nullptr) {
      RecordingWireup(incoming, create);
    } else {
      create();
    }
    REQUIRE(created == UCS_OK);
    delivered_ = 0;
    TakeActiveMessage7(worker_, [](void*, const void*, size_t, void*, size_t,
                                   const ucp_am_recv_param_t* param) {
      ++delivered_;
      with_reply_ = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0;
      return UCS_OK;
    });
    ucp_address_t* address = nullptr;
    size_t length = 0;
    REQUIRE(ucp_worker_get_address(worker_, &address, &length) == UCS_OK);
    address_.assign(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
  }
  ~WorkerWithPeer() {
    peer_.reset();
    ucp_worker_destroy(worker_);
  }
  // Connects the peer and has it send one message with reply.
  void Connect() {
    peer_ = std::make_unique<StockUcxPeer>(address_, false, "");
    REQUIRE(SayHello());
    REQUIRE(with_reply_);
  }
  // The peer sends one message with reply; true once the worker's handler took it.
  bool SayHello() {
    static const std::string hello(64, 'h');
    const int before = delivered_;
    SendWithReply(*peer_, peer_->ep(), hello.data(), hello.size());
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (delivered_ == before && std::chrono::steady_clock::now() < until) {
      ucp_worker_progress(worker_);
      peer_->Progress(1);
    }
    return delivered_ == before + 1;
  }
  // Feeds `message` to the callback of UCP's protocol `symbol` (ucp_am_handler_UCP_AM_ID_*).
  void Feed(const char* symbol, const std::string& message) {
    auto* entry = static_cast<UcpProtocolEntry*>(
        dlsym(RTLD_DEFAULT, (std::string("ucp_am_handler_UCP_AM_ID_") + symbol).c_str()));
    REQUIRE(entry != nullptr);
    std::vector<uint8_t> bytes(message.begin(), message.end());
    bytes.reserve(1);
    CHECK(entry->cb(worker_, bytes.data(), bytes.size(), 0) == UCS_OK);
  }
  // True when a message with reply naming endpoint `id` reaches the handler with it.
  bool Reaches(uint64_t id) {
    with_reply_ = false;
    Feed("AM_SINGLE_REPLY", std::string(kAmHeader) + "probe" + U64(id));
    return with_reply_;
  }
  // The worker's reply to the peer's wireup request, as the peer took it in: the
  // worker's address as UCX 1.13 packs it for wireup, and the peer's endpoint id (the
  // one the reply names).
  struct Reply {
    std::string address;
    uint64_t peer = 0;
  };
  // Connects as Connect does, recording the first wireup message the peer takes in (the
  // worker's reply: UCP's handler table is read as a worker opens its interfaces, and
  // only the peer's are opened while the recorder is in it).
  Reply ConnectRecordingReply() {
    recorded_.clear();
    RecordingWireup(&recorded_, [this] { Connect(); });
    const std::vector<std::string>& recorded = recorded_;
    REQUIRE_FALSE(recorded.empty());
    REQUIRE(recorded.front()[0] == 2);
    Reply reply;
    reply.address = recorded.front().substr(20);
    std::memcpy(&reply.peer, recorded.front().data() + 12, 8);
    return reply;
  }
  // Feeds `message` to UCP's protocol `symbol` (as Feed) and progresses the worker
  // `rounds` times (for what UCP does on a later progress); returns how many messages
  // were refused meanwhile.
  uint64_t Refused(const char* symbol, const std::string& message, int rounds) {
    const uint64_t before = UcxRefusedMessages();
    Feed(symbol, message);
    for (int i = 0; i < rounds; ++i) ucp_worker_progress(worker_);
    return UcxRefusedMessages() - before;
  }
  // A wireup message (ucp_wireup_msg_t: type, error mode, connection number (2), source
  // and destination endpoint ids; then the sender's worker address).
  static std::string Wireup(uint8_t type, uint64_t destination, const std::string& address,
                            uint64_t sender = 0x45, uint8_t error_mode = 0) {
    std::string out(4, '\0');
    out[0] = static_cast<char>(type);
    out[1] = static_cast<char>(error_mode);
    return out + U64(sender) + U64(destination) + address;
  }
  // Connects, and returns the id of the worker's endpoint to the peer (as Endpoint).
  uint64_t ConnectedEndpoint() {
    Connect();
    const uint64_t id = Endpoint();
    REQUIRE(id != 0);
    return id;
  }
  // The id of the worker's endpoint to the peer (0 if none answers).
  uint64_t Endpoint() {
    for (uint64_t id = 1; id < (1u << 16); id += 2) {
      if (Reaches(id)) return id;
    }
    return 0;
  }
  ucp_worker_h worker() const { return worker_; }
  // The worker's own address: one that lists its transports.
  const std::string& address() const { return address_; }
  StockUcxPeer& peer() { return *peer_; }

  // ucp_am_hdr_t of UCP's active message 7, no flags or user header.
  static inline const std::string kAmHeader{"\x07\0\0\0\0\0\0\0", 8};

 private:
  static inline int delivered_ = 0;
  static inline bool with_reply_ = false;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  // What the peer took in (ConnectRecordingReply), recorded for as long as it lives.
  std::vector<std::string> recorded_;
  std::unique_ptr<StockUcxPeer> peer_;
};

// With an endpoint id the worker really gave a peer, UCX 1.13 would assemble a forged
// message in its own buffer: a later fragment naming an offset 1 TiB on wrote there (the
// process died of SIGSEGV), and a first fragment repeated stopped it on an assertion, as
// did a rendezvous request naming a user header longer than itself.
// The id is found as a peer could: each odd id is tried in a message with reply until
// one reaches the handler with an endpoint.
TEST_CASE("forged fragments and rendezvous requests naming a real endpoint of the worker do not "
          "reach UCX") {
  Hardened h = Hardened::Make();
  WorkerWithPeer w(h);
  const uint64_t real = w.ConnectedEndpoint();
  INFO("the worker's endpoint to the peer has id " << std::hex << real);
  const std::string& am_header = WorkerWithPeer::kAmHeader;
  const uint64_t refused = UcxRefusedMessages();
  // 16 bytes of a message of 64, then 8 more said to lie 1 TiB on.
  w.Feed("AM_FIRST", am_header + std::string(16, 'f') + U64(0x2001) + U64(real) + U64(64));
  w.Feed("AM_MIDDLE", U64(1ull << 40) + std::string(8, 'm') + U64(0x2001) + U64(real));
  // The first fragment twice.
  w.Feed("AM_FIRST", am_header + std::string(16, 'f') + U64(0x2002) + U64(real) + U64(64));
  w.Feed("AM_FIRST", am_header + std::string(16, 'f') + U64(0x2002) + U64(real) + U64(64));
  // An active message's rendezvous request naming a user header of 1,000 bytes in 64
  // (ucp_am.c: "length >= am->header_length + sizeof(*rts)"); then one of kind 0x50.
  const std::string rts_header("\x07\0\0\0\xe8\x03\0\0", 8);
  w.Feed("RNDV_RTS",
         rts_header + U64(real) + U64(0x45) + U64(0) + U64(64) + "\x01" + std::string(23, 'k'));
  w.Feed("RNDV_RTS", am_header + U64(real) + U64(0x45) + U64(0) + U64(64) + "\x50");
  CHECK(UcxRefusedMessages() - refused == 4);
  // The peer's own messages still arrive.
  CHECK(w.SayHello());
  CHECK_FALSE(w.peer().failed());
}

// UCP's wireup messages carry the sender's worker address, and UCX 1.13 stops the
// process on much that a peer may put in one, before any endpoint is looked up: a type
// it does not know ("Bug: invalid wireup message"), an address of a version past the two
// it packs, or a reply, acknowledgement, endpoint check or removal naming endpoint 0
// (each an assertion; a random 0-160-byte wireup message did one of these about one
// time in six). Each is dropped and counted, and the worker's endpoint to the peer (its
// id found by trying odd ids) still works; the honest wireup between them passes.
TEST_CASE("a peer's wireup message that would stop UCX is dropped") {
  Hardened h = Hardened::Make();
  WorkerWithPeer w(h);
  const uint64_t refused_before_wireup = UcxRefusedMessages();
  const WorkerWithPeer::Reply reply = w.ConnectRecordingReply();
  CHECK(UcxRefusedMessages() == refused_before_wireup);  // the honest wireup all passed
  const uint64_t real = w.Endpoint();
  INFO("the worker's endpoint to the peer has id " << std::hex << real);
  REQUIRE(real != 0);
  // A worker address UCX 1.13 packed: the worker's own, as its reply carried it.
  const std::string& reply_address = reply.address;
  auto message = [](uint8_t type, uint64_t destination, const std::string& address) {
    return WorkerWithPeer::Wireup(type, destination, address);
  };
  std::string version_3 = reply_address;
  version_3[0] = static_cast<char>((version_3[0] & 0xf0) | 3);
  struct Forged {
    const char* what;
    std::string bytes;
  };
  const std::vector<Forged> forged = {
      {"of type 7", message(7, 0, reply_address)},
      {"of type 6", message(6, 0, reply_address)},
      {"a request whose address is of version 3", message(1, 0, version_3)},
      {"a pre-request naming endpoint 0", message(0, 0, reply_address)},
      {"a reply naming endpoint 0", message(2, 0, reply_address)},
      {"an acknowledgement naming endpoint 0", message(3, 0, reply_address)},
      {"an endpoint check naming endpoint 0", message(4, 0, reply_address)},
      {"an endpoint removal naming endpoint 0", message(5, 0, reply_address)},
      {"20 bytes: no address", message(1, 0, "")},
  };
  for (const Forged& f : forged) {
    INFO("a wireup message " << f.what);
    CHECK(w.Refused("WIREUP", f.bytes, 100) == 1);
    CHECK(w.Reaches(real));  // the endpoint to the peer is not failed
  }
  CHECK(w.SayHello());
  CHECK_FALSE(w.peer().failed());
}

// Wireup messages naming an endpoint the worker has, or making one, that stopped UCX
// 1.13 for good (the worker's endpoint to the peer, its id found by trying odd ids):
// - a request naming no endpoint yet whose address lists no transport (its uuid, then
//   UCX's end-of-devices byte): UCP made an endpoint for it, found no lanes, and failed
//   the endpoint without a configuration at its next progress, on an assertion;
// - a request from sender id 0 (an assertion as UCP notes the sender);
// - a pre-request, or a request, naming the endpoint (assertions: a pre-request needs a
//   connection manager lane; a request's sender must be the endpoint's peer);
// - a reply naming the endpoint with a sender other than its peer (an assertion).
// kvagentd's ucp_endpoint_stand_in removes the first endpoint as UCP removes one of its
// own that finds no lanes; the checked handler drops the sender 0, the pre-request and
// the request naming an endpoint; the reply reaches UCP as a repeat of the peer's own
// (its sender rewritten). Each refusal is counted, and the endpoint to the peer still
// works. A reply from the peer itself, and an endpoint check, pass as they are.
TEST_CASE("a peer's wireup message that would leave an endpoint unconfigured or contradict "
          "its peer is refused") {
  const size_t followed_before = EndpointsFollowed();
  {
    Hardened h = Hardened::Make();
    WorkerWithPeer w(h);
    const WorkerWithPeer::Reply reply = w.ConnectRecordingReply();
    const std::string& reply_address = reply.address;
    const uint64_t peer = reply.peer;
    const uint64_t real = w.Endpoint();
    INFO("the worker's endpoint to the peer has id " << std::hex << real << ", its peer's "
                                                     << peer);
    REQUIRE(real != 0);
    const size_t followed = EndpointsFollowed();
    CHECK(followed > followed_before);
    struct Forged {
      const char* what;
      std::string bytes;
      uint64_t refused;
    };
    const std::vector<Forged> forged = {
        {"a request naming no endpoint, its address listing no transport",
         WorkerWithPeer::Wireup(1, 0, "\x20" + U64(0x1122334455667788) + "\xff"), 1},
        {"a request naming no endpoint, from sender id 0",
         WorkerWithPeer::Wireup(1, 0, reply_address, 0), 1},
        {"a pre-request naming the endpoint", WorkerWithPeer::Wireup(0, real, reply_address), 1},
        {"a request naming the endpoint", WorkerWithPeer::Wireup(1, real, reply_address), 1},
        {"a reply naming the endpoint, from another sender",
         WorkerWithPeer::Wireup(2, real, reply_address), 1},
        {"a reply naming the endpoint, from its peer",
         WorkerWithPeer::Wireup(2, real, reply_address, peer), 0},
        {"an endpoint check naming the endpoint", WorkerWithPeer::Wireup(4, real, reply_address),
         0},
    };
    for (const Forged& f : forged) {
      INFO("a wireup message: " << f.what);
      CHECK(w.Refused("WIREUP", f.bytes, 100) == f.refused);
      CHECK(EndpointsFollowed() == followed);  // none made for it is left
      CHECK(w.Reaches(real));
    }
    CHECK(w.SayHello());
    CHECK_FALSE(w.peer().failed());
  }
  CHECK(EndpointsFollowed() == followed_before);  // each forgotten as UCP destroyed it
}

// A request that matches an endpoint the worker is connecting (not on this host's
// transports: only one whose lanes need connecting both ways waits to be matched) and
// whose address gives it lanes of another configuration stopped UCX 1.13 at once
// ("endpoint reconfiguration not supported yet"). The stand-ins refuse the new
// configuration (ConfigurationFound) and keep the endpoint's lanes instead of failing
// it; an endpoint's first configuration, and the same one again, pass.
TEST_CASE("a second configuration for an endpoint is refused and the endpoint kept") {
  REQUIRE(HardenUcxForPeers().ok());  // endpoints are followed in a hardened process only
  int worker = 0, ep = 0, other = 0;
  NoteEndpointCreated(&worker, &ep, MadeFor::kAgent);
  NoteEndpointCreated(&worker, &other, MadeFor::kRequest);
  const uint64_t refused = UcxRefusedMessages();
  {
    LanesSetUp lanes(&ep);
    CHECK(ConfigurationFound(4));
  }
  {
    LanesSetUp lanes(&ep);
    CHECK(ConfigurationFound(4));
  }
  CHECK(UcxRefusedMessages() == refused);
  {
    LanesSetUp lanes(&ep);
    CHECK_FALSE(ConfigurationFound(6));
  }
  CHECK(UcxRefusedMessages() - refused == 1);
  const void* of = nullptr;
  CHECK(EndpointFailing(&ep, &of) == EndpointFailure::kKeep);   // the refusal's own failure
  CHECK(EndpointFailing(&ep, &of) == EndpointFailure::kFail);   // any later one is UCP's
  // One made for a request, failed before any configuration: removed here.
  CHECK(EndpointFailing(&other, &of) == EndpointFailure::kRemove);
  CHECK(of == &worker);
  CHECK(ConfigurationFound(9));  // outside any endpoint's lanes: UCP's other uses
  ForgetEndpoint(&ep);
  ForgetEndpoint(&other);
}

// A put's completion names the endpoint whose software put it completes, and UCX 1.13
// counts it against that endpoint's and the worker's puts in flight, asserting there
// are some: one completion naming the worker's real endpoint to the peer (its id found
// by trying odd ids) stopped it (a random search of the protocols naming an endpoint
// found it in 38 of 40 batches). Through kvagentd's uct_iface_open the worker's puts
// are counted, and a completion that comes with none in flight is dropped and counted.
TEST_CASE("a put completion that comes while the worker has no put in flight is dropped") {
  Hardened h = Hardened::Make();
  WorkerWithPeer w(h);
  const uint64_t real = w.ConnectedEndpoint();
  INFO("the worker's endpoint to the peer has id " << std::hex << real);
  const uint64_t completions = PutCompletionsRefused();
  for (int i = 0; i < 3; ++i) CHECK(w.Refused("CMPL", U64(real), 10) == 1);
  CHECK(PutCompletionsRefused() - completions == 3);
  CHECK(w.Reaches(real));
  CHECK(w.SayHello());
  CHECK_FALSE(w.peer().failed());
}

// A worker address gives, for each transport, a device address and an interface
// address, each of the length it says, and one of length 0 reaches the transport's
// reachability probe as a null pointer: UCX 1.13's tcp probe read through it, so a
// wireup message whose address said so (a random one did, about one in 20,000) ended
// the process with SIGSEGV. GuardReachability, which kvagentd's uct_iface_open puts in
// front of each interface's probe, takes such an entry as unreachable and counts it.
TEST_CASE("a peer's address entry without a device or interface address its transport "
          "reads is unreachable") {
  REQUIRE(HardenUcxForPeers().ok());
  testing::StockUctTcp tcp;
  std::string failed;
  REQUIRE(testing::OpenStockUctTcp("lo", &tcp, &failed) == UCS_OK);
  uct_iface_attr_t attr{};
  REQUIRE(uct_iface_query(tcp.iface, &attr) == UCS_OK);
  std::vector<char> device(attr.device_addr_len), iface(attr.iface_addr_len);
  REQUIRE(uct_iface_get_device_address(
              tcp.iface, reinterpret_cast<uct_device_addr_t*>(device.data())) == UCS_OK);
  REQUIRE(uct_iface_get_address(tcp.iface, reinterpret_cast<uct_iface_addr_t*>(
                                               iface.data())) == UCS_OK);
  const auto* device_address = reinterpret_cast<const uct_device_addr_t*>(device.data());
  const auto* iface_address = reinterpret_cast<const uct_iface_addr_t*>(iface.data());
  GuardReachability(tcp.iface);
  GuardReachability(tcp.iface);  // once is enough: the probe is not wrapped twice
  const uint64_t unreachable = UnreachableAddressEntries();
  const uint64_t refused = UcxRefusedMessages();
  CHECK(uct_iface_is_reachable(tcp.iface, device_address, iface_address) == 1);
  CHECK(uct_iface_is_reachable(tcp.iface, nullptr, iface_address) == 0);
  CHECK(uct_iface_is_reachable(tcp.iface, device_address, nullptr) == 0);
  CHECK(UnreachableAddressEntries() - unreachable == 2);
  CHECK(UcxRefusedMessages() - refused == 2);
  testing::CloseStockUctTcp(&tcp);
}

// Random wireup messages of each type, naming no endpoint, the worker's endpoint to the
// peer, or ids near it, from the peer's, another's or no sender, carrying the worker's
// address (as UCX packs it for wireup, or for the application) with a few bits flipped
// or cut short: how the cases above were found, and an acknowledgement whose address
// lists transports (an assertion: an honest one lists none, and UCP reads nothing else
// of it, so the checked handler hands UCP one that lists none). Each of 40 batches of
// 300 runs in a child process (the worker and peer made there), and none may end it;
// on a failure the last message is named. (Without the acknowledgement's address
// replaced, each of three runs here had a batch among its first 15 stop.)
TEST_CASE("random wireup messages naming the worker's endpoints do not stop it") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string last_path = std::string(tmp != nullptr ? tmp : "/tmp") + "/wireup_last";
  for (int batch = 0; batch < 40; ++batch) {
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      Hardened h = Hardened::Make();
      WorkerWithPeer w(h);
      WorkerWithPeer::Reply reply;
      try {
        reply = w.ConnectRecordingReply();
      } catch (...) {
        _exit(3);  // a failed REQUIRE: the child runs no further test
      }
      const uint64_t real = w.Endpoint();
      std::mt19937_64 random(1000 + batch);
      for (int i = 0; i < 300; ++i) {
        const uint64_t destinations[] = {0, real, real + 2, (random() % 64) | 1};
        const uint64_t senders[] = {reply.peer, 0x45, (random() % 64) | 1, 0};
        std::string address = random() % 2 ? w.address() : reply.address;
        for (int flips = random() % 4; flips > 0; --flips) {
          address[random() % address.size()] ^= static_cast<char>(1 << (random() % 8));
        }
        if (random() % 5 == 0) address.resize(random() % address.size() + 1);
        std::string message =
            WorkerWithPeer::Wireup(random() % 6, destinations[random() % 4], address,
                                   senders[random() % 4], random() % 3 == 0 ? 1 : 0);
        message[2] = static_cast<char>(random() % 4);  // the connection number
        {
          std::ofstream last(last_path, std::ios::trunc);
          last << fmt::format("{:02x}",
                              fmt::join(std::vector<uint8_t>(message.begin(), message.end()), ""))
               << std::endl;
        }
        w.Refused("WIREUP", message, 10);
      }
      _exit(0);
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    std::string last;
    std::getline(std::ifstream(last_path), last);
    INFO("batch " << batch << "; the last message: " << last);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}

// UCP unpacks a wireup message's worker address by the lengths and flags it gives and
// reads on past the message: random wireup messages carrying the worker's address with
// bits flipped stopped a worker under ASan once in some 300 batches of 300, in
// ucp_address_unpack (SIGSEGV). The checked handler walks the address as UCP does and
// drops a message whose address would be read past its end. A peer's real request (its
// address, as the worker took it in) passes whole; cut short anywhere it is dropped, and
// so is that ASan run's last message, whose address claims 116 bytes more than it has.
TEST_CASE("a wireup message whose worker address UCX would read past its end is dropped") {
  Hardened h = Hardened::Make();
  std::vector<std::string> incoming;
  WorkerWithPeer w(h, &incoming);
  const uint64_t refused_before_wireup = UcxRefusedMessages();
  w.Connect();
  CHECK(UcxRefusedMessages() == refused_before_wireup);  // the honest wireup all passed
  REQUIRE_FALSE(incoming.empty());
  const std::string request = incoming.front();
  REQUIRE(request[0] == 1);
  const std::string address = request.substr(20);
  INFO("the peer's request carries a worker address of " << address.size() << " bytes");
  for (size_t cut = 1; cut < address.size(); ++cut) {
    INFO("cut to " << cut << " bytes");
    std::string forged = request.substr(0, 20 + cut);
    const uint64_t sender = 0x2001 + 2 * cut;
    std::memcpy(&forged[4], &sender, 8);
    CHECK(w.Refused("WIREUP", forged, 2) == 1);
  }
  // An endpoint check naming an endpoint the worker lacks (UCP unpacks its address),
  // from that ASan run: a header, a uuid, then one device whose transport entry says an
  // endpoint address of 151 bytes follows in 259.
  const std::string asan_run =
      "0400010045000000000000000500000000000000203aa82bd5302df4922000637577cc2b3200"
      "f8d74f00000000004f030098fece9a79df7024b421120102519f885b6fab9785f9ffffef0000"
      "0000cf1917b75138539e3e4bd7e037370103230082e83721060002c0000202cf1917b7513897"
      "63344bd7e037370003230082dd0f4210519f885b6fab9785540100f0000000008d5377cc2b32"
      "004c3e5077ccab33004f2300880e800100000000004310519f885b6fab9785540100f0000000"
      "00a7d377cc2b32004c3e5077ccab33004f230090590000c0060000d0550100f0000000002490"
      "519f881b6fab9785540100f000000000478bbd37063600242e5077ccab330092210090590000"
      "8000000000550100f000000000";
  std::string check;
  for (size_t i = 0; i + 1 < asan_run.size(); i += 2) {
    check.push_back(static_cast<char>(std::stoi(asan_run.substr(i, 2), nullptr, 16)));
  }
  const uint64_t absent = 0x7001;
  std::memcpy(&check[12], &absent, 8);
  CHECK(w.Refused("WIREUP", check, 2) == 1);
  CHECK(w.SayHello());
  CHECK_FALSE(w.peer().failed());
  // A peer whose UCX packs addresses of version 2 (UCX_ADDRESS_VERSION=v2; its own
  // address says so) wires up too: its request passes the walk, and its message with
  // reply goes out.
  const uint64_t refused = UcxRefusedMessages();
  ::setenv("UCX_ADDRESS_VERSION", "v2", 1);
  testing::StockUcxPeer v2(w.address(), false, "");
  ::unsetenv("UCX_ADDRESS_VERSION");
  CHECK((v2.Address()[0] & 0x0f) == 1);  // UCP_OBJECT_VERSION_V2
  const size_t sent = SendWithReply(v2, v2.ep(), "v2", 2);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (v2.Status(sent) == UCS_INPROGRESS && std::chrono::steady_clock::now() < until) {
    ucp_worker_progress(w.worker());
    v2.Progress(1);
  }
  CHECK(v2.Status(sent) == UCS_OK);
  CHECK(UcxRefusedMessages() == refused);
  v2.Forget();
}

// Each wireup request that matches none of the worker's own endpoints has UCP make an
// endpoint for its sender, and without peer error handling it lasts as long as the
// worker: the peer's own request sent again with other sender ids grew UCX 1.13 by
// about 17.5 KiB an endpoint, without end (2,000 of them: +35 MiB). A worker holds at
// most the cap of endpoints made for peers' requests and checks: past it the request
// gets no endpoint (UCP answers nothing) and an endpoint check is dropped, each counted
// and logged. An endpoint the worker's own ucp_ep_create takes over from a request
// counts no more, and the peer connected before the flood still works.
// An answer kept past its handler (an acknowledgement waiting for staged bytes, a staged
// read's parts) holds the endpoint its request came with by address and serial. Once
// UCP destroyed that endpoint (the requester's tcp connection ended), the answer is not
// sent (UNAVAILABLE, counted): neither to the destroyed endpoint nor, when UCP put the
// next requester's endpoint at the same address, to that requester. Before the serials,
// the agent handed UCP the raw address it had kept.
TEST_CASE("an answer kept past its handler is not sent once UCP destroyed its endpoint") {
  Hardened h = Hardened::Make();
  constexpr uint16_t kAsk = 7;
  constexpr uint16_t kAnswer = 9;
  absl::Mutex mu;
  std::vector<ReplyEndpoint> kept;
  h.worker->SetAmDataHandler(kAsk, [&](const AmMessage& message) {
    absl::MutexLock lock(&mu);
    kept.push_back(message.reply_ep);
    return false;
  });
  auto kept_count = [&] {
    absl::MutexLock lock(&mu);
    return kept.size();
  };
  // Answers of id 9 a stock peer received (its handler runs in its Progress).
  struct Answers {
    int count = 0;
  };
  // Progresses `peer` until it has `count` answers (up to 10 s), or, for a count it must
  // not pass, for 300 ms; the answers it has then. (StockUcxPeer::Progress returns at
  // once when the peer's own requests are done.)
  auto progress_for = [](StockUcxPeer& peer, const Answers& answers, int count) {
    const auto start = std::chrono::steady_clock::now();
    while (true) {
      peer.Progress(1);
      const auto spent = std::chrono::steady_clock::now() - start;
      if (answers.count > count || spent > std::chrono::seconds(10)) break;
      if (answers.count == count && spent > std::chrono::milliseconds(300)) break;
    }
    return answers.count;
  };
  auto listen = [](StockUcxPeer& peer, Answers* answers) {
    ucp_am_handler_param_t param{};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                       UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = kAnswer;
    param.arg = answers;
    param.cb = [](void* arg, const void*, size_t, void*, size_t,
                  const ucp_am_recv_param_t*) -> ucs_status_t {
      ++static_cast<Answers*>(arg)->count;
      return UCS_OK;
    };
    REQUIRE(ucp_worker_set_am_recv_handler(peer.worker(), &param) == UCS_OK);
  };
  auto ask = [&](StockUcxPeer& peer) {
    const size_t had = kept_count();
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
    const std::string header = "a request";
    peer.Track(ucp_am_send_nbx(peer.ep(), kAsk, header.data(), header.size(), nullptr, 0,
                               &param));
    peer.Progress(10000);
    REQUIRE(Eventually([&] { return kept_count() == had + 1; }));
    absl::MutexLock lock(&mu);
    return kept.back();
  };
  // Sends an answer on `to` from the worker thread; its completion status.
  auto answer = [&](const ReplyEndpoint& to) {
    auto done = std::make_shared<absl::Notification>();
    auto status = std::make_shared<absl::Status>();
    h.worker->RunSync([&] {
      h.worker->SendAmReply(to, kAnswer, "an answer", nullptr, 0,
                            [done, status](absl::Status s) {
                              *status = std::move(s);
                              done->Notify();
                            });
    });
    REQUIRE(done->WaitForNotificationWithTimeout(absl::Seconds(10)));
    return *status;
  };
  auto native_rma = [&](const ReplyEndpoint& to) {
    bool rma = true;
    h.worker->RunSync([&] { rma = h.worker->ReplyEndpointNativeRma(to); });
    return rma;
  };

  const size_t followed = EndpointsFollowed();
  auto first = std::make_unique<StockUcxPeer>(h.worker->address(), /*peer_errors=*/true, "");
  Answers first_answers;
  listen(*first, &first_answers);
  const ReplyEndpoint gone = ask(*first);
  REQUIRE(gone);
  CHECK(gone.serial != 0);  // the stand-ins follow every endpoint UCP makes
  CHECK(EndpointSerial(gone.ep) == gone.serial);
  {
    INFO("answered while the requester is there");
    CHECK(answer(gone).ok());
    CHECK(progress_for(*first, first_answers, 1) == 1);
  }
  // The requester goes: UCP fails the endpoint it made for it and destroys it.
  first.reset();
  REQUIRE(Eventually([&] { return EndpointsFollowed() == followed; }));
  CHECK(EndpointSerial(gone.ep) == 0);
  const uint64_t refused = RepliesToGoneEndpoints();
  {
    INFO("an answer to the endpoint UCP destroyed is not begun");
    const absl::Status status = answer(gone);
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(status.message()),
               Catch::Contains("UCX destroyed the endpoint its request came over"));
    CHECK(RepliesToGoneEndpoints() - refused == 1);
    CHECK_FALSE(native_rma(gone));
  }
  // The next requester; UCP may put its endpoint where the destroyed one was.
  StockUcxPeer second(h.worker->address(), /*peer_errors=*/true, "");
  Answers second_answers;
  listen(second, &second_answers);
  const ReplyEndpoint next = ask(second);
  REQUIRE(next);
  CHECK(next.serial > gone.serial);
  INFO("the next requester's endpoint " << (next.ep == gone.ep ? "took" : "did not take")
                                        << " the destroyed one's address");
  {
    INFO("the answer kept for the first requester does not reach the second");
    CHECK(answer(gone).code() == absl::StatusCode::kUnavailable);
    CHECK(progress_for(second, second_answers, 0) == 0);
  }
  CHECK(answer(next).ok());
  CHECK(progress_for(second, second_answers, 1) == 1);
  CHECK(RepliesToGoneEndpoints() - refused == 2);
  CHECK_FALSE(second.failed());
}

TEST_CASE("a worker holds at most its cap of endpoints made for peers' requests") {
  constexpr uint64_t kCap = 16;
  const PeerEndpoints before = PeerEndpointsNow();
  const size_t followed_before = EndpointsFollowed();
  {
    Hardened h = Hardened::Make();
    SetPeerEndpointCap(kCap);
    std::vector<std::string> incoming;
    WorkerWithPeer w(h, &incoming);
    w.Connect();
    // The peer's request (the first wireup message the worker took in) made one.
    REQUIRE_FALSE(incoming.empty());
    const std::string request = incoming.front();
    REQUIRE(request[0] == 1);
    CHECK(PeerEndpointsNow().live == before.live + 1);
    // A second peer, whose endpoint the worker opens too: UCP hands the worker the one
    // it made for the peer's request, and it is the worker's own from then on.
    testing::StockUcxPeer second(w.address(), false, "");
    auto wired = [&] {
      for (int i = 0; i < 2000; ++i) {
        ucp_worker_progress(w.worker());
        second.Progress(1);
      }
    };
    // UCP sends its wireup request with the endpoint's first message with reply.
    SendWithReply(second, second.ep(), "hi", 2);
    wired();
    CHECK(PeerEndpointsNow().live == before.live + 2);
    const size_t followed = EndpointsFollowed();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    const std::string second_address = second.Address();
    params.address = reinterpret_cast<const ucp_address_t*>(second_address.data());
    ucp_ep_h own = nullptr;
    REQUIRE(ucp_ep_create(w.worker(), &params, &own) == UCS_OK);
    wired();
    CHECK(EndpointsFollowed() == followed);  // the same endpoint
    CHECK(PeerEndpointsNow().live == before.live + 1);
    // The first peer's request again, from other senders: the worker makes endpoints
    // until it holds its cap, then refuses each.
    const uint64_t refused = UcxRefusedMessages();
    constexpr uint64_t kSent = 40;
    for (uint64_t i = 0; i < kSent; ++i) {
      std::string forged = request;
      const uint64_t sender = 0x1001 + 2 * i;
      std::memcpy(&forged[4], &sender, 8);
      w.Refused("WIREUP", forged, 2);
    }
    PeerEndpoints now = PeerEndpointsNow();
    CHECK(now.live == before.live + kCap);
    CHECK(now.most == kCap);
    CHECK(now.peak >= kCap);
    CHECK(now.cap == kCap);
    CHECK(now.refused - before.refused == kSent - (kCap - 1));
    CHECK(UcxRefusedMessages() - refused == kSent - (kCap - 1));
    CHECK(EndpointsFollowed() == followed + kCap - 1);
    // An endpoint check naming an endpoint the worker lacks would make another.
    CHECK(w.Refused("WIREUP", WorkerWithPeer::Wireup(4, 0x7001, request.substr(20), 0x77), 10) ==
          1);
    CHECK(PeerEndpointsNow().refused - before.refused == kSent - (kCap - 1) + 1);
    CHECK(EndpointsFollowed() == followed + kCap - 1);
    // The peers connected before still work.
    CHECK(w.SayHello());
    CHECK_FALSE(w.peer().failed());
    ucp_request_param_t close{};
    close.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    close.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t closing = ucp_ep_close_nbx(own, &close);
    while (UCS_PTR_IS_PTR(closing) && ucp_request_check_status(closing) == UCS_INPROGRESS) {
      ucp_worker_progress(w.worker());
    }
    if (UCS_PTR_IS_PTR(closing)) ucp_request_free(closing);
  }
  SetPeerEndpointCap(kDefaultPeerEndpoints);
  // Each place freed as UCP destroyed its endpoint with the worker.
  CHECK(PeerEndpointsNow().live == before.live);
  CHECK(EndpointsFollowed() == followed_before);
}

TEST_CASE("a range admits a request inside one allowed registration of its memory type only") {
  std::vector<char> memory(8192);
  const auto base = reinterpret_cast<uint64_t>(memory.data());
  const uint32_t host = UCS_MEMORY_TYPE_HOST, cuda = UCS_MEMORY_TYPE_CUDA;
  AllowPeerRange(memory.data(), 4096, host);
  AllowPeerRange(memory.data() + 4096, 4096, host);  // its neighbour, registered apart
  CHECK(UcxPeerRangeAdmits(base, 4096, host));
  CHECK(UcxPeerRangeAdmits(base + 4000, 96, host));
  CHECK(UcxPeerRangeAdmits(base + 4096, 0, host));
  CHECK_FALSE(UcxPeerRangeAdmits(base + 4000, 200, host));  // across two registrations
  CHECK_FALSE(UcxPeerRangeAdmits(base - 1, 2, host));
  CHECK_FALSE(UcxPeerRangeAdmits(base + 8000, 500, host));
  CHECK_FALSE(UcxPeerRangeAdmits(UINT64_MAX - 10, 100, host));  // wraps around
  // Claiming device memory for host memory (UCX would copy as the request says).
  CHECK_FALSE(UcxPeerRangeAdmits(base, 64, cuda));
  ForbidPeerRange(memory.data(), 4096);
  CHECK_FALSE(UcxPeerRangeAdmits(base, 64, host));
  CHECK(UcxPeerRangeAdmits(base + 4096, 64, host));
  ForbidPeerRange(memory.data() + 4096, 4096);
  CHECK_FALSE(UcxPeerRangeAdmits(base + 4096, 64, host));
}

TEST_CASE(
    "a hardened worker discards a stock peer's tagged messages, eager and rendezvous, "
    "and answers each") {
  Hardened h = Hardened::Make();
  const std::string small(64, 'a');
  const std::string large(256 << 10, 'b');
  for (bool peer_errors : {false, true}) {
    INFO((peer_errors ? "peer error handling (tcp)" : "no error handling (shared memory)"));
    const uint64_t before = h.worker->tagged_messages();
    const uint64_t unknown_before = h.worker->unknown_messages();
    StockUcxPeer peer(h.worker->address(), peer_errors, "1024");
    ucp_request_param_t plain{};
    constexpr int kEach = 50;
    for (int i = 0; i < kEach; ++i) {
      peer.Track(ucp_tag_send_nbx(peer.ep(), small.data(), small.size(), i, &plain));
      peer.Track(ucp_tag_send_nbx(peer.ep(), large.data(), large.size(), i, &plain));
    }
    peer.Progress(10000);
    // Every send completed: the rendezvous ones too, which UCX would otherwise keep
    // waiting in the hardened worker's unexpected queue.
    for (size_t i = 0; i < 2 * kEach; ++i) CHECK(peer.Status(i) != UCS_INPROGRESS);
    CHECK(Eventually([&] { return h.worker->tagged_messages() - before == 2 * kEach; }));
    CHECK(h.worker->tagged_messages() - before == 2 * kEach);
    CHECK(h.worker->unknown_messages() - unknown_before == 2 * kEach);
    CHECK_FALSE(peer.failed());
  }
}

TEST_CASE(
    "a hardened worker serves software puts and gets inside memory registered for "
    "peers only, and counts the rest") {
  Hardened h = Hardened::Make();
  // Two buffers registered alike but for who may reach them: UCX's software RMA does
  // not look at either key, the hardened handlers look at the ranges.
  std::vector<char> shared(8192, 'p');
  std::vector<char> local(4096, 'l');
  auto peers = MemoryRegistration::Map(*h.context, shared.data(), 4096, MemoryType::kHost, "shared",
                                       PeerAccess::kPeers);
  REQUIRE(peers.ok());
  auto own = MemoryRegistration::Map(*h.context, local.data(), local.size(), MemoryType::kHost,
                                     "local", PeerAccess::kLocal);
  REQUIRE(own.ok());
  {
    // Eve's buffers outlive her (a get she still has in flight writes into one).
    const std::string scribble(64, 'E');
    char inside[64] = {}, beyond[64] = {}, own_bytes[64] = {};
    const uint64_t refused_before = UcxRefusedMessages();
    // tcp: UCX 1.13 has no RMA lane there, so the stock peer's UCX emulates both.
    StockUcxPeer eve(h.worker->address(), /*peer_errors=*/true, "");
    ucp_rkey_h key = eve.Unpack(peers->packed_rkey());
    ucp_request_param_t plain{};
    const auto base = reinterpret_cast<uint64_t>(shared.data());
    const auto mine = reinterpret_cast<uint64_t>(local.data());
    // Served: inside the registration.
    const size_t put_in =
        eve.Track(ucp_put_nbx(eve.ep(), scribble.data(), scribble.size(), base + 128, key, &plain));
    const size_t get_in =
        eve.Track(ucp_get_nbx(eve.ep(), inside, sizeof inside, base, key, &plain));
    // Refused: past its end (the vector goes on: UCX would have written there), and
    // memory registered only for this process.
    eve.Track(
        ucp_put_nbx(eve.ep(), scribble.data(), scribble.size(), base + 4096 - 32, key, &plain));
    const size_t get_beyond =
        eve.Track(ucp_get_nbx(eve.ep(), beyond, sizeof beyond, base + 4096, key, &plain));
    eve.Track(ucp_put_nbx(eve.ep(), scribble.data(), scribble.size(), mine, key, &plain));
    const size_t get_own =
        eve.Track(ucp_get_nbx(eve.ep(), own_bytes, sizeof own_bytes, mine, key, &plain));
    // Eve's UCX sends as it progresses (on this thread).
    CHECK(Eventually([&] {
      eve.Progress(20);
      return UcxRefusedMessages() - refused_before >= 4 && eve.Status(get_in) != UCS_INPROGRESS;
    }));
    eve.Progress(500);  // a reply to a refused get, had there been one, would have come
    CHECK(eve.Status(put_in) == UCS_OK);
    CHECK(eve.Status(get_in) == UCS_OK);
    CHECK(std::string(inside, sizeof inside) == std::string(64, 'p'));
    CHECK(std::string(shared.data() + 128, 64) == scribble);
    CHECK(eve.Status(get_beyond) != UCS_OK);
    CHECK(eve.Status(get_own) != UCS_OK);
    CHECK(std::string(own_bytes, 4) != "llll");
    CHECK(std::count(shared.begin(), shared.end(), 'E') == 64);  // only the one inside
    CHECK(std::all_of(local.begin(), local.end(), [](char c) { return c == 'l'; }));
    CHECK(UcxRefusedMessages() - refused_before == 4);
  }
  // Once unregistered, the range is out of reach again.
  peers = MemoryRegistration();
  {
    char got[64] = {};
    const uint64_t refused_before = UcxRefusedMessages();
    StockUcxPeer eve(h.worker->address(), /*peer_errors=*/true, "");
    // The key of a registration that is gone: UCX's software get carries it unchecked.
    auto again = MemoryRegistration::Map(*h.context, local.data(), local.size(), MemoryType::kHost,
                                         "again", PeerAccess::kLocal);
    REQUIRE(again.ok());
    ucp_rkey_h key = eve.Unpack(again->packed_rkey());
    ucp_request_param_t plain{};
    const size_t get = eve.Track(ucp_get_nbx(
        eve.ep(), got, sizeof got, reinterpret_cast<uint64_t>(shared.data()), key, &plain));
    CHECK(Eventually([&] {
      eve.Progress(20);
      return UcxRefusedMessages() - refused_before >= 1;
    }));
    CHECK(eve.Status(get) != UCS_OK);
  }
}

// True when [base, base + length) holds no mapping of this process (mincore refuses it).
bool Unmapped(void* base, size_t length) {
  std::vector<unsigned char> pages((length + 4095) / 4096);
  return mincore(base, length, pages.data()) != 0 && errno == ENOMEM;
}

TEST_CASE("memory a get was served from is retired to zeros until the worker flushed; "
          "memory none was served from, or flushed since, is unmapped at once") {
  constexpr size_t kLength = 1 << 20;
  void* alone = mmap(nullptr, kLength, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(alone != MAP_FAILED);
  {
    Hardened h = Hardened::Make();
    const RetiredMappings before = RetiredMappingsNow();
    auto map = [] {
      auto* p = static_cast<char*>(
          mmap(nullptr, kLength, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
      REQUIRE(p != MAP_FAILED);
      std::memset(p, 's', kLength);
      return p;
    };
    char* read = map();
    char* unread = map();
    char* flushed = map();
    auto register_for_peers = [&](char* p) {
      auto r = MemoryRegistration::Map(*h.context, p, kLength, MemoryType::kHost, "pool",
                                       PeerAccess::kPeers);
      REQUIRE(r.ok());
      return std::move(*r);
    };
    MemoryRegistration read_reg = register_for_peers(read);
    MemoryRegistration unread_reg = register_for_peers(unread);
    MemoryRegistration flushed_reg = register_for_peers(flushed);
    {
      // Eve reads from two of them (served, replies complete).
      char got[2][64] = {};
      StockUcxPeer eve(h.worker->address(), /*peer_errors=*/true, "");
      ucp_request_param_t plain{};
      std::vector<size_t> gets;
      for (auto [p, reg, into] : {std::make_tuple(read, &read_reg, got[0]),
                                  std::make_tuple(flushed, &flushed_reg, got[1])}) {
        ucp_rkey_h key = eve.Unpack(reg->packed_rkey());
        gets.push_back(eve.Track(
            ucp_get_nbx(eve.ep(), into, 64, reinterpret_cast<uint64_t>(p), key, &plain)));
      }
      CHECK(Eventually([&] {
        eve.Progress(20);
        return eve.Status(gets[0]) != UCS_INPROGRESS && eve.Status(gets[1]) != UCS_INPROGRESS;
      }));
      CHECK(eve.Status(gets[0]) == UCS_OK);
      CHECK(eve.Status(gets[1]) == UCS_OK);
      CHECK(std::string(got[1], 64) == std::string(64, 's'));
    }
    // One read from, forbidden, and flushed past by the worker (it runs): unmapped at once.
    flushed_reg = MemoryRegistration();
    CHECK(Eventually([&] { return RetiredMappingsNow().read_unflushed == before.read_unflushed; }));
    CHECK_FALSE(RetireMapping(flushed, kLength));
    munmap(flushed, kLength);
    // The worker held (its thread runs this closure), so it cannot flush.
    absl::Notification held, release;
    h.worker->Post([&] {
      held.Notify();
      release.WaitForNotification();
    });
    held.WaitForNotification();
    read_reg = MemoryRegistration();
    unread_reg = MemoryRegistration();
    CHECK(RetiredMappingsNow().read_unflushed == before.read_unflushed + 1);
    CHECK_FALSE(RetireMapping(unread, kLength));  // no get was served from it
    munmap(unread, kLength);
    REQUIRE(RetireMapping(read, kLength));
    CHECK(std::all_of(read, read + kLength, [](char c) { return c == 0; }));
    CHECK(RetiredMappingsNow().held == before.held + 1);
    CHECK(RetiredMappingsNow().held_bytes == before.held_bytes + kLength);
    release.Notify();
    CHECK(Eventually([&] { return RetiredMappingsNow().released == before.released + 1; }));
    CHECK(RetiredMappingsNow().held == before.held);
    CHECK(RetiredMappingsNow().read_unflushed == before.read_unflushed);
    CHECK(Unmapped(read, kLength));
  }
  // No worker: no reply can read memory.
  CHECK_FALSE(RetireMapping(alone, kLength));
  CHECK_FALSE(Unmapped(alone, kLength));
  munmap(alone, kLength);
}

// A remote key's entry for UCX's sysv or posix domain names a shared memory segment that
// unpacking attaches into this process as the peer's memory; UCX gives one only for
// memory it allocated, which kvagent never exports. And where a domain fails to unpack
// its entry (sysv naming segment 0, say), UCX 1.13 releases the rest of the half-built
// key as if unpacked and dies of SIGSEGV. This process links the uct_rkey_unpack
// stand-in, as kvagentd does (against the build before, the segment was attached and
// segment 0 killed the test).
TEST_CASE("a hardened worker refuses a peer's key naming a shared memory segment to attach, "
          "without attaching it") {
  Hardened h = Hardened::Make();
  auto other = UcxWorker::Create(*h.context, "other");
  REQUIRE(other.ok());
  // A segment of another UCX context (another engine, this agent's own): memory UCX
  // allocated, so its key names the segment.
  testing::UcxSysvSegment segment;
  const std::string segment_zero = segment.KeyNamingSegmentZero();

  for (ErrorMode mode : {ErrorMode::kNone, ErrorMode::kPeer}) {
    INFO("error mode " << ErrorModeName(mode));
    std::unique_ptr<Endpoint> endpoint;
    h.worker->RunSync([&] {
      auto connected = Endpoint::Connect(*h.worker, (*other)->address(), mode, nullptr);
      INFO(connected.status().ToString());
      REQUIRE(connected.ok());
      endpoint = *std::move(connected);
    });
    for (const std::string& forged : {segment.key(), segment_zero}) {
      const uint64_t before = UcxRefusedRkeyEntries();
      absl::StatusOr<RemoteKey> unpacked = absl::UnknownError("not run");
      h.worker->RunSync([&] { unpacked = endpoint->UnpackRkey(forged); });
      INFO(unpacked.status().ToString());
      CHECK(unpacked.status().code() == absl::StatusCode::kInvalidArgument);
      CHECK_THAT(std::string(unpacked.status().message()),
                 Catch::Contains("'hardened': the peer's 25-byte remote key was refused: its "
                                 "entry for UCX's sysv domain names a shared memory segment") &&
                     Catch::Contains("(not attached)"));
      CHECK(UcxRefusedRkeyEntries() == before + 1);
      CHECK(segment.Attached() == 1);
    }
    // A key of memory registered as kvagent registers its regions still unpacks.
    std::vector<char> region(4096);
    ucp_mem_map_params_t reg{};
    reg.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    reg.address = region.data();
    reg.length = region.size();
    ucp_mem_h registered = nullptr;
    REQUIRE(ucp_mem_map(segment.context(), &reg, &registered) == UCS_OK);
    void* packed = nullptr;
    size_t packed_size = 0;
    REQUIRE(ucp_rkey_pack(segment.context(), registered, &packed, &packed_size) == UCS_OK);
    const std::string honest(static_cast<const char*>(packed), packed_size);
    ucp_rkey_buffer_release(packed);
    absl::StatusOr<RemoteKey> unpacked = absl::UnknownError("not run");
    const uint64_t before = UcxRefusedRkeyEntries();
    // Wireup done before the endpoint closes: UCX 1.13 asserts when a tcp endpoint
    // closed mid-wireup purges the wireup reply still queued on it (seen under ASan).
    auto flushed = std::make_shared<absl::Notification>();
    h.worker->Post([&endpoint, flushed] {
      endpoint->Flush([flushed](absl::Status) { flushed->Notify(); });
    });
    REQUIRE(flushed->WaitForNotificationWithTimeout(absl::Seconds(10)));
    h.worker->RunSync([&] {
      unpacked = endpoint->UnpackRkey(honest);
      if (unpacked.ok()) *unpacked = RemoteKey();  // released on the worker thread
      endpoint.reset();
    });
    INFO(unpacked.status().ToString());
    CHECK(unpacked.ok());
    CHECK(UcxRefusedRkeyEntries() == before);
    REQUIRE(ucp_mem_unmap(segment.context(), registered) == UCS_OK);
  }
}

// Any other domain's failure is "unreachable" to UCX (the domain left out of the key),
// noted for the thread, and counted.
TEST_CASE("an entry a domain fails to unpack is left out of the key and noted") {
  Hardened h = Hardened::Make();
  uct_component_h* components = nullptr;
  unsigned count = 0;
  REQUIRE(uct_query_components(&components, &count) == UCS_OK);
  uct_component_h tcp = nullptr;
  for (unsigned i = 0; i < count; ++i) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    REQUIRE(uct_component_query(components[i], &attr) == UCS_OK);
    if (std::string(attr.name) == "tcp") tcp = components[i];
  }
  REQUIRE(tcp != nullptr);
  TakeRkeyRefusal();
  const uint64_t before = UcxRefusedRkeyEntries();
  RkeyUnpackFn fails = [](uct_component_h, const void*, uct_rkey_bundle_t* out) {
    out->rkey = 0x1234;  // what UCX would release if it kept the entry
    return UCS_ERR_SHMEM_SEGMENT;
  };
  uct_rkey_bundle_t bundle{};
  CHECK(UnpackRkeyEntry(tcp, "x", &bundle, fails) == UCS_ERR_UNREACHABLE);
  CHECK(bundle.rkey == UCT_INVALID_RKEY);
  CHECK(bundle.handle == nullptr);
  CHECK(UcxRefusedRkeyEntries() == before + 1);
  CHECK(TakeRkeyRefusal() ==
        "UCX's tcp domain could not unpack its entry (Shared memory error)");
  CHECK(TakeRkeyRefusal().empty());
  // Success and "unreachable" pass through untouched and unnoted.
  RkeyUnpackFn unreachable = [](uct_component_h, const void*, uct_rkey_bundle_t* out) {
    out->rkey = 7;
    return UCS_ERR_UNREACHABLE;
  };
  CHECK(UnpackRkeyEntry(tcp, "x", &bundle, unreachable) == UCS_ERR_UNREACHABLE);
  CHECK(bundle.rkey == 7);
  CHECK(TakeRkeyRefusal().empty());
  CHECK(UcxRefusedRkeyEntries() == before + 1);
  uct_release_component_list(components);
}

// Which processes of this host UCX may reach (the stand-ins are kvagentd's; the
// policy they ask is this): this process's own segments, never its own pid for cma,
// and other pids only while a local door's session holds them.
TEST_CASE("UCX reaches another process of this host only while a local door holds its pid") {
  Hardened h = Hardened::Make();  // its context armed the guard
  const int self = static_cast<int>(::getpid());
  const int other = self + 100000;  // no process of this test
  TakeSameHostRefusal();
  const uint64_t before = SameHostRefusals();
  CHECK(SameHostTargetAdmitted(self, SameHostUse::kAttach));
  CHECK_FALSE(SameHostTargetAdmitted(self, SameHostUse::kCma));
  CHECK(TakeSameHostRefusal() ==
        fmt::format("UCX's cma transport was to read or write the memory of pid {}, this agent "
                    "itself",
                    self));
  CHECK_FALSE(SameHostTargetAdmitted(other, SameHostUse::kAttach));
  CHECK_THAT(TakeSameHostRefusal(),
             Catch::StartsWith(fmt::format("UCX was to attach shared memory of pid {}, no peer "
                                           "proven on this host",
                                           other)));
  AllowSameHostPeer(other);
  AllowSameHostPeer(other);  // a second session of the same process
  CHECK(SameHostTargetAdmitted(other, SameHostUse::kAttach));
  CHECK(SameHostTargetAdmitted(other, SameHostUse::kCma));
  ForgetSameHostPeer(other);
  CHECK(SameHostTargetAdmitted(other, SameHostUse::kCma));  // one session still open
  ForgetSameHostPeer(other);
  CHECK_FALSE(SameHostTargetAdmitted(other, SameHostUse::kCma));
  CHECK(SameHostRefusals() == before + 3);
  TakeSameHostRefusal();
}

// A child process that runs `hold` (what it keeps open, and a number it reports: an
// inode, say) and waits, holding it, until this object goes.
class HoldingChild {
 public:
  explicit HoldingChild(const std::function<unsigned long long()>& hold) {
    REQUIRE(::pipe(ready_) == 0);
    REQUIRE(::pipe(release_) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      const unsigned long long reported = hold();
      (void)!::write(ready_[1], &reported, sizeof reported);
      char byte = 0;
      (void)!::read(release_[0], &byte, 1);
      ::_exit(0);
    }
    REQUIRE(::read(ready_[0], &reported_, sizeof reported_) == sizeof reported_);
  }
  ~HoldingChild() {
    (void)!::write(release_[1], "x", 1);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    for (const int end : {ready_[0], ready_[1], release_[0], release_[1]}) ::close(end);
  }
  pid_t pid() const { return pid_; }
  unsigned long long reported() const { return reported_; }

 private:
  int ready_[2] = {-1, -1};
  int release_[2] = {-1, -1};
  pid_t pid_ = -1;
  unsigned long long reported_ = 0;
};

// A pid stays admitted for a grace after its last hold went (UCX on this side may take
// a peer's wireup only after the peer closed its session), and only while the process
// that was proven has it: a process gone (or another given its pid) is refused, and so
// is the pid once the grace ended.
TEST_CASE("a proven pid stays admitted for a grace after its last hold, only as the same process") {
  Hardened h = Hardened::Make();
  TakeSameHostRefusal();
  const uint64_t before = SameHostRefusals();
  SetSameHostGrace(std::chrono::milliseconds(300));
  {
    HoldingChild child([] { return 1ULL; });
    AllowSameHostPeer(child.pid());
    ForgetSameHostPeer(child.pid());
    CHECK(SameHostTargetAdmitted(child.pid(), SameHostUse::kAttach));  // in its grace
    CHECK(SameHostTargetAdmitted(child.pid(), SameHostUse::kCma));
    // Held again within the grace, and let go again: a new grace from then.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    AllowSameHostPeer(child.pid());
    ForgetSameHostPeer(child.pid());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    CHECK(SameHostTargetAdmitted(child.pid(), SameHostUse::kAttach));
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    CHECK_FALSE(SameHostTargetAdmitted(child.pid(), SameHostUse::kAttach));  // grace over
    CHECK_THAT(TakeSameHostRefusal(),
               Catch::StartsWith(fmt::format("UCX was to attach shared memory of pid {}, no "
                                             "peer proven on this host",
                                             child.pid())));
  }
  SetSameHostGrace(std::chrono::seconds(10));
  int gone = 0;
  {
    HoldingChild child([] { return 1ULL; });
    gone = child.pid();
    AllowSameHostPeer(gone);
    ForgetSameHostPeer(gone);
    CHECK(SameHostTargetAdmitted(gone, SameHostUse::kAttach));
  }
  // The process ended (reaped): its start time is gone with it, whatever the grace.
  CHECK_FALSE(SameHostTargetAdmitted(gone, SameHostUse::kAttach));
  // A pid never proven has no grace.
  CHECK_FALSE(SameHostTargetAdmitted(gone + 100000, SameHostUse::kAttach));
  {
    // Bounded: 1,024 pids in their grace at most; the one whose grace ends first goes.
    HoldingChild child([] { return 1ULL; });
    AllowSameHostPeer(child.pid());
    ForgetSameHostPeer(child.pid());
    for (int i = 0; i < 1023; ++i) {
      AllowSameHostPeer(10000000 + i);  // no such process (over any pid_max)
      ForgetSameHostPeer(10000000 + i);
    }
    CHECK(SameHostTargetAdmitted(child.pid(), SameHostUse::kAttach));  // 1,024 in grace
    AllowSameHostPeer(10000000 + 1023);
    ForgetSameHostPeer(10000000 + 1023);
    CHECK_FALSE(SameHostTargetAdmitted(child.pid(), SameHostUse::kAttach));
  }
  CHECK(SameHostRefusals() == before + 4);
  TakeSameHostRefusal();
  SetSameHostGrace(std::chrono::seconds(0));
}

// A posix segment opened by name (a peer whose UCX runs with UCX_POSIX_USE_PROC_LINK=n)
// names no process: the file must be mapped by this process or by a pid a local door
// holds, and be a regular file.
TEST_CASE("a posix segment opened by name is admitted only when a proven process maps it") {
  Hardened h = Hardened::Make();
  CHECK(IsUcxPosixSegmentName("/dev/shm/ucx_shm_posix_1a2b"));
  CHECK(IsUcxPosixSegmentName("ucx_shm_posix_0"));
  CHECK_FALSE(IsUcxPosixSegmentName("/dev/shm/ucx_shm_posix"));
  CHECK_FALSE(IsUcxPosixSegmentName("/tmp/ucx_shm_posix_1/other"));
  CHECK_FALSE(IsUcxPosixSegmentName(nullptr));

  const std::string path = fmt::format("{}/ucx_shm_posix_{:x}", std::getenv("TEST_TMPDIR"),
                                       static_cast<unsigned>(::getpid()));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 4096) == 0);
  TakeSameHostRefusal();
  const uint64_t before = SameHostRefusals();
  CHECK_FALSE(SameHostFileAdmitted(fd, path.c_str()));  // mapped by nobody
  CHECK_THAT(TakeSameHostRefusal(),
             Catch::StartsWith(fmt::format("UCX was to open the shared memory file {}, which "
                                           "neither this agent nor a peer proven on this host "
                                           "has mapped",
                                           path)));
  {
    // Another process maps it: admitted only while a door holds that process's pid.
    HoldingChild child([fd] {
      return ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) != MAP_FAILED;
    });
    REQUIRE(child.reported() == 1);
    CHECK_FALSE(SameHostFileAdmitted(fd, path.c_str()));
    AllowSameHostPeer(child.pid());
    CHECK(SameHostFileAdmitted(fd, path.c_str()));
    ForgetSameHostPeer(child.pid());
    CHECK_FALSE(SameHostFileAdmitted(fd, path.c_str()));
  }
  // This process maps it: its own segment.
  void* own = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  REQUIRE(own != MAP_FAILED);
  CHECK(SameHostFileAdmitted(fd, path.c_str()));
  ::munmap(own, 4096);
  ::close(fd);
  ::unlink(path.c_str());
  // A special file by that name is refused whoever holds it open.
  const std::string fifo = path + "_fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const int fifo_fd = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);
  REQUIRE(fifo_fd >= 0);
  TakeSameHostRefusal();  // the two above
  CHECK_FALSE(SameHostFileAdmitted(fifo_fd, fifo.c_str()));
  CHECK_THAT(TakeSameHostRefusal(), Catch::Contains("is not a regular file"));
  ::close(fifo_fd);
  ::unlink(fifo.c_str());
  CHECK(SameHostRefusals() == before + 4);
}

// UCX's TCP connections to this host for a peer proven at the local door: the port
// must be held by a process a door proved, never by this process itself.
TEST_CASE("a TCP port on this host is admitted only when a proven process listens on it") {
  Hardened h = Hardened::Make();
  CHECK_FALSE(SameHostTcpChecked());
  {
    SameHostTcpCheck outer;
    {
      SameHostTcpCheck inner;
      CHECK(SameHostTcpChecked());
    }
    CHECK(SameHostTcpChecked());
  }
  CHECK_FALSE(SameHostTcpChecked());

  TakeSameHostRefusal();
  const uint64_t before = SameHostRefusals();
  {
    HoldingChild child([] {
      const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
      struct stat socket_file {};
      return listener >= 0 && ::listen(listener, 1) == 0 && ::fstat(listener, &socket_file) == 0
                 ? static_cast<unsigned long long>(socket_file.st_ino)
                 : 0ULL;
    });
    const unsigned long long inode = child.reported();
    REQUIRE(inode != 0);
    // The process behind a listener is found (a network door of this host, say).
    CHECK(ProcessListeningOn({{inode, ::getuid()}}) == std::optional<int>(child.pid()));
    CHECK_FALSE(ProcessListeningOn({{inode, ::getuid() + 1}}).has_value());  // not its uid
    CHECK(SameHostListenerAdmitted({}, "nobody"));  // none listens: the connect fails itself
    CHECK_FALSE(SameHostListenerAdmitted({{inode, ::getuid()}}, "127.0.0.1:1"));
    CHECK_THAT(TakeSameHostRefusal(),
               Catch::StartsWith("UCX was to connect to 127.0.0.1:1, a TCP port on this host "
                                 "that no peer proven on this host listens on"));
    AllowSameHostPeer(child.pid());
    CHECK(SameHostListenerAdmitted({{inode, ::getuid()}}, "127.0.0.1:1"));
    ForgetSameHostPeer(child.pid());
    CHECK_FALSE(SameHostListenerAdmitted({{inode, ::getuid()}}, "127.0.0.1:1"));
  }
  // This process's own port: never, held or not.
  const int own = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(own >= 0);
  REQUIRE(::listen(own, 1) == 0);
  struct stat own_file {};
  REQUIRE(::fstat(own, &own_file) == 0);
  AllowSameHostPeer(::getpid());
  CHECK_FALSE(SameHostListenerAdmitted({{own_file.st_ino, ::getuid()}}, "127.0.0.1:2"));
  ForgetSameHostPeer(::getpid());
  ::close(own);
  CHECK(SameHostRefusals() == before + 3);
  TakeSameHostRefusal();
}

// UCX 1.13 attaches a peer's posix FIFO in a named directory with its own interface's
// directory, and with none (UCX's default) it stops on an assertion: such a FIFO is
// refused where this process's interface address is the FIFO's 8-byte id alone.
TEST_CASE("a peer's posix FIFO in a named directory is refused where UCX would stop on it") {
  const uint64_t procfs = uint64_t{1} << 63, shm_open = uint64_t{1} << 62;
  const uint64_t in_directory = 0x1a2b;
  TakeSameHostRefusal();
  const uint64_t before = SameHostRefusals();
  CHECK(PosixPeerFifoAdmitted(nullptr, 8));
  CHECK(PosixPeerFifoAdmitted(&procfs, 8));
  CHECK(PosixPeerFifoAdmitted(&shm_open, 8));
  CHECK(PosixPeerFifoAdmitted(&in_directory, 8 + 16));  // this side names a directory too
  CHECK(TakeSameHostRefusal().empty());
  CHECK_FALSE(PosixPeerFifoAdmitted(&in_directory, 8));
  CHECK_THAT(TakeSameHostRefusal(),
             Catch::StartsWith("the peer's posix receive FIFO is a file in a directory its "
                               "worker address names") &&
                 Catch::Contains("UCX_POSIX_USE_PROC_LINK=y"));
  CHECK(SameHostRefusals() == before + 1);
}

// A same-host peer in a child process: reads the worker's address from `from_parent`
// (its length, then its bytes), connects without peer error handling (so over shared
// memory), sends active message 7 with reply (UCP's wireup request goes with it), says
// so on `to_parent` and waits for a byte. 'x': it exits. 'k': it sends one more message,
// of a generic datatype whose pack callback kills the process halfway through writing
// the data: UCT packs into the slot of the worker's receive queue it claimed, so the
// slot is never marked ready, as when a peer is killed mid-message by chance
// (ReceiveStall). 'f': it forks and exits; the fork, which has the child's UCX and the
// worker's receive queue mapped but is not the process the worker's endpoint reaches,
// says its pid on `to_parent` and waits for the byte the child would have. Exit codes
// past 0 name the step that failed.
[[noreturn]] void SameHostPeerChild(int from_parent, int to_parent) {
  uint32_t length = 0;
  if (::read(from_parent, &length, sizeof(length)) != sizeof(length)) _exit(2);
  std::string address(length, '\0');
  if (::read(from_parent, address.data(), length) != static_cast<ssize_t>(length)) _exit(3);
  // Forked from a process whose same-host guard is armed (a worker made before): the
  // worker it connects to is its parent's.
  AllowSameHostPeer(::getppid());
  try {
    StockUcxPeer peer(address, /*peer_errors=*/false, "");
    const char data[64] = {};
    SendWithReply(peer, peer.ep(), data, sizeof(data));
    peer.Progress(5000);
    if (peer.Status(0) != UCS_OK) _exit(4);
    char step = 'r';
    if (::write(to_parent, &step, 1) != 1 || ::read(from_parent, &step, 1) != 1) _exit(5);
    if (step == 'f') {
      if (::fork() != 0) _exit(0);
      const int32_t self = ::getpid();
      if (::write(to_parent, &self, sizeof(self)) != sizeof(self)) _exit(9);
      if (::read(from_parent, &step, 1) != 1) _exit(10);
    }
    if (step != 'k') _exit(0);
    ucp_generic_dt_ops_t ops{};
    ops.start_pack = [](void*, const void* buffer, size_t) { return const_cast<void*>(buffer); };
    ops.start_unpack = [](void*, void* buffer, size_t) { return buffer; };
    ops.packed_size = [](void*) -> size_t { return 256; };
    ops.pack = [](void*, size_t, void* dest, size_t max_length) -> size_t {
      std::memset(dest, 0x5a, max_length / 2);
      ::kill(::getpid(), SIGKILL);
      return 0;
    };
    ops.unpack = [](void*, size_t, const void*, size_t) { return UCS_OK; };
    ops.finish = [](void*) {};
    ucp_datatype_t datatype;
    if (ucp_dt_create_generic(&ops, nullptr, &datatype) != UCS_OK) _exit(6);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_DATATYPE;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    param.datatype = datatype;
    peer.Track(ucp_am_send_nbx(peer.ep(), 7, nullptr, 0, data, 1, &param));
    peer.Progress(5000);
  } catch (...) {
    _exit(7);  // a failed REQUIRE in the stock peer
  }
  _exit(8);  // the pack callback returned
}

// Reads one byte from `fd` within `ms`; false if none came.
bool ReadByte(int fd, char* byte, int ms) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, ms) == 1 && ::read(fd, byte, 1) == 1;
}

// Runs in ucx_hardening_same_host_test, which links the same-host stand-ins that tie an
// endpoint to the process it reaches (ucx_hardening_test runs every case but this one).
// UCX 1.13 keeps an endpoint to a same-host peer until the worker ends; the worker
// destroys those of a process that ended (TendSameHostEndpoints). A sender that died
// between claiming a slot of the worker's shared-memory receive queue and marking it
// ready stops that queue for good, and arm reports it (BUSY) only while the queue's
// interface is in the arm: UCP's adaptive progress (its default) leaves an interface out
// of it while no endpoint uses it, waiting for a wake-up that a sender dead mid-message
// never sends. Destroying the dead process's endpoint hid the stall (contract_test D, 2
// runs in 40 under load: another agent's ping went unanswered and health said SERVING);
// its endpoint now goes only once an arm said OK after the process was seen ended
// (ReclaimGate). And a sender that dies mid-message once no endpoint used the interface
// (here a fork of a peer whose endpoint went) stopped the queue unreported; the context
// now keeps every interface in the arm (UcxContext::Create). A peer that exits cleanly
// loses its endpoint; one killed mid-message keeps it, and the stall is reported.
TEST_CASE(
    "a same-host peer killed mid-message keeps its endpoint, and the worker reports its "
    "stopped receive queue, also when no endpoint used the queue; one that exits loses its "
    "endpoint",
    "[same_host]") {
  // The fork outlives the child the worker's endpoint reaches: this process reaps it.
  REQUIRE(::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0);
  enum class Child { kExits, kKilledMidMessage, kForkKilledOnceEndpointWent };
  for (const Child mode :
       {Child::kExits, Child::kKilledMidMessage, Child::kForkKilledOnceEndpointWent}) {
    const bool killed = mode != Child::kExits;
    INFO((mode == Child::kExits              ? "exited"
          : mode == Child::kKilledMidMessage ? "killed mid-message"
                                             : "its fork killed mid-message, no endpoint left"));
    int down[2];
    int up[2];
    REQUIRE(::pipe(down) == 0);
    REQUIRE(::pipe(up) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(down[1]);
      ::close(up[0]);
      SameHostPeerChild(down[0], up[1]);
    }
    ::close(down[0]);
    ::close(up[1]);
    AllowSameHostPeer(pid);
    Hardened h = Hardened::Make();
    CHECK(h.worker->shared_memory_interfaces_armed() >= 1);  // posix, and sysv if kept
    std::atomic<int> got{0};
    h.worker->SetAmDataHandler(7, [&](const AmMessage&) {
      ++got;
      return false;
    });
    const std::string address = h.worker->address();
    const uint32_t length = static_cast<uint32_t>(address.size());
    REQUIRE(::write(down[1], &length, sizeof(length)) == sizeof(length));
    REQUIRE(::write(down[1], address.data(), length) == static_cast<ssize_t>(length));
    char step = 0;
    CHECK(ReadByte(up[0], &step, 20000));
    CHECK(Eventually([&] { return got.load() == 1; }));
    PeerEndpoints before = PeerEndpointsNow();
    CHECK(before.live >= 1);  // UCP made one for the child's request
    uint64_t reclaimed = EndpointsReclaimed();
    pid_t sender = pid;
    if (mode == Child::kForkKilledOnceEndpointWent) {
      // The child forks and exits: its endpoint goes, the last that used the worker's
      // shared-memory interfaces.
      step = 'f';
      REQUIRE(::write(down[1], &step, 1) == 1);
      int32_t fork_pid = 0;
      pollfd p{up[0], POLLIN, 0};
      REQUIRE(::poll(&p, 1, 20000) == 1);
      REQUIRE(::read(up[0], &fork_pid, sizeof(fork_pid)) == sizeof(fork_pid));
      sender = fork_pid;
      int status = 0;
      REQUIRE(::waitpid(pid, &status, 0) == pid);
      REQUIRE(WIFEXITED(status));
      CHECK(WEXITSTATUS(status) == 0);
      CHECK(Eventually([&] { return EndpointsReclaimed() == reclaimed + 1; }));
      CHECK(PeerEndpointsNow().live == before.live - 1);
      CHECK(h.worker->receive_stalled_since_us() == 0);
      before = PeerEndpointsNow();
      reclaimed = EndpointsReclaimed();
    }
    step = killed ? 'k' : 'x';
    REQUIRE(::write(down[1], &step, 1) == 1);
    int status = 0;
    REQUIRE(::waitpid(sender, &status, 0) == sender);
    INFO("sender status " << status);
    if (killed) {
      REQUIRE(WIFSIGNALED(status));
      REQUIRE(WTERMSIG(status) == SIGKILL);
      CHECK(Eventually([&] { return h.worker->receive_stalled_since_us() != 0; }));
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // two looks more
      CHECK(EndpointsReclaimed() == reclaimed);
      CHECK(PeerEndpointsNow().live == before.live);
      CHECK(h.worker->receive_stalled_since_us() != 0);
    } else {
      REQUIRE(WIFEXITED(status));
      REQUIRE(WEXITSTATUS(status) == 0);
      CHECK(Eventually([&] { return EndpointsReclaimed() == reclaimed + 1; }));
      CHECK(PeerEndpointsNow().live == before.live - 1);
      CHECK(h.worker->receive_stalled_since_us() == 0);
    }
    CHECK(got.load() == 1);
    ForgetSameHostPeer(pid);
    ::close(down[1]);
    ::close(up[0]);
  }
}

}  // namespace
}  // namespace kvagent::transport
