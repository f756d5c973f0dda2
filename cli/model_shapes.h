// Model-shaped pool layouts for `kvagentctl demo` (and the benchmark): Llama-3.1-8B
// KV pages, and a hybrid model in the style of Nemotron-H / Jamba: a few attention
// layers with Llama-shaped KV pages plus Mamba2-2.7B-shaped SSM layers whose conv and
// SSM state live in per-request slots, and a small AUX region of per-request records.
// Figures from shared/WORKLOADS.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/kv_pool.h"

namespace kvagent::cli {

// 16 tokens x 8 KV heads x 128 x bf16, one layer, K or V.
inline constexpr uint64_t kLlamaPageBytes = 16 * 8 * 128 * 2;
inline constexpr uint32_t kLlamaLayers = 32;
inline constexpr uint32_t kHybridAttentionLayers = 4;
// Mamba2-2.7B per slot per layer: conv state (d_inner 5120 + 2 x d_state 128) x
// (d_conv 4 - 1) bf16; SSM state 80 heads x headdim 64 x d_state 128 fp32.
inline constexpr uint64_t kMambaConvStateBytes = (5120 + 2 * 128) * 3 * 2;
inline constexpr uint64_t kMambaSsmStateBytes = uint64_t{80} * 64 * 128 * 4;
// One per-request metadata record (first token id, prompt length, ...) in AUX.
inline constexpr uint64_t kAuxRecordBytes = 64;
inline constexpr uint64_t kAuxRegionBytes = 64 << 10;

struct ModelOptions {
  std::string model = "llama";  // "llama" or "hybrid"
  std::string group_prefix;     // prepended to every group name
  uint64_t kv_pool_bytes = 256ull << 20;  // KV pages; hybrid state and aux come on top
  uint32_t ssm_layers = 8;      // hybrid only
  uint32_t state_slots = 8;     // hybrid only: one per request slot
};

struct ModelShape {
  std::string model;
  std::string description;  // one line for people
  std::vector<PoolGroupShape> groups;
  size_t kv_group = 0;                // index into groups
  std::vector<size_t> state_groups;   // conv, ssm (hybrid)
  std::optional<size_t> aux_group;    // hybrid; one region of kAuxRecordBytes records
  uint32_t state_slots = 0;
  uint64_t pages() const { return groups[kv_group].items; }
};

// INVALID_ARGUMENT for an unknown model or a zero count, naming the flag to fix.
absl::StatusOr<ModelShape> MakeModelShape(const ModelOptions& options);

}  // namespace kvagent::cli
