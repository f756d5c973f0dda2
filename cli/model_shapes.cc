#include "cli/model_shapes.h"

#include <algorithm>

#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

uint64_t KvPages(uint64_t pool_bytes, uint32_t kv_regions) {
  return std::max<uint64_t>(1, pool_bytes / (uint64_t{kv_regions} * kLlamaPageBytes));
}

}  // namespace

absl::StatusOr<ModelShape> MakeModelShape(const ModelOptions& options) {
  ModelShape shape;
  shape.model = options.model;
  if (options.model == "llama") {
    KvPoolShape kv;
    kv.group = options.group_prefix + "kv";
    kv.layers = kLlamaLayers;
    kv.page_bytes = kLlamaPageBytes;
    kv.pages = KvPages(options.kv_pool_bytes, kv.layers * kv.tensors_per_layer);
    shape.groups.push_back(KvGroupShape(kv));
    shape.description = fmt::format(
        "Llama-3.1-8B KV: {} layers x K,V, {} KiB pages, {} pages per region", kv.layers,
        kv.page_bytes >> 10, kv.pages);
    return shape;
  }
  if (options.model != "hybrid") {
    return absl::InvalidArgumentError(fmt::format(
        "model '{}' is unknown; use --model llama or --model hybrid", options.model));
  }
  if (options.ssm_layers == 0 || options.state_slots == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "hybrid model with {} SSM layers and {} state slots; give --ssm-layers and "
        "--state-slots of at least 1",
        options.ssm_layers, options.state_slots));
  }
  // Attention layers spread evenly through the stack, as hybrids place them; region
  // names carry the model's layer number.
  const uint32_t attention = kHybridAttentionLayers;
  const uint32_t layers = attention + options.ssm_layers;
  std::vector<bool> is_attention(layers, false);
  for (uint32_t i = 0; i < attention; ++i) {
    is_attention[(uint64_t{2} * i + 1) * layers / (2 * attention)] = true;
  }
  PoolGroupShape kv, conv, ssm, aux;
  kv.group = options.group_prefix + "kv";
  kv.kind = v1::KV;
  kv.item_bytes = kLlamaPageBytes;
  kv.items = KvPages(options.kv_pool_bytes, attention * 2);
  conv.group = options.group_prefix + "conv";
  conv.kind = v1::STATE;
  conv.items = options.state_slots;
  conv.item_bytes = kMambaConvStateBytes;
  ssm.group = options.group_prefix + "ssm";
  ssm.kind = v1::STATE;
  ssm.items = options.state_slots;
  ssm.item_bytes = kMambaSsmStateBytes;
  for (uint32_t layer = 0; layer < layers; ++layer) {
    if (is_attention[layer]) {
      kv.region_suffixes.push_back(fmt::format("L{}.K", layer));
      kv.region_suffixes.push_back(fmt::format("L{}.V", layer));
    } else {
      conv.region_suffixes.push_back(fmt::format("L{}.conv", layer));
      ssm.region_suffixes.push_back(fmt::format("L{}.ssm", layer));
    }
  }
  // AUX: one record per request slot; 64 KiB unless the slots need more.
  aux.group = options.group_prefix + "aux";
  aux.kind = v1::AUX;
  aux.region_suffixes = {"aux"};
  aux.items = 1;
  aux.item_bytes = std::max<uint64_t>(kAuxRegionBytes, uint64_t{options.state_slots} * kAuxRecordBytes);

  shape.groups = {kv, conv, ssm, aux};
  shape.kv_group = 0;
  shape.state_groups = {1, 2};
  shape.aux_group = 3;
  shape.state_slots = options.state_slots;
  shape.description = fmt::format(
      "hybrid (Nemotron-H/Jamba style): {} attention layers x K,V, {} KiB pages, {} pages "
      "per region; {} Mamba2-2.7B SSM layers x {} slots (conv {:.1f} KiB + ssm {:.1f} MiB "
      "per slot per layer); aux {} KiB",
      attention, kLlamaPageBytes >> 10, kv.items, options.ssm_layers, options.state_slots,
      kMambaConvStateBytes / 1024.0, kMambaSsmStateBytes / 1048576.0, aux.item_bytes >> 10);
  return shape;
}

}  // namespace kvagent::cli
