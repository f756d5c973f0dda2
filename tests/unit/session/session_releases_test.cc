// The queue of ended sessions whose regions are not released yet (agent/session_releases):
// what GetStatus and the session socket's --max-sessions check read from it while the
// releaser thread works through it in order.
#include "agent/session_releases.h"

#include <atomic>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

TEST_CASE("SessionReleases counts the queued and the running release, oldest wait first") {
  SessionReleases releases;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  CHECK(releases.sessions() == 0);
  CHECK(releases.backlog(t0).sessions == 0);
  CHECK(releases.backlog(t0).oldest_wait == absl::ZeroDuration());

  REQUIRE(releases.Add("engine:1", t0));
  REQUIRE(releases.Add("engine:2", t0 + absl::Seconds(1)));
  CHECK(releases.sessions() == 2);
  SessionReleases::Backlog b = releases.backlog(t0 + absl::Seconds(3));
  CHECK(b.sessions == 2);
  CHECK(b.oldest_wait == absl::Seconds(3));

  // Taken in order; the one being released still counts, and is the oldest.
  auto first = releases.Take();
  REQUIRE(first.has_value());
  CHECK(first->principal == "engine:1");
  CHECK(releases.sessions() == 2);
  CHECK(releases.backlog(t0 + absl::Seconds(5)).oldest_wait == absl::Seconds(5));
  releases.Done();
  CHECK(releases.sessions() == 1);
  CHECK(releases.backlog(t0 + absl::Seconds(5)).oldest_wait == absl::Seconds(4));

  auto second = releases.Take();
  REQUIRE(second.has_value());
  CHECK(second->principal == "engine:2");
  releases.Done();
  CHECK(releases.sessions() == 0);
  // A clock behind the ended time (another thread's reading) never gives a negative wait.
  REQUIRE(releases.Add("engine:3", t0 + absl::Seconds(10)));
  CHECK(releases.backlog(t0).oldest_wait == absl::ZeroDuration());
}

TEST_CASE("SessionReleases::Stop wakes a waiting Take, drops the queued, refuses new ones") {
  SessionReleases releases;
  // The releaser thread only records (Catch's assertions are for the test's thread).
  std::atomic<bool> woke{false};
  std::atomic<bool> took{true};
  std::thread releaser([&] {
    took = releases.Take().has_value();  // waits: nothing queued, then stopped
    woke = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(woke.load());
  CHECK(releases.Stop() == 0);
  releaser.join();
  CHECK(woke.load());
  CHECK_FALSE(took.load());

  SessionReleases queued;
  REQUIRE(queued.Add("a", absl::Now()));
  REQUIRE(queued.Add("b", absl::Now()));
  CHECK(queued.Stop() == 2);
  CHECK(queued.sessions() == 0);
  CHECK_FALSE(queued.Add("c", absl::Now()));
  CHECK_FALSE(queued.Take().has_value());
}

}  // namespace
}  // namespace kvagent::agent
