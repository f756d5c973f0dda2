// Who may attach: the session socket's file mode and group (--local-socket-group), as
// the kernel enforces them on a user that is not root. Needs root outside Bazel's
// sandbox (a user namespace there has no gid 65534), hence tags = ["no-sandbox"];
// skips with the reason elsewhere.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "agent/session_server.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"
#include "tests/unit/session/session_fixture.h"
#include "tests/unit/session/test_util.h"

namespace kvagent::agent {
namespace {

using testing::TempDir;
using namespace session_test;  // NOLINT: the fixture's helpers

// Empty when this process can give files to gid 65534 (nogroup), else why not.
std::string CannotUseGid65534(const TempDir& dir) {
  if (getuid() != 0) return "needs root to chown and switch users (tests run as root)";
  const std::string probe = dir / "probe";
  { std::ofstream(probe) << "x"; }
  if (chown(probe.c_str(), static_cast<uid_t>(-1), 65534) != 0) {
    return fmt::format(
        "cannot give a file to gid 65534 here ({}): a user namespace without that gid "
        "(Bazel's sandbox?); this target is tagged no-sandbox to run outside it",
        std::strerror(errno));
  }
  unlink(probe.c_str());
  return "";
}

TEST_CASE("The socket file gets its mode and group") {
  TempDir dir;
  if (std::string why = CannotUseGid65534(dir); !why.empty()) KVAGENT_SKIP(why);
  TestHandler handler;
  for (const std::string group : {"nogroup", "65534"}) {
    if (group == "nogroup" && getgrnam("nogroup") == nullptr) continue;
    SessionServerOptions options;
    options.path = dir / "g.session";
    options.group = group;
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.ok());
    struct stat st {};
    REQUIRE(lstat(options.path.c_str(), &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK((st.st_mode & 07777) == 0660);
    CHECK(st.st_gid == 65534);
    server->reset();
    CHECK(access(options.path.c_str(), F_OK) != 0);  // removed at stop
  }

  SessionServerOptions options;
  options.path = dir / "m.session";
  options.mode = 0600;
  {
    auto server = SessionServer::Start(options, &handler);
    REQUIRE(server.ok());
    struct stat st {};
    REQUIRE(lstat(options.path.c_str(), &st) == 0);
    CHECK((st.st_mode & 07777) == 0600);
    CHECK(st.st_gid == getgid());
  }

  options.group = "kvagent-no-such-group";
  auto unknown = SessionServer::Start(options, &handler);
  REQUIRE(unknown.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(unknown.status()), Catch::Contains("--local-socket-group"));
  CHECK_THAT(Message(unknown.status()), Catch::Contains("no such group"));
  CHECK(access(options.path.c_str(), F_OK) != 0);  // not left behind
}

TEST_CASE("Access to the socket follows its mode and group, for a user that is not root") {
  TempDir dir;
  if (std::string why = CannotUseGid65534(dir); !why.empty()) KVAGENT_SKIP(why);
  // Forked before any server thread starts: the children are single-threaded copies.
  ChildClient outsider(ChildClient::End::kExit, /*drop_to_nobody=*/true);
  ChildClient member(ChildClient::End::kExit, /*drop_to_nobody=*/true);
  REQUIRE(chmod(dir.path().c_str(), 0755) == 0);
  TestHandler handler;

  SessionServerOptions options;
  options.path = dir / "closed.session";  // 0660, root's group
  auto closed = SessionServer::Start(options, &handler);
  REQUIRE(closed.ok());
  const std::string refused = outsider.Attach(options.path);
  outsider.Reap();
  if (refused.rfind("error setuid", 0) == 0) {
    KVAGENT_SKIP("cannot switch to uid 65534 here: " + refused);
  }
  CHECK_THAT(refused, Catch::StartsWith(fmt::format(
                          "error {}", static_cast<int>(absl::StatusCode::kPermissionDenied))));
  CHECK_THAT(refused, Catch::Contains("not accessible to uid 65534"));
  CHECK_THAT(refused, Catch::Contains("--local-socket-group"));

  options.path = dir / "open.session";
  options.group = "65534";
  auto open = SessionServer::Start(options, &handler);
  REQUIRE(open.ok());
  const std::string welcomed = member.Attach(options.path);
  member.Reap();
  CHECK_THAT(welcomed, Catch::StartsWith("ok "));
  auto hellos = handler.hellos();
  REQUIRE(hellos.size() == 1);
  CHECK(hellos[0].credentials.uid == 65534);
  CHECK(hellos[0].credentials.gid == 65534);
}
}  // namespace
}  // namespace kvagent::agent
