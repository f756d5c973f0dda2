// A client action as another local user, for the security tests that need root
// (unprivileged_test, device_descriptors_test): a directory under /tmp that uid 65534
// can traverse, and tests/security/security_probe run there under setpriv.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/daemon_process.h"

namespace kvagent::testing {

// What security_probe printed: the status code's name and the message (or detail).
struct Outcome {
  std::string code;
  std::string message;
};

// A directory under /tmp (mode 0755) that uid 65534 can traverse: the sockets and the
// probe live there ($TEST_TMPDIR sits under root's home, which it cannot). Removed
// with everything in it.
class OpenDir {
 public:
  OpenDir();
  ~OpenDir();
  OpenDir(const OpenDir&) = delete;
  OpenDir& operator=(const OpenDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Copies security_probe from the runfiles into `dir` (executable by everyone) and
// returns its path there.
std::string CopyProbe(const OpenDir& dir);

// The same for another tool of tests/security (`name`, e.g. "uct_put_probe").
std::string CopyTool(const OpenDir& dir, const std::string& name);

// The agent "victim" (root) with its sockets in `dir`, where uid 65534 can reach them.
std::unique_ptr<cli::DaemonProcess> StartVictim(const OpenDir& dir,
                                                std::vector<std::string> extra_args);

// Runs `probe ADDRESS COMMAND ARG` as `uid`:`gid` with no supplementary groups.
Outcome RunAs(uid_t uid, gid_t gid, const std::string& probe, const std::string& address,
              const std::string& command, const std::string& arg = "");

}  // namespace kvagent::testing
