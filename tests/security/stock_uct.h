// A stock UCT tcp interface opened through UCT's public API alone (the installed
// libuct, nothing of kvagent in front): what the security tools that speak UCT share.
#pragma once

#include <uct/api/uct.h>

#include <string>

namespace kvagent::testing {

struct StockUctTcp {
  uct_md_h md = nullptr;
  ucs_async_context_t* async = nullptr;
  uct_worker_h worker = nullptr;
  uct_iface_h iface = nullptr;
};

// Opens UCT's tcp interface on `device` (an interface name, e.g. "lo"), progress on;
// UCS_OK, or the status of the step that failed with its name in `*failed`.
ucs_status_t OpenStockUctTcp(const std::string& device, StockUctTcp* out, std::string* failed);
// Closes what OpenStockUctTcp opened (its endpoints destroyed first).
void CloseStockUctTcp(StockUctTcp* uct);

}  // namespace kvagent::testing
