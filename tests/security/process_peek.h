// What a test reads of another process from /proc (as root): the TCP ports it listens
// on, where its main stack ends, and bytes of its memory. For the tests that aim UCT's
// put at an agent (tests/security/uct_put_probe) and check whether it landed.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvagent::testing {

// The TCP ports process `pid` listens on, in its own network namespace
// (/proc/PID/net/tcp matched to its sockets' inodes in /proc/PID/fd).
std::vector<int> ListeningTcpPorts(pid_t pid);

// The lowest address of process `pid`'s main stack: the deepest the stack ever grew,
// which an agent's main thread (waiting in sigwait) no longer uses. 0 when not found.
uint64_t StackBottom(pid_t pid);

// `bytes` bytes of process `pid`'s memory at `address` (/proc/PID/mem); fails the
// test when they cannot be read.
std::string PeekMemory(pid_t pid, uint64_t address, size_t bytes);

}  // namespace kvagent::testing
