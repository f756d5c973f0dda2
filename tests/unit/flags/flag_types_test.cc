// kvagentd's flag value types (agent/flags.h): what each accepts, the reason it gives
// for what it refuses, and that unparsing gives back a value it accepts.
#include "agent/flags.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/flags/marshalling.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

template <typename T>
std::string Refusal(const std::string& text) {
  T value{};
  std::string error;
  CHECK_FALSE(absl::ParseFlag(text, &value, &error));
  return error;
}

template <typename T>
T Parsed(const std::string& text) {
  T value{};
  std::string error;
  CHECK(absl::ParseFlag(text, &value, &error));
  CHECK(error.empty());
  // Unparsing gives the same value back.
  T again{};
  CHECK(absl::ParseFlag(absl::UnparseFlag(value), &again, &error));
  CHECK(absl::UnparseFlag(again) == absl::UnparseFlag(value));
  return value;
}

TEST_CASE("on|off and auto|off flags take only their two words", "[flags]") {
  CHECK(Parsed<OnOff>("on").on);
  CHECK_FALSE(Parsed<OnOff>("off").on);
  CHECK(Refusal<OnOff>("true") == "use on or off");
  CHECK(Refusal<OnOff>("") == "use on or off");
  CHECK(Parsed<AutoOff>("auto").on);
  CHECK_FALSE(Parsed<AutoOff>("off").on);
  CHECK(Refusal<AutoOff>("on") == "use auto or off");
}

TEST_CASE("--ucx-error-mode takes auto, peer or none", "[flags]") {
  CHECK(Parsed<ErrorModeChoice>("auto") == ErrorModeChoice::kAuto);
  CHECK(Parsed<ErrorModeChoice>("peer") == ErrorModeChoice::kPeer);
  CHECK(Parsed<ErrorModeChoice>("none") == ErrorModeChoice::kNone);
  CHECK(Refusal<ErrorModeChoice>("PEER") == "use auto, peer or none");
}

TEST_CASE("--device-copy takes auto, batch, kernel or per-page, and remembers it was given",
          "[flags]") {
  CHECK_FALSE(DeviceCopyFlag{}.given);  // the default: KVAGENT_DEVICE_COPY decides
  CHECK(Parsed<DeviceCopyFlag>("auto").choice == DeviceCopyChoice::kAuto);
  CHECK(Parsed<DeviceCopyFlag>("auto").given);
  CHECK(Parsed<DeviceCopyFlag>("batch").choice == DeviceCopyChoice::kBatchApi);
  CHECK(Parsed<DeviceCopyFlag>("kernel").choice == DeviceCopyChoice::kKernel);
  CHECK(Parsed<DeviceCopyFlag>("per-page").choice == DeviceCopyChoice::kPerPage);
  CHECK(absl::UnparseFlag(DeviceCopyFlag{DeviceCopyChoice::kPerPage, true}) == "per-page");
  for (const char* bad : {"", "Kernel", "per_page", "cuMemcpyBatchAsync"}) {
    INFO(bad);
    CHECK(Refusal<DeviceCopyFlag>(bad) == kDeviceCopyChoices);
  }
}

TEST_CASE("file modes are octal, at most 0777", "[flags]") {
  CHECK(Parsed<FileMode>("0660").bits == 0660);
  CHECK(Parsed<FileMode>("600").bits == 0600);
  CHECK(Parsed<FileMode>("0").bits == 0);
  CHECK(absl::UnparseFlag(FileMode{0660}) == "0660");
  for (const char* bad : {"", "0999", "01777", "-1", "rw-rw----", "0660 "}) {
    INFO(bad);
    CHECK(Refusal<FileMode>(bad).find("octal mode such as 0660") != std::string::npos);
  }
}

TEST_CASE("counts are non-negative decimal integers within their type", "[flags]") {
  CHECK(Parsed<Count<uint32_t>>("0").value == 0);
  CHECK(Parsed<Count<uint32_t>>("0").given);  // set, unlike the default
  CHECK_FALSE(Count<uint32_t>{}.given);
  CHECK(Parsed<Count<uint32_t>>("4294967295").value == 4294967295u);
  CHECK(Parsed<Count<uint64_t>>("18446744073709551615").value == UINT64_MAX);
  CHECK(Refusal<Count<uint32_t>>("4294967296") ==
        "give a non-negative integer, at most 4294967295");
  for (const char* bad : {"", "-1", "1.5", "12ms", "lots"}) {
    INFO(bad);
    CHECK(!Refusal<Count<uint32_t>>(bad).empty());
  }
}

TEST_CASE("a list flag remembers that it was given, even empty or none", "[flags]") {
  CHECK_FALSE(GivenList{}.given);
  const GivenList none = Parsed<GivenList>("none");
  CHECK(none.given);
  CHECK(none.text == "none");
  CHECK(Parsed<GivenList>("").given);
  CHECK(Parsed<GivenList>("1000,alice").text == "1000,alice");
}

TEST_CASE("--worker-cpus takes a CPU list as the kernel writes one", "[flags]") {
  using Cpus = std::vector<int>;
  CHECK(Parsed<CpuList>("").cpus.empty());
  CHECK(Parsed<CpuList>("3").cpus == Cpus{3});
  CHECK(Parsed<CpuList>("0,2").cpus == Cpus{0, 2});
  CHECK(Parsed<CpuList>("4-7,12").cpus == Cpus{4, 5, 6, 7, 12});
  // Sorted, each CPU once, written back as ranges.
  CHECK(Parsed<CpuList>("5,1-3,2").cpus == Cpus{1, 2, 3, 5});
  CHECK(absl::UnparseFlag(Parsed<CpuList>("5,1-3,2,4")) == "1-5");
  CHECK(absl::UnparseFlag(Parsed<CpuList>("0,2-3,7")) == "0,2-3,7");
  CHECK(Parsed<CpuList>("1023").cpus == Cpus{1023});
  // Each refusal names the item and says what to give, with the CPUs this process has.
  const std::string here = FormatCpuList(AllowedCpus());
  REQUIRE(!here.empty());
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"x", "'x' is not a CPU number or range"},
           {"1,", "'' is not a CPU number or range"},
           {"-1", "'-1' is not a CPU number or range"},
           {"1-", "'1-' is not a CPU number or range"},
           {"1-2-3", "'1-2-3' is not a CPU number or range"},
           {" 1", "' 1' is not a CPU number or range"},
           {"3-1", "the range '3-1' runs backwards"},
           {"1024", "CPU 1024 is past the last one a CPU set can name (1023)"},
           {"0-99999", "CPU 99999 is past the last one"},
           {"123456", "'123456' is not a CPU number or range"},
       }) {
    INFO(text);
    const std::string error = Refusal<CpuList>(text);
    CHECK(error.find(why) != std::string::npos);
    CHECK(error.find("e.g. 3, 2,3 or 4-7 (this process may use " + here + ")") !=
          std::string::npos);
  }
}

TEST_CASE("--worker-cpus names only CPUs this process may use", "[flags]") {
  const std::vector<int> allowed = AllowedCpus();
  REQUIRE(!allowed.empty());
  CHECK(CheckCpusAllowed(allowed, "--worker-cpus").ok());
  CHECK(CheckCpusAllowed({allowed.back()}, "--worker-cpus").ok());
  CHECK(CheckCpusAllowed({}, "--worker-cpus").ok());
  const int outside = allowed.back() + 1;  // past the last allowed: not allowed
  const absl::Status refused = CheckCpusAllowed({allowed.front(), outside}, "--worker-cpus");
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  const std::string message(refused.message());
  INFO(message);
  CHECK(message.find(fmt::format("CPU {} is not among those this process may use ({}", outside,
                                 FormatCpuList(allowed))) != std::string::npos);
  CHECK(message.find("leave --worker-cpus out") != std::string::npos);
}

}  // namespace
}  // namespace kvagent::agent
