// The UCX TCP stream check (transport/ucx_tcp_guard.h) against the library it stands in
// front of. The check passes or refuses each frame of a connection by rules read from
// UCX 1.13's tcp transport: which ids UCT knows, which lengths it takes. Here each
// frame goes, alone after the magic number, to a stock UCT tcp interface in a child
// process (tests/security/uct_frame_target: the installed libuct, nothing of kvagent in
// front), and the test holds the check to what the library does: every frame the check
// passes leaves the library running, and every frame it refuses as one UCT aborts on
// does end the child. So the rules cannot drift from the installed UCX unseen. The
// same for the other direction: what a peer answers on a connection this agent's UCX
// dialled, sent to a stock UCT endpoint that dialled the test.
#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
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
#include "tests/unit/catch_main.h"
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

// The IPv6 interface of the IPv6 case, in a network namespace of its own.
constexpr const char* kIpv6Device = "kvf0";
constexpr const char* kIpv6Address = "fd77::1";

// The stock interface a stream goes to.
struct Target {
  const char* rx_seg_size = nullptr;  // its UCX_TCP_RX_SEG_SIZE (null: unset)
  // On kIpv6Device at kIpv6Address (UCX_TCP_AF_PRIO=inet6), which the calling thread's
  // network namespace holds; else on loopback, IPv4.
  bool ipv6 = false;
  // The stream answers a stock UCT endpoint that dialled this test (on loopback, IPv4):
  // no magic number comes that way (AnswerStockUctDialler).
  bool dialled = false;
};

// The loopback socket every stock UCT endpoint of the dialled cases dials (one for the
// whole test, so that an answer can name the address UCT dialled): its descriptor and
// address; fd -1 when it could not be set up.
struct DialledListener {
  int fd = -1;
  sockaddr_in at{};
};
const DialledListener& TheDialledListener() {
  static const DialledListener listener = [] {
    DialledListener out;
    out.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    out.at.sin_family = AF_INET;
    out.at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof out.at;
    if (out.fd < 0 || bind(out.fd, reinterpret_cast<sockaddr*>(&out.at), sizeof out.at) != 0 ||
        listen(out.fd, 8) != 0 ||
        getsockname(out.fd, reinterpret_cast<sockaddr*>(&out.at), &length) != 0) {
      if (out.fd >= 0) close(out.fd);
      out.fd = -1;
    }
    return out;
  }();
  return listener;
}

std::string HonestConnectionRequest();

// The check's verdict on `stream` for `target`: "" (passed) or its refusal. A dialled
// connection's check knows what the stock endpoint sent first (its magic number and
// request, as HonestConnectionRequest read it: each stock endpoint is a new process
// dialling the same address, so connection 0) and the address it dialled.
std::string Check(const std::string& stream, const Target& target = {}) {
  internal::StreamCheck check = internal::StreamCheck{};
  if (target.dialled) {
    const sockaddr_in& to = TheDialledListener().at;
    check = internal::DialledStreamCheck(reinterpret_cast<const sockaddr*>(&to), sizeof to);
    const std::string sent = kMagic + HonestConnectionRequest();
    internal::NoteSent(&check, reinterpret_cast<const uint8_t*>(sent.data()), sent.size());
  }
  check.request_bytes = internal::ConnectionRequestBytes(target.ipv6 ? AF_INET6 : AF_INET);
  const std::optional<internal::StreamRules> rules =
      internal::RulesForRxSegSize(target.rx_seg_size);
  REQUIRE(rules.has_value());
  return internal::FeedStream(&check, reinterpret_cast<const uint8_t*>(stream.data()),
                              stream.size(), *rules);
}

std::string AnswerStockUctDialler(const std::string& stream);

// What the stock library did with `stream`: "alive", or how the child ended ("setup:
// ..." when this side failed). Runs on any thread (no test assertions).
std::string SendToStockUct(const std::string& stream, const Target& target = {}) {
  if (target.dialled) return AnswerStockUctDialler(stream);
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string binary =
      fmt::format("{}/kvagent/tests/security/uct_frame_target", srcdir ? srcdir : ".");
  // The child's log (UCX's assertion, when it aborts) goes to a file, one line of it
  // into the result.
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  const std::string log = fmt::format("{}/uct_frame_target.log", tmpdir ? tmpdir : "/tmp");
  const int log_fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  int to_child[2], from_child[2];
  if (log_fd < 0 || pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) {
    return fmt::format("setup: {}", std::strerror(errno));
  }
  const pid_t pid = fork();
  if (pid < 0) return fmt::format("setup: fork: {}", std::strerror(errno));
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    dup2(log_fd, 2);
    close(to_child[1]);
    close(from_child[0]);
    if (target.rx_seg_size != nullptr) setenv("UCX_TCP_RX_SEG_SIZE", target.rx_seg_size, 1);
    if (target.ipv6) {
      setenv("KVAGENT_TARGET_DEVICE", kIpv6Device, 1);
      setenv("UCX_TCP_AF_PRIO", "inet6", 1);
    }
    execl(binary.c_str(), binary.c_str(), nullptr);
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
  char family[8] = {};
  bool started = std::sscanf(line.c_str(), "port %d %7s", &port, family) == 2 && port > 0 &&
                 std::string(family) == (target.ipv6 ? "ipv6" : "ipv4");
  std::string connected;
  if (started) {
    sockaddr_storage to{};
    if (target.ipv6) {
      auto* six = reinterpret_cast<sockaddr_in6*>(&to);
      six->sin6_family = AF_INET6;
      six->sin6_port = htons(static_cast<uint16_t>(port));
      inet_pton(AF_INET6, kIpv6Address, &six->sin6_addr);
    } else {
      auto* four = reinterpret_cast<sockaddr_in*>(&to);
      four->sin_family = AF_INET;
      four->sin_port = htons(static_cast<uint16_t>(port));
      four->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    const int fd = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const timeval bound{5, 0};  // connect and send give up after 5 s
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
    if (connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      connected = fmt::format("setup: connect to the stock interface: {}", std::strerror(errno));
    }
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
  if (!started) return "setup: the stock interface did not start: " + line;
  if (!connected.empty()) return connected;
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

// A stock UCT tcp endpoint (tests/security/uct_put_probe, sending active messages as
// `probe_am` says, its output to /dev/null) that dialled this test's loopback socket
// (TheDialledListener): the probe's pid, the accepted connection, and what the probe
// sent first (its magic number and one frame, read as far as the frame's length says).
// `error` says what failed, then the rest may be unset (-1); the caller kills and reaps
// the probe and closes the connection. Runs on any thread (no test assertions), one at
// a time.
struct StockDialler {
  pid_t pid = -1;
  int fd = -1;
  std::string first;
  std::string error;
};
StockDialler DialFromStockUct(const char* probe_am) {
  StockDialler out;
  const DialledListener& listener = TheDialledListener();
  if (listener.fd < 0) {
    out.error = fmt::format("setup: listener: {}", std::strerror(errno));
    return out;
  }
  // A connection an earlier probe left queued is not this one's.
  for (pollfd queued{listener.fd, POLLIN, 0}; poll(&queued, 1, 0) == 1;) {
    const int stale = accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (stale < 0) break;
    close(stale);
  }
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const std::string probe =
      fmt::format("{}/kvagent/tests/security/uct_put_probe", srcdir ? srcdir : ".");
  const std::string port = std::to_string(ntohs(listener.at.sin_port));
  out.pid = fork();
  if (out.pid < 0) {
    out.error = fmt::format("setup: fork: {}", std::strerror(errno));
    return out;
  }
  if (out.pid == 0) {
    setenv("KVAGENT_PROBE_AM", probe_am, 1);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(probe.c_str(), probe.c_str(), port.c_str(), "0", nullptr);
    _exit(127);
  }
  pollfd wait{listener.fd, POLLIN, 0};
  out.fd = poll(&wait, 1, 20000) == 1 ? accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC) : -1;
  if (out.fd < 0) {
    out.error = "setup: the stock endpoint did not connect";
    return out;
  }
  char buffer[256];
  pollfd more{out.fd, POLLIN, 0};
  // The magic number and one frame header, then as long as its length says.
  auto want = [&] {
    if (out.first.size() < kMagic.size() + 5) return kMagic.size() + 5;
    uint32_t frame = 0;
    std::memcpy(&frame, out.first.data() + kMagic.size() + 1, 4);
    return kMagic.size() + 5 + frame;
  };
  while (out.first.size() < want() && poll(&more, 1, 20000) == 1) {
    const ssize_t n = read(out.fd, buffer, std::min(sizeof buffer, want() - out.first.size()));
    if (n <= 0) break;
    out.first.append(buffer, static_cast<size_t>(n));
  }
  if (out.first.size() != want() || out.first.substr(0, kMagic.size()) != kMagic) {
    out.error = "setup: the stock endpoint did not send its magic number and a frame";
  }
  return out;
}

// The connection request a stock UCT tcp endpoint sends first (after the magic
// number), as it sent it: tests/security/uct_put_probe connects to a socket of this
// test and its first frame is read.
std::string HonestConnectionRequest() {
  static std::string request;  // read once: every stock endpoint sends this one here
  if (!request.empty()) return request;
  // One active message: it connects first.
  const StockDialler dialler = DialFromStockUct("1:1");
  if (dialler.fd >= 0) close(dialler.fd);
  if (dialler.pid > 0) {
    kill(dialler.pid, SIGKILL);
    waitpid(dialler.pid, nullptr, 0);
  }
  INFO(dialler.error);
  REQUIRE(dialler.error.empty());
  REQUIRE(static_cast<uint8_t>(dialler.first[kMagic.size()]) == UCT_AM_ID_MAX);
  request = dialler.first.substr(kMagic.size());
  return request;
}

// What a stock UCT endpoint that dialled this test does when the test answers with
// `stream`: it keeps sending active messages (progressing its interface, so reading
// what comes back) for a second or more; the test reads its magic number and
// connection request (DialFromStockUct), answers, and looks 150 ms later. "alive"
// while it still runs (then it is killed), or how it ended. Runs on any thread (no
// test assertions) once HonestConnectionRequest has run on the test's.
std::string AnswerStockUctDialler(const std::string& stream) {
  StockDialler dialler = DialFromStockUct("0:2000000");  // sends until it is killed
  if (dialler.pid < 0) return dialler.error;
  std::string result = dialler.error;
  // Its request names the connection the check was told of (Check): event, flags and
  // connection alike (its own address is its interface's, another each time).
  const std::string told = HonestConnectionRequest();
  if (result.empty() && dialler.first.compare(kMagic.size(), 5 + 13, told, 0, 5 + 13) != 0) {
    result = "setup: the stock endpoint's request names another connection than the first's";
  }
  if (result.empty()) {
    const timeval bound{5, 0};
    setsockopt(dialler.fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof bound);
    size_t sent = 0;
    while (sent < stream.size()) {
      const ssize_t n =
          send(dialler.fd, stream.data() + sent, stream.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;  // the child went
      sent += static_cast<size_t>(n);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
  }
  int status = 0;
  const pid_t done = waitpid(dialler.pid, &status, WNOHANG);
  if (done == 0) {
    kill(dialler.pid, SIGKILL);
    waitpid(dialler.pid, nullptr, 0);
  }
  if (dialler.fd >= 0) close(dialler.fd);
  if (!result.empty()) return result;
  if (done == 0) return "alive";
  if (WIFSIGNALED(status)) return fmt::format("ended by signal {}", WTERMSIG(status));
  return fmt::format("setup: the stock endpoint exited {} before the answer was read",
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1);
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
// `library`: what SendToStockUct said, when it was sent already (another thread).
void Expect(const std::string& what, const std::string& stream, int* passed, Refusals* refusals,
            const Target& target = {}, std::optional<std::string> sent = std::nullopt) {
  const std::string check = Check(stream, target);
  const std::string library = sent ? *sent : SendToStockUct(stream, target);
  REQUIRE(library.rfind("setup", 0) != 0);
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
  // For connect-to-endpoint, UCT 1.13 asserts that it is the side to accept, which it
  // is when the request's address is below its own; from port 65535 of loopback it never
  // is, so the stock interface's verdict does not hang on which ports the kernel gave.
  std::string connect_to_endpoint = changed(4, "\x01");
  connect_to_endpoint.replace(5 + 13 + 2, 2, "\xff\xff");
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
         &passed, &refusals, Target{"16k"});
  Expect("UCX_TCP_RX_SEG_SIZE=16k: a byte more", kMagic + Frame(3, std::string(16385, 'c')),
         &passed, &refusals, Target{"16k"});
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

// What a peer answers on a connection this agent's UCX dialled reaches UCT without a
// magic number first: the acknowledgement of its request, then frames. The check of a
// dialled connection (internal::DialledStreamCheck) is held to a stock UCT endpoint
// that dialled this test, as the accepted side's is above: with no acknowledgement
// (a few kinds), and after UCT's own (4 bytes, event 2, as a stock UCT acceptor sends it:
// every kind). A connection request there is taken by UCT only as a peer's UCT sends
// one when both sides connected at once: after the acknowledgement, naming UCT's own
// connection (0: the stock endpoint is a new process) and the address it dialled.
TEST_CASE("every answer the check of a dialled connection passes leaves a stock UCT endpoint "
          "running, and every answer it refuses ends one") {
  const std::string request = HonestConnectionRequest();
  const std::string acknowledgement = Cm(2, "");
  // A request as the peer's UCT sends it here: event 1, flags 0, connection `sn`, from
  // the address UCT dialled (`port_change` added to its port).
  auto request_here = [](uint64_t sn, int port_change) {
    sockaddr_in from = TheDialledListener().at;
    from.sin_port = htons(static_cast<uint16_t>(ntohs(from.sin_port) + port_change));
    std::string rest(1, '\0');
    rest.append(reinterpret_cast<const char*>(&sn), 8);
    rest.append(reinterpret_cast<const char*>(&from), sizeof from);
    return Cm(1, rest);
  };
  int passed = 0;
  Refusals refusals;
  const Target dialled{nullptr, /*ipv6=*/false, /*dialled=*/true};
  for (const auto& [first, label] : std::vector<std::pair<std::string, std::string>>{
           {"", "dialled, first"}, {acknowledgement, "dialled, after the acknowledgement"}}) {
    std::vector<Case> cases = Cases(request, !first.empty());
    cases.push_back({"a request naming UCT's connection and the address it dialled",
                     request_here(0, 0) + Frame(1, "after it")});
    cases.push_back({"a request naming another connection (1)", request_here(1, 0)});
    cases.push_back({"a request from another port of the address UCT dialled",
                     request_here(0, 1)});
    for (const Case& c : cases) {
      Expect(fmt::format("{}: {}", label, c.what), first + c.frames, &passed, &refusals,
             dialled);
    }
  }
  // Acknowledged with a request (event 3), and a request UCT takes twice.
  Expect("dialled, after event 3: a request naming UCT's connection",
         Cm(3, "") + request_here(0, 0), &passed, &refusals, dialled);
  Expect("dialled, after the acknowledgement: the request UCT takes, twice",
         acknowledgement + request_here(0, 0) + request_here(0, 0), &passed, &refusals, dialled);
  CHECK(passed > 0);
  // A frame past the buffer, a short connection-manager frame, connection requests of
  // another length, before the acknowledgement, naming another connection or address,
  // put requests and acknowledgements of another length, unknown ids.
  CHECK(refusals.size() >= 8);
  for (const auto& [kind, ended] : refusals) {
    std::printf("refusal kind (dialled): %s: %s\n", kind.c_str(),
                ended ? "the stock library ended on it" : "never ended the stock library");
    INFO("the check of a dialled connection refuses answers for " << kind);
    CHECK(ended);
  }
}

// Runs `argv` (a program path first); its exit status, or -1 when it could not run.
int Run(const std::vector<std::string>& argv) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    std::vector<char*> args;
    for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
    args.push_back(nullptr);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execv(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Moves the calling thread into a network namespace of its own holding kIpv6Device at
// kIpv6Address (one end of a veth pair, both up, no duplicate address detection;
// loopback up). UCX
// 1.13 serves no IPv6 on loopback, and a test talks only to loopback or namespaces it
// makes. "" when done, else why it could not be (the case skips).
std::string EnterIpv6Namespace() {
  if (geteuid() != 0) return "needs root to make a network namespace (unshare CLONE_NEWNET)";
  std::string ip;
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) {
      ip = path;
      break;
    }
  }
  if (ip.empty()) return "iproute2's `ip` is not installed (apt-get install iproute2)";
  if (unshare(CLONE_NEWNET) != 0) {
    return fmt::format("unshare(CLONE_NEWNET): {}", std::strerror(errno));
  }
  const std::string peer = std::string(kIpv6Device) + "p";
  for (const std::vector<std::string>& argv :
       std::vector<std::vector<std::string>>{
           {ip, "link", "set", "lo", "up"},  // local delivery goes through it
           {ip, "link", "add", kIpv6Device, "type", "veth", "peer", "name", peer},
           {ip, "addr", "add", std::string(kIpv6Address) + "/64", "dev", kIpv6Device, "nodad"},
           {ip, "link", "set", kIpv6Device, "up"},
           {ip, "link", "set", peer, "up"}}) {
    if (const int rc = Run(argv); rc != 0) {
      std::string command;
      for (const std::string& arg : argv) command += (command.empty() ? "" : " ") + arg;
      return fmt::format("`{}` exited {}", command, rc);
    }
  }
  return "";
}

// UCT sizes a connection request by its interface's address family: on an IPv6
// interface the request holds a sockaddr_in6 (41 bytes), and the one an IPv4 interface
// takes (29) ends it. The check learns the family from the accepted socket.
TEST_CASE("on an IPv6 interface, the check passes UCT's longer connection request and "
          "refuses the IPv4 one, as the library does") {
  const std::string request = HonestConnectionRequest();  // from an IPv4 interface
  // The same request from an IPv6 interface: its event, flags and endpoint id, then a
  // sockaddr_in6 (fd77::2, the request's port).
  sockaddr_in6 from{};
  from.sin6_family = AF_INET6;
  std::memcpy(&from.sin6_port, request.data() + 5 + 13 + 2, 2);
  inet_pton(AF_INET6, "fd77::2", &from.sin6_addr);
  const std::string request6 =
      Cm(1, request.substr(5 + 4, 1 + 8) +
                std::string(reinterpret_cast<const char*>(&from), sizeof from));
  std::string family_0 = request6;
  family_0.replace(5 + 13, 2, std::string(2, '\0'));
  const std::vector<std::pair<std::string, std::string>> streams = {
      {"an active message first", kMagic + Frame(3, "an active message")},
      {"UCT's IPv6 request, an active message", kMagic + request6 + Frame(1, "abc")},
      {"UCT's IPv6 request, a put request of no payload",
       kMagic + request6 + Frame(UCT_AM_ID_MAX + 1, std::string(20, '\0'))},
      {"UCT's IPv6 request, a keepalive", kMagic + request6 + Frame(UCT_AM_ID_MAX + 3, "")},
      {"the IPv4 request (29 bytes)", kMagic + request + Frame(1, "abc")},
      {"the IPv6 request naming family 0", kMagic + family_0 + Frame(1, "abc")},
  };
  // Sent from a thread in the namespace (the test's own assertions stay on this one).
  std::string skip;
  std::vector<std::string> library;
  std::thread([&] {
    skip = EnterIpv6Namespace();
    if (!skip.empty()) return;
    for (const auto& [what, stream] : streams) {
      library.push_back(SendToStockUct(stream, Target{nullptr, /*ipv6=*/true}));
    }
  }).join();
  if (!skip.empty()) KVAGENT_SKIP("no IPv6 interface for the stock UCT: " + skip);
  REQUIRE(library.size() == streams.size());
  int passed = 0;
  Refusals refusals;
  for (size_t i = 0; i < streams.size(); ++i) {
    Expect("IPv6 interface: " + streams[i].first, streams[i].second, &passed, &refusals,
           Target{nullptr, /*ipv6=*/true}, library[i]);
  }
  CHECK(passed == 4);
  CHECK(refusals.size() == 2);
  for (const auto& [kind, ended] : refusals) {
    INFO("the check refuses streams for " << kind);
    CHECK(ended);
  }
}

}  // namespace
}  // namespace kvagent::transport
