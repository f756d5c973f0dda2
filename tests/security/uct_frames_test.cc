// The UCX TCP stream check (transport/ucx_tcp_guard.h) against the library it stands in
// front of. The check passes or refuses each frame of a connection by rules read from
// UCX 1.13's tcp transport: which ids UCT knows, which lengths it takes. Here each
// frame goes, alone after the magic number, to a stock UCT tcp interface in a child
// process (tests/security/uct_frame_target: the installed libuct, nothing of kvagent in
// front), and the test holds the check to what the library does: every frame the check
// passes leaves the library running, and every frame it refuses as one UCT aborts on
// does end the child. So the rules cannot drift from the installed UCX unseen.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <uct/api/uct.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::transport {
namespace {

const std::string kMagic = "\x78\x56\x34\x12\xbe\xba\xfe\xca";  // UCT's, little-endian

std::string Frame(uint8_t id, const std::string& body) {
  std::string out(1, static_cast<char>(id));
  const uint32_t length = static_cast<uint32_t>(body.size());
  out.append(reinterpret_cast<const char*>(&length), 4);
  return out + body;
}

// The check's verdict on `stream` for UCX_TCP_RX_SEG_SIZE=`rx_seg_size` (null: unset):
// "" (passed) or its refusal.
std::string Check(const std::string& stream, const char* rx_seg_size = nullptr) {
  internal::StreamCheck check;
  const std::optional<internal::StreamRules> rules = internal::RulesForRxSegSize(rx_seg_size);
  REQUIRE(rules.has_value());
  return internal::FeedStream(&check, reinterpret_cast<const uint8_t*>(stream.data()),
                              stream.size(), *rules);
}

// What the stock library did with `stream`: "alive", or how the child ended. Its UCX
// reads UCX_TCP_RX_SEG_SIZE=`rx_seg_size` (null: unset).
std::string SendToStockUct(const std::string& stream, const char* rx_seg_size = nullptr) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string target =
      fmt::format("{}/kvagent/tests/security/uct_frame_target", srcdir ? srcdir : ".");
  // The child's log (UCX's assertion, when it aborts) goes to a file, one line of it
  // into the result.
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  const std::string log = fmt::format("{}/uct_frame_target.log", tmpdir ? tmpdir : "/tmp");
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(log_fd >= 0);
  int to_child[2], from_child[2];
  REQUIRE(pipe(to_child) == 0);
  REQUIRE(pipe(from_child) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    dup2(log_fd, 2);
    close(to_child[1]);
    close(from_child[0]);
    if (rx_seg_size != nullptr) setenv("UCX_TCP_RX_SEG_SIZE", rx_seg_size, 1);
    execl(target.c_str(), target.c_str(), nullptr);
    _exit(127);
  }
  close(log_fd);
  close(to_child[0]);
  close(from_child[1]);
  // "port N"
  std::string line;
  char c;
  pollfd wait{from_child[0], POLLIN, 0};
  while (line.find('\n') == std::string::npos && poll(&wait, 1, 20000) == 1 &&
         read(from_child[0], &c, 1) == 1) {
    line += c;
  }
  int port = 0;
  const bool started = std::sscanf(line.c_str(), "port %d", &port) == 1 && port > 0;
  if (started) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    size_t sent = 0;
    while (sent < stream.size()) {
      const ssize_t n = send(fd, stream.data() + sent, stream.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;  // the child went, or closed the connection
      sent += static_cast<size_t>(n);
    }
    // Time to read and take it (the child progresses every 0.1 ms), then the end.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    close(fd);
  }
  close(to_child[1]);  // the child progresses 100 ms more, then exits
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  pid_t done = 0;
  while ((done = waitpid(pid, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  close(from_child[0]);
  if (done == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return "hung (killed after 20 s)";
  }
  if (!started) return "did not start: " + line;
  if (WIFSIGNALED(status)) {
    std::ifstream text(log);
    std::string why, each;
    while (why.empty() && std::getline(text, each)) {
      if (each.find("Assertion") != std::string::npos) why = each.substr(each.find("Assertion"));
    }
    return fmt::format("ended by signal {}{}", WTERMSIG(status), why.empty() ? "" : " (" + why + ")");
  }
  if (WEXITSTATUS(status) != 0) return fmt::format("exited {}", WEXITSTATUS(status));
  return "alive";
}

// The connection request a stock UCT tcp endpoint sends first (after the magic
// number), as it sent it: tests/security/uct_put_probe connects to a socket of this
// test and its first frame is read.
std::string HonestConnectionRequest() {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(listener >= 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof at) == 0);
  REQUIRE(listen(listener, 1) == 0);
  socklen_t length = sizeof at;
  REQUIRE(getsockname(listener, reinterpret_cast<sockaddr*>(&at), &length) == 0);
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string probe =
      fmt::format("{}/kvagent/tests/security/uct_put_probe", srcdir ? srcdir : ".");
  const std::string port = std::to_string(ntohs(at.sin_port));
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    setenv("KVAGENT_PROBE_AM", "1:1", 1);  // one active message: it connects first
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    execl(probe.c_str(), probe.c_str(), port.c_str(), "0", nullptr);
    _exit(127);
  }
  pollfd wait{listener, POLLIN, 0};
  REQUIRE(poll(&wait, 1, 20000) == 1);
  const int fd = accept(listener, nullptr, nullptr);
  REQUIRE(fd >= 0);
  std::string bytes;
  char buffer[256];
  pollfd more{fd, POLLIN, 0};
  // The magic number and one frame header, then as long as its length says.
  auto want = [&] {
    if (bytes.size() < kMagic.size() + 5) return kMagic.size() + 5;
    uint32_t frame = 0;
    std::memcpy(&frame, bytes.data() + kMagic.size() + 1, 4);
    return kMagic.size() + 5 + frame;
  };
  while (bytes.size() < want() && poll(&more, 1, 20000) == 1) {
    const ssize_t n = read(fd, buffer, std::min(sizeof buffer, want() - bytes.size()));
    if (n <= 0) break;
    bytes.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  close(listener);
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  REQUIRE(bytes.size() == want());
  REQUIRE(bytes.substr(0, kMagic.size()) == kMagic);
  REQUIRE(static_cast<uint8_t>(bytes[kMagic.size()]) == UCT_AM_ID_MAX);
  return bytes.substr(kMagic.size());
}

// A connection-manager frame: its 4-byte event, then `rest`.
std::string Cm(uint32_t event, const std::string& rest) {
  std::string body(reinterpret_cast<const char*>(&event), 4);
  return Frame(UCT_AM_ID_MAX, body + rest);
}

struct Case {
  std::string what;
  std::string frames;  // after the magic number (and the connection request, if any)
};

// The frames each stream ends with: every kind the check tells apart, on both sides of
// each of its bounds. `all`: also every connection-manager event at three lengths
// (after the first kind of stream, a few of them).
std::vector<Case> Cases(const std::string& request, bool all) {
  std::vector<Case> cases;
  // Active messages (ids below 32: UCT's stub handler takes those no one registered),
  // up to the receive buffer (64 KiB of body) and one byte past it.
  for (int id : {0, 1, 15, 31}) {
    cases.push_back({fmt::format("active message id {}, 16 bytes", id),
                     Frame(static_cast<uint8_t>(id), std::string(16, 'a'))});
  }
  cases.push_back({"active message id 5, no body", Frame(5, "")});
  cases.push_back({"active message id 7 filling the receive buffer",
                   Frame(7, std::string(65536, 'b'))});
  cases.push_back({"a frame one byte longer than the receive buffer",
                   Frame(1, std::string(65537, 'z'))});
  // Connection-manager frames: shorter than an event, and each event UCX 1.13 has
  // (1 request, 2 acknowledgement, 3 both, 4 wait, 6 acknowledgement with wait) and
  // others, at the request's length (its body after the event) and at others.
  for (size_t bytes : {0, 3}) {
    cases.push_back({fmt::format("connection manager frame of {} bytes", bytes),
                     Frame(UCT_AM_ID_MAX, std::string(bytes, '\x01'))});
  }
  const std::string request_rest = request.substr(5 + 4);
  const std::vector<uint32_t> events =
      all ? std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 0xa5a5a5a5u}
          : std::vector<uint32_t>{1, 2};
  for (uint32_t event : events) {
    cases.push_back({fmt::format("connection manager event {:#x}, no more", event),
                     Cm(event, "")});
    cases.push_back({fmt::format("connection manager event {:#x} as long as a request", event),
                     Cm(event, request_rest)});
    cases.push_back({fmt::format("connection manager event {:#x} + 60 bytes", event),
                     Cm(event, std::string(60, '\0'))});
  }
  // Put: a request of its own length naming nothing to copy; acknowledgements.
  cases.push_back({"put request of 20 bytes, no payload",
                   Frame(UCT_AM_ID_MAX + 1, std::string(20, '\0'))});
  cases.push_back({"put request of 19 bytes", Frame(UCT_AM_ID_MAX + 1, std::string(19, '\0'))});
  cases.push_back({"put acknowledgement of 4 bytes",
                   Frame(UCT_AM_ID_MAX + 2, std::string(4, '\0'))});
  cases.push_back({"put acknowledgement of 3 bytes",
                   Frame(UCT_AM_ID_MAX + 2, std::string(3, '\0'))});
  // Keepalives, whose body UCT skips.
  cases.push_back({"keepalive, no body", Frame(UCT_AM_ID_MAX + 3, "")});
  cases.push_back({"keepalive, 9 bytes", Frame(UCT_AM_ID_MAX + 3, "keepalive")});
  for (int id : {static_cast<int>(UCT_AM_ID_MAX) + 4, 255}) {
    cases.push_back({fmt::format("unknown id {}", id),
                     Frame(static_cast<uint8_t>(id), std::string(4, 'u'))});
  }
  return cases;
}

// A refusal's kind: its text with every number as '#'.
std::string Kind(const std::string& refusal) {
  std::string out;
  for (char c : refusal) {
    if (c >= '0' && c <= '9') {
      if (out.empty() || out.back() != '#') out += '#';
    } else {
      out += c;
    }
  }
  return out;
}

// For each kind of refusal: whether the stock library ended on a stream refused so.
using Refusals = std::map<std::string, bool>;

// Holds the check to the library for one stream: passed means the library lives; a
// refusal's kind is noted with what the library did.
void Expect(const std::string& what, const std::string& stream, int* passed, Refusals* refusals,
            const char* rx_seg_size = nullptr) {
  const std::string check = Check(stream, rx_seg_size);
  const std::string library = SendToStockUct(stream, rx_seg_size);
  std::printf("%-80s check: %-8s stock UCT: %s\n", what.c_str(),
              check.empty() ? "passed" : "refused", library.c_str());
  INFO(what << ": the check " << (check.empty() ? "passed it" : "refused it: " + check)
            << "; the stock UCT interface " << library);
  if (check.empty()) {
    ++*passed;
    CHECK(library == "alive");
  } else {
    (*refusals)[Kind(check)] |= library.rfind("ended by signal", 0) == 0;
  }
}

TEST_CASE("every frame the UCX TCP stream check passes leaves a stock UCT tcp interface "
          "running, and every frame it refuses ends one") {
  const std::string request = HonestConnectionRequest();
  std::printf("a stock UCT endpoint's connection request: %zu bytes of frame\n",
              request.size() - 5);
  // UCT's request changed in one field: (after the frame header, 5 bytes) its flags at
  // 4 of the body, its address's family at 13.
  auto changed = [&](size_t at, const std::string& bytes) {
    std::string out = request;
    out.replace(5 + at, bytes.size(), bytes);
    return out;
  };
  const std::string family_0 = changed(13, std::string(2, '\0'));
  const std::string family_ipv6 = changed(13, std::string("\x0a\x00", 2));
  const std::string connect_to_endpoint = changed(4, "\x01");
  const std::string other_flags = changed(4, "\xa4");
  const std::string unknown_endpoint = changed(5, std::string(8, '\xa5'));
  int passed = 0;
  Refusals refusals;
  for (const auto& [first, label] : std::vector<std::pair<std::string, std::string>>{
           {"", "first"},
           {request, "after UCT's connection request"},
           {family_0, "after a request naming an address of family 0"},
           {family_ipv6, "after a request naming an IPv6 family"},
           {connect_to_endpoint, "after a request for connect-to-endpoint (flag 1)"},
           {other_flags, "after a request with other flags (0xa4)"},
           {unknown_endpoint, "after a request naming an unknown endpoint id"}}) {
    for (const Case& c : Cases(request, first.empty())) {
      Expect(fmt::format("{}: {}", label, c.what), kMagic + first + c.frames, &passed,
             &refusals);
    }
  }
  // Another receive buffer (UCX_TCP_RX_SEG_SIZE), read by both.
  Expect("UCX_TCP_RX_SEG_SIZE=16k: 16 KiB of body", kMagic + Frame(3, std::string(16384, 'c')),
         &passed, &refusals, "16k");
  Expect("UCX_TCP_RX_SEG_SIZE=16k: a byte more", kMagic + Frame(3, std::string(16385, 'c')),
         &passed, &refusals, "16k");
  CHECK(passed > 0);
  // No rule without a cause: each kind of refusal ended the library at least once (a
  // frame UCT aborts on only in some states, such as a second connection request, is
  // refused in all of them).
  CHECK(refusals.size() >= 10);
  for (const auto& [kind, ended] : refusals) {
    std::printf("refusal kind: %s: %s\n", kind.c_str(),
                ended ? "the stock library ended on it" : "never ended the stock library");
    INFO("the check refuses streams for " << kind);
    CHECK(ended);
  }
}

}  // namespace
}  // namespace kvagent::transport
