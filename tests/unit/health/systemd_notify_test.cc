// SystemdNotifier against a real datagram socket standing in for systemd's: what is
// sent, when, and what is refused with which reason.
#include "agent/systemd_notify.h"

#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/unit/catch_main.h"
#include "tests/unit/health/notify_listener.h"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;
using testing::NotifyListener;

// In /tmp: $TEST_TMPDIR under Bazel is longer than a socket address holds.
std::string SocketPath(const char* name) {
  return testing::UniqueSocketName(fmt::format("/tmp/kvagent-notify-{}", name));
}

TEST_CASE("SystemdNotifier sends each state as one datagram, to a path or an abstract name") {
  const std::string name = GENERATE(std::string("path"), std::string("abstract"));
  NotifyListener systemd(name == "path" ? SocketPath("notify")
                                        : testing::UniqueSocketName("@kvagent-notify-test"));
  auto notifier = SystemdNotifier::Open(systemd.name(), absl::ZeroDuration());
  INFO(notifier.status().ToString());
  REQUIRE(notifier.ok());
  REQUIRE((*notifier)->Notify("READY=1\n").ok());
  REQUIRE((*notifier)->Notify("STOPPING=1\nSTATUS=shutting down\n").ok());
  auto got = systemd.Receive(500);
  REQUIRE(got.size() == 2);
  CHECK(got[0].text == "READY=1\n");
  CHECK(got[1].text == "STOPPING=1\nSTATUS=shutting down\n");
}

TEST_CASE("SystemdNotifier::Health: STATUS when it changes, WATCHDOG=1 only when live and asked for") {
  NotifyListener systemd(SocketPath("health"));
  SECTION("with a watchdog") {
    auto notifier = SystemdNotifier::Open(systemd.name(), absl::Seconds(30));
    REQUIRE(notifier.ok());
    CHECK((*notifier)->watchdog() == absl::Seconds(30));
    (*notifier)->Health(true, "SERVING");
    (*notifier)->Health(true, "SERVING");
    (*notifier)->Health(false, "NOT_SERVING: ucx: stalled\nsecond line");
    (*notifier)->Health(false, "NOT_SERVING: ucx: stalled\nsecond line");
    (*notifier)->Health(true, "SERVING");
    auto got = systemd.Receive(500);
    REQUIRE(got.size() == 4);
    CHECK(got[0].text == "STATUS=SERVING\nWATCHDOG=1\n");
    CHECK(got[1].text == "WATCHDOG=1\n");
    // Not live: the new status once, one line, and no ping.
    CHECK(got[2].text == "STATUS=NOT_SERVING: ucx: stalled second line\n");
    CHECK(got[3].text == "STATUS=SERVING\nWATCHDOG=1\n");
  }
  SECTION("without one: STATUS lines only") {
    auto notifier = SystemdNotifier::Open(systemd.name(), absl::ZeroDuration());
    REQUIRE(notifier.ok());
    (*notifier)->Health(true, "SERVING");
    (*notifier)->Health(true, "SERVING");
    auto got = systemd.Receive(300);
    REQUIRE(got.size() == 1);
    CHECK(got[0].text == "STATUS=SERVING\n");
  }
}

TEST_CASE("SystemdNotifier refuses an address it cannot use, and a lost socket fails the send") {
  auto relative = SystemdNotifier::Open("run/notify", absl::ZeroDuration());
  REQUIRE_FALSE(relative.ok());
  CHECK(relative.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(relative.status().message()),
             Contains("NOTIFY_SOCKET='run/notify'") && Contains("absolute path nor @name"));
  auto long_name = SystemdNotifier::Open("/" + std::string(200, 'x'), absl::ZeroDuration());
  REQUIRE_FALSE(long_name.ok());
  CHECK_THAT(std::string(long_name.status().message()),
             Contains("NOTIFY_SOCKET: ") && Contains("is 201 bytes, over the limit of 107"));
  auto long_abstract = SystemdNotifier::Open("@" + std::string(200, 'x'), absl::ZeroDuration());
  REQUIRE_FALSE(long_abstract.ok());
  CHECK_THAT(std::string(long_abstract.status().message()),
             Contains("is 201 bytes, over the 108 an abstract socket name holds"));

  const std::string path = SocketPath("gone");
  std::unique_ptr<SystemdNotifier> notifier;
  {
    NotifyListener systemd(path);
    auto opened = SystemdNotifier::Open(path, absl::ZeroDuration());
    REQUIRE(opened.ok());
    notifier = *std::move(opened);
    CHECK(notifier->Notify("READY=1\n").ok());
  }  // systemd's socket is gone
  absl::Status lost = notifier->Notify("WATCHDOG=1\n");
  CHECK(lost.code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(lost.message()), Contains("notifying systemd at " + path));
  // Sent to the address each time: a socket made again at the path gets the next one.
  NotifyListener again(path);
  CHECK(notifier->Notify("WATCHDOG=1\n").ok());
  auto got = again.Receive(300);
  REQUIRE(got.size() == 1);
  CHECK(got[0].text == "WATCHDOG=1\n");
}

// The environment as systemd sets it (sd_watchdog_enabled's rules), restored after.
class Environment {
 public:
  Environment() {
    for (const char* name : kNames) {
      const char* value = std::getenv(name);
      saved_.push_back(value != nullptr ? std::optional<std::string>(value) : std::nullopt);
      unsetenv(name);
    }
  }
  ~Environment() {
    for (size_t i = 0; i < saved_.size(); ++i) {
      if (saved_[i]) {
        setenv(kNames[i], saved_[i]->c_str(), 1);
      } else {
        unsetenv(kNames[i]);
      }
    }
  }
  static void Set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }

 private:
  static constexpr const char* kNames[] = {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"};
  std::vector<std::optional<std::string>> saved_;
};

TEST_CASE("the watchdog period comes from WATCHDOG_USEC, for this process only") {
  Environment env;
  std::string error;
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::ZeroDuration());
  CHECK(error.empty());
  Environment::Set("WATCHDOG_USEC", "2500000");
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::Milliseconds(2500));
  Environment::Set("WATCHDOG_PID", std::to_string(getpid()));
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::Milliseconds(2500));
  Environment::Set("WATCHDOG_PID", std::to_string(getpid() + 1));  // another process's
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::ZeroDuration());
  CHECK(error.empty());
  Environment::Set("WATCHDOG_PID", "init");
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::ZeroDuration());
  CHECK_THAT(error, Contains("WATCHDOG_PID='init' is not a process id"));
  error.clear();
  unsetenv("WATCHDOG_PID");
  Environment::Set("WATCHDOG_USEC", "30s");
  CHECK(SystemdNotifier::WatchdogFromEnvironment(&error) == absl::ZeroDuration());
  CHECK_THAT(error, Contains("WATCHDOG_USEC='30s' is not a positive number of microseconds"));
}

TEST_CASE("FromEnvironment: nothing without NOTIFY_SOCKET, and the variables are unset after") {
  Environment env;
  CHECK(SystemdNotifier::FromEnvironment() == nullptr);
  NotifyListener systemd(SocketPath("env"));
  Environment::Set("NOTIFY_SOCKET", systemd.name());
  Environment::Set("WATCHDOG_USEC", "3000000");
  auto notifier = SystemdNotifier::FromEnvironment();
  REQUIRE(notifier != nullptr);
  CHECK(notifier->socket() == systemd.name());
  CHECK(notifier->watchdog() == absl::Seconds(3));
  CHECK(std::getenv("NOTIFY_SOCKET") == nullptr);
  CHECK(std::getenv("WATCHDOG_USEC") == nullptr);
  Environment::Set("NOTIFY_SOCKET", "relative/path");
  CHECK(SystemdNotifier::FromEnvironment() == nullptr);  // logged, not fatal
  CHECK(std::getenv("NOTIFY_SOCKET") == nullptr);
}

}  // namespace
}  // namespace kvagent::agent
