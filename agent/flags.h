// kvagentd's flag value types for Abseil flags (AbslParseFlag/AbslUnparseFlag), and
// KVAGENT_FLAG, which defines a flag under a dashed name (--local-socket). Used by
// agent/main.cc; each parse error says what to give instead, and Abseil prefixes it
// with the flag's name and the value refused.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "agent/gpu/device_batch.h"
#include "agent/peer_manager.h"
#include "base/cpu_list.h"

// ABSL_FLAG names a flag after its C++ identifier, so it cannot spell kvagentd's dashed
// names. KVAGENT_FLAG(Type, ident, "dashed-name", default, help) defines FLAGS_ident
// registered as --dashed-name, so the command line, --flagfile lines and
// absl::GetFlag(FLAGS_ident) all work as for ABSL_FLAG. It is ABSL_FLAG_IMPL with the
// name given apart, built from that macro's own helpers of Debian's Abseil 20220623
// (//third_party:absl_flags); a newer Abseil that renames them fails to compile here.
#define KVAGENT_FLAG(Type, ident, dashed_name, default_value, help)           \
  ABSL_FLAG_IMPL_DECLARE_DEF_VAL_WRAPPER(ident, Type, default_value)         \
  ABSL_FLAG_IMPL_DECLARE_HELP_WRAPPER(ident, help)                           \
  ABSL_CONST_INIT absl::Flag<Type> FLAGS_##ident{                            \
      dashed_name, ABSL_FLAG_IMPL_FILENAME(), ABSL_FLAG_IMPL_HELP_ARG(ident), \
      ABSL_FLAG_IMPL_DEFAULT_ARG(Type, ident)};                              \
  extern absl::flags_internal::FlagRegistrarEmpty FLAGS_no##ident;           \
  absl::flags_internal::FlagRegistrarEmpty FLAGS_no##ident =                 \
      ABSL_FLAG_IMPL_REGISTRAR(Type, FLAGS_##ident)

namespace kvagent::agent {

// on|off.
struct OnOff {
  bool on = false;
};
bool AbslParseFlag(absl::string_view text, OnOff* out, std::string* error);
std::string AbslUnparseFlag(OnOff value);

// auto|off (a feature used when it fits, or never).
struct AutoOff {
  bool on = true;
};
bool AbslParseFlag(absl::string_view text, AutoOff* out, std::string* error);
std::string AbslUnparseFlag(AutoOff value);

// auto|peer|none (--ucx-error-mode).
bool AbslParseFlag(absl::string_view text, ErrorModeChoice* out, std::string* error);
std::string AbslUnparseFlag(ErrorModeChoice value);

// A CPU list (--worker-cpus; base/cpu_list.h).
struct CpuList {
  std::vector<int> cpus;
};
bool AbslParseFlag(absl::string_view text, CpuList* out, std::string* error);
std::string AbslUnparseFlag(const CpuList& value);

// auto|batch|kernel|per-page (--device-copy); `given` because the flag, when given,
// wins over KVAGENT_DEVICE_COPY and the default does not.
struct DeviceCopyFlag {
  DeviceCopyChoice choice = DeviceCopyChoice::kAuto;
  bool given = false;
};
bool AbslParseFlag(absl::string_view text, DeviceCopyFlag* out, std::string* error);
std::string AbslUnparseFlag(DeviceCopyFlag value);

// A file mode in octal, at most 0777 (--local-socket-mode).
struct FileMode {
  uint32_t bits = 0;
};
bool AbslParseFlag(absl::string_view text, FileMode* out, std::string* error);
std::string AbslUnparseFlag(FileMode value);

// A decimal count (Abseil's own integer flags refuse "-1" without saying why); `given`
// tells a count set on the command line from the default (--copy-lanes 0 is refused,
// no --copy-lanes derives it).
template <typename T>
struct Count {
  T value = 0;
  bool given = false;
};
template <typename T>
bool AbslParseFlag(absl::string_view text, Count<T>* out, std::string* error) {
  out->given = true;
  if (absl::SimpleAtoi(text, &out->value)) return true;
  *error = "give a non-negative integer, at most " + std::to_string(std::numeric_limits<T>::max());
  return false;
}
template <typename T>
std::string AbslUnparseFlag(Count<T> value) {
  return std::to_string(value.value);
}

// A list whose meaning main.cc resolves after parsing (uids and user names, identities),
// remembering whether it was given at all: "--engine-uids none" is not the default.
struct GivenList {
  bool given = false;
  std::string text;
};
bool AbslParseFlag(absl::string_view text, GivenList* out, std::string* error);
std::string AbslUnparseFlag(const GivenList& value);

}  // namespace kvagent::agent
