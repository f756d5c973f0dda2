// Host staging end to end on two real kvagentd: --stage-host-regions makes their
// host regions take the "staged" path (memcpy stands in for the device copy), and
// --shm-direct off keeps the same-host shortcut out, so every byte goes through the
// bounce buffers and the staged-chunk protocol over real UCX. Small buffers (64 KiB,
// 2 of them) make chunks split, pack and reuse buffers. Bytes are compared in the
// agents' shared memory.
#include <csignal>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"

namespace kvagent::testing {
namespace {

constexpr uint64_t kChunkBytes = 64 << 10;

const std::vector<std::string> kStagingArgs = {
    "--shm-direct", "off", "--staging-chunk-bytes", std::to_string(kChunkBytes),
    "--staging-buffers", "2"};

template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  if (!value.ok()) FAIL(what << ": " << value.status().ToString());
  return *std::move(value);
}

// Two agents with their own flags; a KV pool and a STATE pool on each, prefill
// connected to decode.
struct StagedPair {
  std::string work_dir;
  cli::DaemonProcess prefill, decode;
  std::unique_ptr<cli::AgentClient> prefill_client, decode_client;
  cli::Pool prefill_pool, decode_pool;

  StagedPair(bool stage_prefill, bool stage_decode, uint64_t page_bytes,
             const std::vector<std::string>& extra_args = {}, uint64_t kv_items = 16) {
    static int counter = 0;
    const char* tmp = std::getenv("TEST_TMPDIR");
    work_dir = fmt::format("{}/staged.{}.{}", tmp ? tmp : "/tmp", getpid(), counter++);
    std::filesystem::create_directories(work_dir);
    const std::string binary = Require(cli::FindKvagentd(""), "finding kvagentd");
    for (auto [name, process, staged] : {std::tuple{"prefill", &prefill, stage_prefill},
                                         std::tuple{"decode", &decode, stage_decode}}) {
      cli::DaemonOptions d;
      d.binary = binary;
      d.name = name;
      d.work_dir = work_dir;
      d.extra_args = kStagingArgs;
      d.extra_args.insert(d.extra_args.end(), extra_args.begin(), extra_args.end());
      if (staged) d.extra_args.push_back("--stage-host-regions");
      *process = Require(cli::DaemonProcess::Start(d), fmt::format("starting {}", name));
    }
    prefill_client = std::make_unique<cli::AgentClient>(prefill.address());
    decode_client = std::make_unique<cli::AgentClient>(decode.address());
    std::vector<cli::PoolGroupShape> groups(2);
    groups[0].group = "kv";
    groups[0].kind = v1::KV;
    groups[0].region_suffixes = {"L0.K", "L0.V", "L1.K", "L1.V"};
    groups[0].items = kv_items;
    groups[0].item_bytes = page_bytes;
    // A Mamba-like state slot bigger than two bounce buffers.
    groups[1].group = "ssm";
    groups[1].kind = v1::STATE;
    groups[1].region_suffixes = {"conv", "ssm"};
    groups[1].items = 4;
    groups[1].item_bytes = 150000;
    prefill_pool = Require(cli::CreatePool(*prefill_client, "prefill", groups), "prefill pool");
    decode_pool = Require(cli::CreatePool(*decode_client, "decode", groups), "decode pool");
    REQUIRE(prefill_client->Connect(decode.address()).ok());
    REQUIRE(decode_client->Connect(prefill.address()).ok());
    for (size_t g = 0; g < groups.size(); ++g) {
      for (uint32_t r = 0; r < groups[g].regions(); ++r) {
        for (uint64_t i = 0; i < groups[g].items; ++i) {
          cli::FillPage(prefill_pool.Item(g, r, i), groups[g].item_bytes, 11 + g, r, i);
          cli::FillPage(decode_pool.Item(g, r, i), groups[g].item_bytes, 99 + g, r, i);
        }
      }
    }
  }

  // Item `src` of every region of group `g` on `from` equals item `dst` on `to`.
  static bool ItemEqual(const cli::Pool& from, const cli::Pool& to, size_t g, uint64_t src,
                        uint64_t dst) {
    const auto& shape = from.groups[g].shape;
    for (uint32_t r = 0; r < shape.regions(); ++r) {
      if (std::memcmp(from.Item(g, r, src), to.Item(g, r, dst), shape.item_bytes) != 0) return false;
    }
    return true;
  }
};

v1::SubmitTransferRequest Request(const std::string& id, const std::string& peer, v1::TransferOp op,
                                  const std::vector<uint64_t>& local,
                                  const std::vector<uint64_t>& remote,
                                  const std::string& group = "kv") {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer(peer);
  request.set_op(op);
  auto* items = request.add_segments()->mutable_items();
  items->set_local_group(group);
  items->set_remote_group(group);
  for (auto i : local) items->add_local_indices(i);
  for (auto i : remote) items->add_remote_indices(i);
  return request;
}

v1::TransferState WaitDone(cli::AgentClient& client, const std::string& id) {
  auto state = client.WaitTransfer(id, 30000);
  REQUIRE(state.ok());
  return *state;
}

// Polls `client` as fast as it can until a notification is there (30 s at most).
v1::Notification FirstNotification(cli::AgentClient& client) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < until) {
    auto polled = client.Poll(0);
    REQUIRE(polled.ok());
    if (polled->notifications_size() > 0) return polled->notifications(0);
  }
  FAIL("no notification within 30 s");
  return {};
}

// The scattered WRITE both WRITE cases send (kv items 1, 5, 6, 11 to 2, 9, 3, 14 and
// ssm slot 2 to 0) is in place on decode.
void CheckScatteredWrite(const StagedPair& pair) {
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 1, 2));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 5, 9));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 6, 3));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 11, 14));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 2, 0));
}

// Same-host agents send chunks and read replies eager (transport Endpoint::EagerOnly);
// --allow-rendezvous makes them send by rendezvous, as agents of older versions (and
// agents on other hosts with RDMA) do, so the receiving side's rendezvous path (a
// chunk waiting for a receive buffer, then fetched into it) runs too.
const std::vector<std::string>& SendMode(const std::string& mode) {
  static const std::vector<std::string> eager = {"--metrics-listen", "127.0.0.1:0"},
                                        rendezvous = {"--metrics-listen", "127.0.0.1:0",
                                                      "--allow-rendezvous"};
  return mode == "rendezvous" ? rendezvous : eager;
}

// The agent that took chunks or read replies took them as `mode` says.
void CheckSentAs(const std::string& mode, cli::AgentClient& receiver) {
  const double by_rendezvous = Value(Scrape(MetricsAddress(receiver)), "kvagent_staging_total",
                                     {"event=\"received_by_rendezvous\""});
  if (mode == "rendezvous") {
    CHECK(by_rendezvous > 0);
  } else {
    CHECK(by_rendezvous == 0);
  }
}

TEST_CASE("staged WRITE: scattered pages larger than a chunk and a state slot arrive intact, "
          "and the notification comes only after the data") {
  const std::string mode = GENERATE("eager", "rendezvous");
  INFO("chunks sent " << mode);
  // Pages of 80 KiB: each splits over two chunks.
  StagedPair pair(true, true, 80 << 10, SendMode(mode));
  auto regions = Require(pair.decode_client->Regions(), "listing decode regions");
  for (const auto& r : regions.regions()) CHECK(r.memory_path() == "staged");

  auto request = Request("staged-write", "decode", v1::WRITE, {1, 5, 6, 11}, {2, 9, 3, 14});
  auto* slot = request.add_segments()->mutable_items();
  slot->set_local_group("ssm");
  slot->set_remote_group("ssm");
  slot->add_local_indices(2);
  slot->add_remote_indices(0);
  request.set_notification("first-token:7");
  auto submitted = pair.prefill_client->Submit(request);
  REQUIRE(submitted.ok());

  // Poll as fast as we can: the moment the notification is visible, every byte must
  // already be in place.
  const v1::Notification note = FirstNotification(*pair.decode_client);
  CheckScatteredWrite(pair);
  CHECK(note.kind() == v1::DATA_READY);
  CHECK(note.payload() == "first-token:7");
  const uint64_t expected = 4 * 4 * (80 << 10) + 2 * 150000;
  CHECK(note.bytes() == expected);
  CHECK(note.staged_bytes() == expected);

  auto done = WaitDone(*pair.prefill_client, "staged-write");
  CHECK(done.phase() == v1::COMPLETED);
  CHECK(done.bytes_done() == expected);
  // Untouched items stayed as they were.
  CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 0, 0));
  CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 3, 3));
  CheckSentAs(mode, *pair.decode_client);
}

TEST_CASE("a staged WRITE that asks to complete when placed completes when acknowledged: the "
          "peer still copies the staged bytes in, and only its answer says they are there") {
  StagedPair pair(true, true, 80 << 10);
  auto request = Request("staged-placed", "decode", v1::WRITE, {1, 5}, {2, 9});
  request.set_notification("placed?");
  request.set_complete_when(v1::COMPLETE_WHEN_PLACED);
  auto submitted = pair.prefill_client->Submit(request);
  REQUIRE(submitted.ok());
  CHECK(submitted->complete_when() == v1::COMPLETE_WHEN_PLACED);  // as asked, so far
  auto done = WaitDone(*pair.prefill_client, "staged-placed");
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.complete_when() == v1::COMPLETE_WHEN_ACKNOWLEDGED);
  CHECK_FALSE(done.peer_acknowledged());  // only for transfers completed when placed
  // The acknowledgement came before the end, as for any acknowledged transfer.
  int acked = -1, ended = -1;
  for (int i = 0; i < done.timeline_size(); ++i) {
    if (done.timeline(i).stage() == v1::STAGE_ACKNOWLEDGED) acked = i;
    if (done.timeline(i).stage() == v1::STAGE_ENDED) ended = i;
  }
  CHECK(acked >= 0);
  CHECK(acked < ended);
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 1, 2));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 5, 9));
  auto status = Require(pair.prefill_client->Status(), "prefill status");
  CHECK(status.completed_when_placed() == 0);
  CHECK(status.transfers_completed() == 1);
}


// 1,024 scattered pages of 256 B in each of 4 regions, 4 MiB chunks: without a bound
// on the header bytes, 1,024 pieces made a 13 KiB chunk header, and UCX aborted the
// sending agent ("RTS is too big 13405, max 8256": a rendezvous header must fit one
// transport buffer). Chunks now end where their pieces fill the worker's largest
// active-message header. Both ways, over shared memory (staged regions, chunks eager
// and, as older agents sent them, by rendezvous) and over tcp (the agents' own eager
// messages, read requests naming as many pieces).
void ManySmallPages(bool over_tcp, const std::string& mode = "eager") {
  std::vector<std::string> args = {"--staging-chunk-bytes", "4194304"};
  if (over_tcp) args.insert(args.end(), {"--ucx-error-mode", "peer"});
  args.insert(args.end(), SendMode(mode).begin(), SendMode(mode).end());
  StagedPair pair(!over_tcp, !over_tcp, 256, args, 2048);
  std::vector<uint64_t> src, dst;
  for (uint64_t i = 0; i < 1024; ++i) {
    src.push_back(2 * i);
    dst.push_back(2047 - 2 * i);  // reversed, every other page: nothing coalesces
  }
  REQUIRE(pair.prefill_client->Submit(Request("many-w", "decode", v1::WRITE, src, dst)).ok());
  auto written = WaitDone(*pair.prefill_client, "many-w");
  INFO(written.error_message());
  REQUIRE(written.phase() == v1::COMPLETED);
  // decode reads prefill's odd pages into its even ones (not written above).
  std::vector<uint64_t> theirs, ours;
  for (uint64_t i = 0; i < 1024; ++i) {
    theirs.push_back(2 * i + 1);
    ours.push_back(2046 - 2 * i);
  }
  REQUIRE(pair.decode_client->Submit(Request("many-r", "prefill", v1::READ, ours, theirs)).ok());
  auto read = WaitDone(*pair.decode_client, "many-r");
  INFO(read.error_message());
  REQUIRE(read.phase() == v1::COMPLETED);
  size_t wrong = 0;
  for (uint64_t i = 0; i < 1024; ++i) {
    if (!StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, src[i], dst[i])) ++wrong;
    if (!StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, theirs[i], ours[i])) ++wrong;
  }
  CHECK(wrong == 0);
  CHECK(written.bytes_done() == 1024 * 4 * 256);
  CHECK(read.bytes_done() == 1024 * 4 * 256);
  if (!over_tcp) {
    CheckSentAs(mode, *pair.decode_client);  // the WRITE's chunks and the READ's replies
  }
}

TEST_CASE("staged WRITE and READ of a thousand small scattered pages: chunk headers fit the "
          "transport, over shared memory") {
  const std::string mode = GENERATE("eager", "rendezvous");
  INFO("chunks sent " << mode);
  ManySmallPages(false, mode);
}

TEST_CASE("WRITE and READ of a thousand small scattered pages over tcp: chunk headers and read "
          "requests fit the transport") {
  ManySmallPages(true);
}

TEST_CASE("staged WRITE packs many small pages into shared chunks") {
  StagedPair pair(true, true, 4096);  // 16 pages of 4 KiB fill one 64 KiB chunk
  std::vector<uint64_t> src, dst;
  for (uint64_t i = 0; i < 16; ++i) {
    src.push_back(i);
    dst.push_back(15 - i);  // reversed: nothing coalesces on both sides
  }
  for (int round = 0; round < 3; ++round) {
    const std::string id = fmt::format("packed-{}", round);
    REQUIRE(pair.prefill_client->Submit(Request(id, "decode", v1::WRITE, src, dst)).ok());
    auto done = WaitDone(*pair.prefill_client, id);
    REQUIRE(done.phase() == v1::COMPLETED);
  }
  for (uint64_t i = 0; i < 16; ++i) {
    INFO("page " << i);
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, i, 15 - i));
  }
  // Every transfer's notification arrives, each once.
  std::map<std::string, int> seen;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (seen.size() < 3 && std::chrono::steady_clock::now() < until) {
    auto polled = pair.decode_client->Poll(0);
    REQUIRE(polled.ok());
    for (const auto& n : polled->notifications()) ++seen[n.transfer_id()];
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(seen == std::map<std::string, int>{{"packed-0", 1}, {"packed-1", 1}, {"packed-2", 1}});
}

v1::TransferState WaitDrained(cli::AgentClient& client, const std::string& id, int seconds) {
  v1::TransferState state = Require(client.Get(id), "getting the transfer");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (!state.drained() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    state = Require(client.Get(id), "getting the transfer");
  }
  return state;
}

// Submits `request` held open (more_chunks), so it cannot complete first, and cancels
// it: the answer must already say CANCELLED.
void OpenThenCancel(cli::AgentClient& client, v1::SubmitTransferRequest request) {
  request.set_more_chunks(true);
  REQUIRE(client.Submit(request).ok());
  auto cancelled = client.Cancel(request.transfer_id());
  REQUIRE(cancelled.ok());
  CHECK(cancelled->phase() == v1::CANCELLED);
}

TEST_CASE("a staged WRITE cancelled mid-way reports drained once no chunk is in flight") {
  StagedPair pair(true, true, 80 << 10);
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < 16; ++i) all.push_back(i);
  OpenThenCancel(*pair.prefill_client, Request("staged-cancel", "decode", v1::WRITE, all, all));
  auto done = WaitDrained(*pair.prefill_client, "staged-cancel", 10);
  CHECK(done.phase() == v1::CANCELLED);
  CHECK(done.drained());
  // The peer hears of the cancel (and drops what it counted), never a DATA_READY.
  std::vector<v1::Notification> notes;
  const auto poll_until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (notes.empty() && std::chrono::steady_clock::now() < poll_until) {
    auto polled = pair.decode_client->Poll(0);
    REQUIRE(polled.ok());
    for (const auto& n : polled->notifications()) notes.push_back(n);
  }
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].kind() == v1::CANCELLED_BY_PEER);

  // The agents still move data afterwards (buffers were all returned).
  REQUIRE(pair.prefill_client->Submit(Request("after-cancel", "decode", v1::WRITE, {3}, {4})).ok());
  CHECK(WaitDone(*pair.prefill_client, "after-cancel").phase() == v1::COMPLETED);
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 3, 4));
}

TEST_CASE("staged READ into our staged memory from a peer's host memory") {
  StagedPair pair(false, true, 80 << 10);  // decode stages, prefill is plain host memory
  auto request = Request("staged-read", "prefill", v1::READ, {2, 9, 3}, {1, 5, 6});
  auto* slot = request.add_segments()->mutable_items();
  slot->set_local_group("ssm");
  slot->set_remote_group("ssm");
  slot->add_local_indices(1);
  slot->add_remote_indices(3);
  REQUIRE(pair.decode_client->Submit(request).ok());
  auto done = WaitDone(*pair.decode_client, "staged-read");
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 1, 2));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 5, 9));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 6, 3));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 3, 1));
  CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 0, 0));

  // WRITE from staged memory into the peer's host memory: bounce buffer, then put.
  auto push = Request("staged-put", "prefill", v1::WRITE, {7}, {8});
  REQUIRE(pair.decode_client->Submit(push).ok());
  REQUIRE(WaitDone(*pair.decode_client, "staged-put").phase() == v1::COMPLETED);
  CHECK(StagedPair::ItemEqual(pair.decode_pool, pair.prefill_pool, 0, 7, 8));
}

// Adds the state slot `local` <- `remote` of group "ssm" to `request`.
void AddSlot(v1::SubmitTransferRequest& request, uint64_t local, uint64_t remote) {
  auto* slot = request.add_segments()->mutable_items();
  slot->set_local_group("ssm");
  slot->set_remote_group("ssm");
  slot->add_local_indices(local);
  slot->add_remote_indices(remote);
}

// Waits until the transfer reports drained (bounded), returning the last state.
TEST_CASE("READ of the peer's staged memory: scattered pages split over chunks and a state "
          "slot arrive intact, into host or staged memory") {
  const std::string mode = GENERATE("eager", "rendezvous");
  INFO("replies sent " << mode);
  for (bool stage_decode : {false, true}) {
    INFO("decode's own memory staged: " << stage_decode);
    // prefill stages; pages span 2 chunks.
    StagedPair pair(true, stage_decode, 80 << 10, SendMode(mode));
    auto request = Request("read-staged", "prefill", v1::READ, {2, 9, 3, 14}, {1, 5, 6, 11});
    AddSlot(request, 1, 3);
    auto submitted = pair.decode_client->Submit(request);
    REQUIRE(submitted.ok());
    auto done = WaitDone(*pair.decode_client, "read-staged");
    INFO(done.error_message());
    REQUIRE(done.phase() == v1::COMPLETED);
    const uint64_t expected = 4 * 4 * (80 << 10) + 2 * 150000;
    CHECK(done.bytes_done() == expected);
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 1, 2));
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 5, 9));
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 6, 3));
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 11, 14));
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 3, 1));
    // Only the requested items changed.
    CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 0, 0));
    CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 2, 2));
    CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 0, 0));
    CheckSentAs(mode, *pair.decode_client);
    // The serving agent's pages are unchanged by being read.
    for (uint64_t i : {1, 5, 6, 11}) {
      for (uint32_t r = 0; r < 4; ++r) {
        std::vector<uint8_t> want(80 << 10);
        cli::FillPage(want.data(), want.size(), 11, r, i);
        CHECK(std::memcmp(pair.prefill_pool.Item(0, r, i), want.data(), want.size()) == 0);
      }
    }
  }
}

TEST_CASE("READ of staged memory packs many small pages, and two agents reading from each "
          "other at once both finish") {
  StagedPair pair(true, true, 4096);
  std::vector<uint64_t> src, dst;
  for (uint64_t i = 0; i < 8; ++i) {
    src.push_back(i);
    dst.push_back(15 - i);  // reversed: nothing coalesces on both sides
  }
  for (int round = 0; round < 3; ++round) {
    const std::string a = fmt::format("pull-a-{}", round), b = fmt::format("pull-b-{}", round);
    // decode pulls prefill's 0..7 into its 15..8; prefill pulls decode's 0..7 into its
    // 15..8 (pages read on one side are not written on it).
    REQUIRE(pair.decode_client->Submit(Request(a, "prefill", v1::READ, dst, src)).ok());
    REQUIRE(pair.prefill_client->Submit(Request(b, "decode", v1::READ, dst, src)).ok());
    auto da = WaitDone(*pair.decode_client, a);
    auto db = WaitDone(*pair.prefill_client, b);
    INFO(da.error_message() << " / " << db.error_message());
    REQUIRE(da.phase() == v1::COMPLETED);
    REQUIRE(db.phase() == v1::COMPLETED);
  }
  for (uint64_t i = 0; i < 8; ++i) {
    INFO("page " << i);
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, i, 15 - i));
  }
  // prefill's 15..8 now hold decode's 0..7 as they were before any transfer.
  for (uint64_t i = 0; i < 8; ++i) {
    for (uint32_t r = 0; r < 4; ++r) {
      std::vector<uint8_t> want(4096);
      cli::FillPage(want.data(), want.size(), 99, r, i);
      CHECK(std::memcmp(pair.prefill_pool.Item(0, r, 15 - i), want.data(), want.size()) == 0);
    }
  }
}

TEST_CASE("READ of a hung peer's staged memory ends by its deadline and drains; the agent "
          "reads again once the peer is back") {
  StagedPair pair(true, false, 80 << 10);
  REQUIRE(SuspendAgent(pair.prefill.pid()) == "");
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < 16; ++i) all.push_back(i);
  auto request = Request("read-hung", "prefill", v1::READ, all, all);
  request.set_timeout_ms(700);
  auto submitted = pair.decode_client->Submit(request);
  if (!submitted.ok()) kill(pair.prefill.pid(), SIGCONT);
  REQUIRE(submitted.ok());
  auto done = WaitDone(*pair.decode_client, "read-hung");
  done = WaitDrained(*pair.decode_client, "read-hung", 5);
  // The pages of the hung peer never came: a deadline, or the peer declared lost.
  const bool expected_end = done.phase() == v1::TIMED_OUT || done.phase() == v1::FAILED;
  CHECK(expected_end);
  CHECK(done.drained());
  INFO(done.error_message());
  const v1::TransferState before = done;
  // Nothing of the peer may land after drained: keep a copy of our pages, let the peer
  // run (it answers the requests it got), and compare.
  std::vector<std::vector<uint8_t>> snapshot;
  for (uint64_t i = 0; i < 16; ++i) {
    for (uint32_t r = 0; r < 4; ++r) {
      const uint8_t* p = pair.decode_pool.Item(0, r, i);
      snapshot.emplace_back(p, p + (80 << 10));
    }
  }
  REQUIRE(kill(pair.prefill.pid(), SIGCONT) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  size_t k = 0;
  for (uint64_t i = 0; i < 16; ++i) {
    for (uint32_t r = 0; r < 4; ++r, ++k) {
      INFO("page " << i << " region " << r);
      CHECK(std::memcmp(pair.decode_pool.Item(0, r, i), snapshot[k].data(), snapshot[k].size()) == 0);
    }
  }
  // Every bounce buffer came back: a new READ completes (after reconnecting if the peer
  // was declared lost).
  if (done.phase() == v1::FAILED) REQUIRE(pair.decode_client->Connect(pair.prefill.address()).ok());
  v1::TransferState again;
  for (int attempt = 0; attempt < 20; ++attempt) {
    const std::string id = fmt::format("read-after-{}", attempt);
    auto resubmitted = pair.decode_client->Submit(Request(id, "prefill", v1::READ, {4, 7}, {3, 8}));
    if (resubmitted.ok()) {
      again = WaitDone(*pair.decode_client, id);
      if (again.phase() == v1::COMPLETED) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  INFO(again.error_message());
  CHECK(again.phase() == v1::COMPLETED);
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 3, 4));
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 8, 7));
}

TEST_CASE("a READ of staged memory cancelled mid-way drains, and reading works after") {
  StagedPair pair(true, true, 80 << 10);
  std::vector<uint64_t> all;
  for (uint64_t i = 0; i < 16; ++i) all.push_back(i);
  OpenThenCancel(*pair.decode_client, Request("read-cancel", "prefill", v1::READ, all, all));
  auto done = WaitDrained(*pair.decode_client, "read-cancel", 10);
  CHECK(done.phase() == v1::CANCELLED);
  CHECK(done.drained());
  REQUIRE(pair.decode_client->Submit(Request("read-after-cancel", "prefill", v1::READ, {3}, {4})).ok());
  CHECK(WaitDone(*pair.decode_client, "read-after-cancel").phase() == v1::COMPLETED);
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 4, 3));
}

// An endpoint without native RMA: --ucx-error-mode peer puts it on tcp, where UCX 1.13
// emulates put and get with messages that the receiving worker answers itself, and
// aborts the process when that answer fails because the other side died. The agents
// move host memory as their own eager messages instead (data path "ucx-am"), with the
// staged-chunk and read-request protocol, checked on arrival against the receiver's
// registered regions. Nothing here is staged.
TEST_CASE("host memory over an endpoint without native RMA (tcp) moves as the agents' own "
          "messages: WRITE and READ byte-exact, DATA_READY only after the data") {
  // Messages of 16 KiB (--am-message-bytes), under the 64 KiB bounce buffers: each
  // 80 KiB page travels in pieces of several messages.
  constexpr uint64_t kMessageBytes = 16 << 10;
  StagedPair pair(false, false, 80 << 10,
                  {"--ucx-error-mode", "peer", "--metrics-listen", "127.0.0.1:0",
                   "--am-message-bytes", std::to_string(kMessageBytes)});
  for (auto* client : {pair.prefill_client.get(), pair.decode_client.get()}) {
    auto regions = Require(client->Regions(), "listing regions");
    for (const auto& r : regions.regions()) CHECK(r.memory_path() != "staged");
    auto peers = Require(client->Peers(), "listing peers");
    REQUIRE(peers.peers_size() == 1);
    INFO(peers.peers(0).DebugString());
    CHECK(peers.peers(0).data_path() == "ucx-am");
    CHECK(peers.peers(0).transports() == "tcp");
  }

  auto write = Request("am-write", "decode", v1::WRITE, {1, 5, 6, 11}, {2, 9, 3, 14});
  AddSlot(write, 2, 0);
  write.set_notification("am:1");
  REQUIRE(pair.prefill_client->Submit(write).ok());
  // The moment DATA_READY is visible, every byte must be in place.
  const v1::Notification note = FirstNotification(*pair.decode_client);
  CheckScatteredWrite(pair);
  const uint64_t expected = 4 * 4 * (80 << 10) + 2 * 150000;
  CHECK(note.payload() == "am:1");
  CHECK(note.staged_bytes() == expected);
  auto written = WaitDone(*pair.prefill_client, "am-write");
  INFO(written.error_message());
  CHECK(written.phase() == v1::COMPLETED);
  CHECK(written.bytes_done() == expected);
  CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 0, 0));

  // READ: decode reads prefill's items 3, 8, 10, 12 and state slot 3 into its own.
  auto read = Request("am-read", "prefill", v1::READ, {0, 4, 7, 15}, {3, 8, 10, 12});
  AddSlot(read, 1, 3);
  REQUIRE(pair.decode_client->Submit(read).ok());
  auto done = WaitDone(*pair.decode_client, "am-read");
  INFO(done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.bytes_done() == expected);
  const std::vector<uint64_t> remote = {3, 8, 10, 12}, local = {0, 4, 7, 15};
  for (size_t i = 0; i < remote.size(); ++i) {
    CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, remote[i], local[i]));
  }
  CHECK(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 1, 3, 1));
  CHECK_FALSE(StagedPair::ItemEqual(pair.prefill_pool, pair.decode_pool, 0, 13, 13));

  // The bytes went as the agents' messages: decode took WRITE chunks (80 KiB pages
  // over 16 KiB messages, and the slot), prefill served READ requests of that size.
  const std::string decode_metrics = Scrape(MetricsAddress(*pair.decode_client));
  const std::string prefill_metrics = Scrape(MetricsAddress(*pair.prefill_client));
  const double chunks = Value(decode_metrics, "kvagent_staging_total", {"event=\"chunks_received\""});
  const double served = Value(prefill_metrics, "kvagent_staging_total", {"event=\"reads_served\""});
  std::printf("over tcp as active messages: %.0f chunks received by decode, %.0f read replies "
              "served by prefill\n", chunks, served);
  CHECK(chunks >= static_cast<double>(expected / kMessageBytes));
  CHECK(served >= static_cast<double>(expected / kMessageBytes));
  CHECK(Value(decode_metrics, "kvagent_staging_total", {"event=\"chunks_rejected\""}) == 0);
  CHECK(Value(prefill_metrics, "kvagent_staging_total", {"event=\"reads_refused\""}) == 0);
}

}  // namespace
}  // namespace kvagent::testing
