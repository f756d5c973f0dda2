#include "agent/flags.h"

#include <cstdlib>

#include "fmt/format.h"

namespace kvagent::agent {

namespace {

// One of two words: `yes` sets *on, `no` clears it.
bool ParseTwoWords(absl::string_view text, absl::string_view yes, absl::string_view no, bool* on,
                   std::string* error) {
  if (text != yes && text != no) {
    *error = "use " + std::string(yes) + " or " + std::string(no);
    return false;
  }
  *on = text == yes;
  return true;
}

}  // namespace

bool AbslParseFlag(absl::string_view text, CpuList* out, std::string* error) {
  absl::StatusOr<std::vector<int>> cpus = ParseCpuList(std::string_view(text.data(), text.size()));
  if (!cpus.ok()) {
    *error = std::string(cpus.status().message());  // Abseil names the flag and the value
    return false;
  }
  out->cpus = *std::move(cpus);
  return true;
}

std::string AbslUnparseFlag(const CpuList& value) { return FormatCpuList(value.cpus); }

bool AbslParseFlag(absl::string_view text, OnOff* out, std::string* error) {
  return ParseTwoWords(text, "on", "off", &out->on, error);
}

std::string AbslUnparseFlag(OnOff value) { return value.on ? "on" : "off"; }

bool AbslParseFlag(absl::string_view text, AutoOff* out, std::string* error) {
  return ParseTwoWords(text, "auto", "off", &out->on, error);
}

std::string AbslUnparseFlag(AutoOff value) { return value.on ? "auto" : "off"; }

bool AbslParseFlag(absl::string_view text, ErrorModeChoice* out, std::string* error) {
  if (text == "auto") {
    *out = ErrorModeChoice::kAuto;
  } else if (text == "peer") {
    *out = ErrorModeChoice::kPeer;
  } else if (text == "none") {
    *out = ErrorModeChoice::kNone;
  } else {
    *error = "use auto, peer or none";
    return false;
  }
  return true;
}

std::string AbslUnparseFlag(ErrorModeChoice value) {
  switch (value) {
    case ErrorModeChoice::kPeer: return "peer";
    case ErrorModeChoice::kNone: return "none";
    case ErrorModeChoice::kAuto: break;
  }
  return "auto";
}

bool AbslParseFlag(absl::string_view text, DeviceCopyFlag* out, std::string* error) {
  auto choice = ParseDeviceCopyChoice(std::string_view(text.data(), text.size()), kDeviceCopyFlag);
  if (!choice.ok()) {
    *error = kDeviceCopyChoices;  // Abseil names the flag and the value refused
    return false;
  }
  out->choice = *choice;
  out->given = true;
  return true;
}

std::string AbslUnparseFlag(DeviceCopyFlag value) {
  return std::string(DeviceCopyChoiceName(value.choice));
}

bool AbslParseFlag(absl::string_view text, FileMode* out, std::string* error) {
  const std::string digits(text);
  char* end = nullptr;
  const unsigned long mode = std::strtoul(digits.c_str(), &end, 8);
  if (digits.empty() || digits[0] == '-' || *end != '\0' || mode > 0777) {
    *error = "give an octal mode such as 0660 (at most 0777)";
    return false;
  }
  out->bits = static_cast<uint32_t>(mode);
  return true;
}

std::string AbslUnparseFlag(FileMode value) { return fmt::format("0{:o}", value.bits); }

bool AbslParseFlag(absl::string_view text, GivenList* out, std::string* /*error*/) {
  out->given = true;
  out->text = std::string(text);
  return true;
}

std::string AbslUnparseFlag(const GivenList& value) { return value.text; }

}  // namespace kvagent::agent
