// `kvagentctl demo`: two agents, model-shaped pools (Llama-3.1-8B KV, or a hybrid
// with attention KV pages plus Mamba state slots and aux records) in shared memory
// or, playing the engine, in GPU memory exported by CUDA IPC; several requests
// pushed in chunks into scattered decode pages and slots, every byte verified.
#pragma once

#include <cstdint>
#include <string>

namespace kvagent::cli {

struct DemoOptions {
  std::string argv0;
  std::string kvagentd;          // empty: FindKvagentd
  std::string prefill_address;   // both empty: start two agents here
  std::string decode_address;
  std::string model = "llama";   // "llama" or "hybrid" (model_shapes.h)
  uint64_t pool_mib = 256;       // per agent, KV pages; hybrid state and aux on top
  uint32_t ssm_layers = 8;       // hybrid: Mamba2-2.7B-shaped layers (the real model: 64)
  uint32_t state_slots = 8;      // hybrid: state slots per SSM layer, one per request
  uint32_t requests = 8;
  uint32_t pages_per_request = 16;
  uint32_t chunks = 4;
  uint32_t timeout_ms = 60000;
  bool json = false;
  uint64_t seed = 42;
  bool shm_direct = true;        // agents started here copy same-host data directly
  // "dram": shared memory from the agents. "vram": this process allocates each pool
  // on CUDA device `device` and registers it by IPC handle, as an engine would; the
  // hybrid model's AUX region lives in that one allocation too.
  std::string memory = "dram";
  int device = 0;
  // How the prefill side submits: "fast" (the local fast path's rings), "grpc", or
  // "auto": fast on a local door, gRPC on a network one.
  std::string submit = "auto";
};

// Returns the process exit code: 0 when every byte verified.
int RunDemo(const DemoOptions& options);

}  // namespace kvagent::cli
