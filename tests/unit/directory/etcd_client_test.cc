// EtcdClient against a fake etcd on loopback that answers what a broken or hostile
// server might: every answer ends in a clear error (or a parsed message), never a
// crash, a hang past the timeout, or memory past the bounds. The real etcd is in
// tests/integration/directory_test.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "agent/etcd_client.h"
#include "catch2/catch.hpp"
#include "cli/local_agents.h"
#include "proto/directory.pb.h"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;

// Accepts one connection, reads the request, writes `answer`, closes.
struct FakeServer {
  int fd = -1;
  uint16_t port = 0;
  std::thread thread;

  explicit FakeServer(std::string answer, bool hold_open = false) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
    socklen_t len = sizeof(a);
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    listen(fd, 4);
    thread = std::thread([this, answer = std::move(answer), hold_open] {
      int c = accept(fd, nullptr, nullptr);
      if (c < 0) return;
      char buf[4096];
      (void)read(c, buf, sizeof(buf));
      (void)write(c, answer.data(), answer.size());
      if (hold_open) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      close(c);
    });
  }
  ~FakeServer() {
    shutdown(fd, SHUT_RDWR);
    close(fd);
    thread.join();
  }
  EtcdClient Client(int timeout_ms = 1000) const {
    return EtcdClient({{"127.0.0.1", port, "127.0.0.1:" + std::to_string(port)}},
                      absl::Milliseconds(timeout_ms));
  }
};

absl::Status Range(const FakeServer& server, directory::EtcdRangeResponse* out,
                   int timeout_ms = 1000) {
  directory::EtcdRangeRequest request;
  request.set_key("/kvagent/agents/");
  return server.Client(timeout_ms).Call("/v3/kv/range", request, out);
}

std::string Http(const std::string& status, const std::string& headers, const std::string& body) {
  return "HTTP/1.1 " + status + "\r\n" + headers + "\r\n" + body;
}

TEST_CASE("etcd client: a good answer parses, base64 keys and string integers included") {
  const std::string body =
      R"({"header":{"revision":"7"},"kvs":[{"key":"L2t2YWdlbnQvYWdlbnRzL2E=","value":"e30=","mod_revision":"5"}],"count":"1"})";
  FakeServer server(Http("200 OK", "Content-Length: " + std::to_string(body.size()) + "\r\n", body));
  directory::EtcdRangeResponse answer;
  REQUIRE(Range(server, &answer).ok());
  CHECK(answer.header().revision() == 7);
  REQUIRE(answer.kvs_size() == 1);
  CHECK(answer.kvs(0).key() == "/kvagent/agents/a");
  CHECK(answer.kvs(0).value() == "{}");
}

TEST_CASE("etcd client: broken and hostile answers end in clear errors") {
  directory::EtcdRangeResponse answer;
  SECTION("not HTTP") {
    FakeServer server("SSH-2.0-OpenSSH\r\n\r\n");
    auto status = Range(server, &answer);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()), Contains("not an HTTP answer"));
  }
  SECTION("an error from the gateway keeps its code and message") {
    const std::string body = R"({"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"})";
    FakeServer server(Http("503 Service Unavailable",
                           "Content-Length: " + std::to_string(body.size()) + "\r\n", body));
    auto status = Range(server, &answer);
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(status.message()), Contains("HTTP 503") && Contains("no leader"));
  }
  SECTION("a chunk announcing more than the bound") {
    FakeServer server(Http("200 OK", "Transfer-Encoding: chunked\r\n", "FFFFFFFF\r\nabc"));
    auto status = Range(server, &answer);
    CHECK(status.code() == absl::StatusCode::kResourceExhausted);
  }
  SECTION("a chunk size that is not hex") {
    FakeServer server(Http("200 OK", "Transfer-Encoding: chunked\r\n", "zz\r\nabc"));
    CHECK(Range(server, &answer).code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("endless headers") {
    FakeServer server("HTTP/1.1 200 OK\r\n" + std::string(70000, 'x'));
    auto status = Range(server, &answer);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()), Contains("64 KiB"));
  }
  SECTION("JSON that is not etcd's") {
    const std::string body = R"({"header":{"revision":"not a number"}})";
    FakeServer server(Http("200 OK", "Content-Length: " + std::to_string(body.size()) + "\r\n", body));
    auto status = Range(server, &answer);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(status.message()), Contains("not the JSON expected"));
  }
  SECTION("a body shorter than announced, then silence: the timeout ends it") {
    FakeServer server(Http("200 OK", "Content-Length: 100\r\n", "{}"), /*hold_open=*/true);
    const auto start = std::chrono::steady_clock::now();
    auto status = Range(server, &answer, 300);
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK_FALSE(status.ok());
    CHECK(took < std::chrono::milliseconds(1400));
  }
}

TEST_CASE("etcd client: no endpoint answers, each one named") {
  // A port from a socket bound and closed: nothing listens there.
  auto port = cli::FreePort();
  REQUIRE(port.ok());
  const std::string endpoint = "127.0.0.1:" + std::to_string(*port);
  EtcdClient client({{"127.0.0.1", static_cast<uint16_t>(*port), endpoint}},
                    absl::Milliseconds(300));
  directory::EtcdRangeRequest request;
  directory::EtcdRangeResponse answer;
  auto status = client.Call("/v3/kv/range", request, &answer);
  CHECK(status.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(status.message()), Contains("no etcd endpoint answered") && Contains(endpoint));
}

TEST_CASE("etcd client over TLS: a stalled handshake, a plain server, a TLS server spoken to in plain") {
  auto tls = MakeEtcdTlsContext({});
  REQUIRE(tls.ok());
  auto tls_client = [&](const FakeServer& server) {
    return EtcdClient({{"127.0.0.1", server.port, "127.0.0.1:" + std::to_string(server.port), true}},
                      absl::Milliseconds(300), *tls);
  };
  directory::EtcdRangeRequest request;
  directory::EtcdRangeResponse answer;
  {
    FakeServer silent("", /*hold_open=*/true);
    absl::Status status = tls_client(silent).Call("/v3/kv/range", request, &answer);
    CHECK(absl::IsUnavailable(status));
    CHECK_THAT(std::string(status.message()),
               Contains("TLS handshake failed (no handshake within 300 ms)"));
  }
  {
    FakeServer closing("");  // reads the ClientHello, answers nothing, closes
    absl::Status status = tls_client(closing).Call("/v3/kv/range", request, &answer);
    CHECK(absl::IsUnavailable(status));
    CHECK_THAT(std::string(status.message()),
               Contains("TLS handshake failed (etcd closed the connection during the handshake)"));
  }
  {
    FakeServer plain("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    absl::Status status = tls_client(plain).Call("/v3/kv/range", request, &answer);
    CHECK(absl::IsUnavailable(status));
    CHECK_THAT(std::string(status.message()),
               Contains("TLS handshake failed") && Contains("plain HTTP needs etcd://"));
  }
  {
    FakeServer https("HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n");
    absl::Status status = Range(https, &answer);
    CHECK_THAT(std::string(status.message()), Contains("this etcd serves TLS: use etcds://"));
  }
}

TEST_CASE("etcd client: --directory URLs") {
  auto two = ParseEtcdUrl("etcd://127.0.0.1:2379,[::1]:2380/");
  REQUIRE(two.ok());
  REQUIRE(two->size() == 2);
  CHECK((*two)[0].host == "127.0.0.1");
  CHECK((*two)[0].port == 2379);
  CHECK((*two)[1].host == "::1");
  CHECK((*two)[1].port == 2380);
  CHECK_FALSE((*two)[0].tls);
  auto tls = ParseEtcdUrl("etcds://etcd.example:2379,10.0.0.2:2379");
  REQUIRE(tls.ok());
  REQUIRE(tls->size() == 2);
  CHECK((*tls)[0].host == "etcd.example");
  CHECK(((*tls)[0].tls && (*tls)[1].tls));
  for (const char* bad : {"http://127.0.0.1:2379", "etcd://", "etcd://host", "etcd://host:0",
                          "etcd://host:70000", "etcd://:2379", "etcds://", "https://host:2379",
                          "etcds:/host:2379"}) {
    auto parsed = ParseEtcdUrl(bad);
    CAPTURE(bad);
    REQUIRE_FALSE(parsed.ok());
    CHECK_THAT(std::string(parsed.status().message()), Contains("--directory") && Contains("etcd://HOST:PORT"));
  }
}

}  // namespace
}  // namespace kvagent::agent
