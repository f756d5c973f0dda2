// Small pieces the limits tests share around an AgentPair: agents started with extra
// flags, a limit's state in GetStatus, and the honest transfer every case ends with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/integration/agent_pair.h"

namespace kvagent::testing {

// Both agents started with `args` added.
AgentPairOptions WithArgs(std::vector<std::string> args);

// The limit `name` in GetStatus; null when the agent does not report it.
const v1::LimitState* FindLimit(const v1::AgentStatus& status, const std::string& name);

// An honest one-page WRITE, prefill page `src` to decode page `dst`, with a
// notification: completes, bytes equal.
void HonestWrite(AgentPair& pair, const std::string& id, uint64_t src, uint64_t dst);

}  // namespace kvagent::testing
