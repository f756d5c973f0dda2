// `kvagentctl demo`: two agents, Llama-3.1-8B-shaped KV pools, several requests'
// pages pushed in chunks into scattered decode pages, every byte verified.
#pragma once

#include <cstdint>
#include <string>

namespace kvagent::cli {

struct DemoOptions {
  std::string argv0;
  std::string kvagentd;          // empty: FindKvagentd
  std::string prefill_address;   // both empty: start two agents here
  std::string decode_address;
  uint64_t pool_mib = 256;       // per agent
  uint32_t requests = 8;
  uint32_t pages_per_request = 16;
  uint32_t chunks = 4;
  uint32_t timeout_ms = 60000;
  bool json = false;
  uint64_t seed = 42;
  bool shm_direct = true;        // agents started here copy same-host data directly
};

// Returns the process exit code: 0 when every byte verified.
int RunDemo(const DemoOptions& options);

}  // namespace kvagent::cli
