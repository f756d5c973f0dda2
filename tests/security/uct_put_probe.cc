// An attacker that speaks UCT, not UCP: it connects a stock UCX tcp endpoint (UCT's
// public API) to an agent's UCX TCP port on loopback and sends one put of 16 bytes to
// ADDRESS, an address in the agent that the agent never registered or named. UCX
// 1.13's tcp transport serves a put request by copying its payload to that address.
//
//   uct_put_probe PORT ADDRESS [HOST DEVICE]
//
// With HOST (an IPv4 address) and DEVICE (an interface of this host that reaches it),
// it connects from DEVICE to HOST's PORT instead: an attacker on another host.
//
// KVAGENT_PROBE_AM=ID:COUNT sends COUNT active messages of UCT id ID instead of the put,
// KVAGENT_PROBE_AM_BYTES=N each with N bytes (a frame longer than the agent's receive
// buffer when N is past 64 KiB); a list (N,M,...) sends COUNT of each size in turn, 0
// meaning UCT's short form (an 8-byte header and "probe": 13 bytes). The bodies are of
// 'P' bytes, or of each byte of KVAGENT_PROBE_AM_FILL in turn for each size ('Q' makes
// every 8-byte id in a body odd, an id UCP looks up instead of dropping it).
// KVAGENT_PROBE_AM_HEX=HEX: each message's body is those bytes instead (sizes and fills
// ignored).
//
// Prints one line and exits 0 when the put completed from its side (the agent's UCX
// took the connection), 3 when the connection never came up or failed (refused), 2 on
// a setup failure here. Whether the bytes landed is for the caller to read.
#include <arpa/inet.h>
#include <errno.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/security/stock_uct.h"
#include "uct/api/uct.h"

namespace {

// One line for the caller, out before anything else can end the process (a sanitizer's
// report at exit would leave a buffered line unwritten).
void Say(const std::string& line) {
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

int Fail(const char* what, ucs_status_t status) {
  Say(std::string("setup\t") + what + ": " + ucs_status_string(status) + "\n");
  return 2;
}

std::string fmt_sent(unsigned sent, unsigned id, ucs_status_t last) {
  char line[160];
  std::snprintf(line, sizeof line, "%s\t%u active messages of id %u (last: %s)\n",
                sent == 0 ? "refused" : "sent", sent, id, ucs_status_string(last));
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {  // (a third, empty argument from run_as is ignored)
    Say("usage\tuct_put_probe PORT ADDRESS\n");
    return 2;
  }
  // The caller reads one line: no UCX errors in it. UCX reads its log level when the
  // library loads, so the probe runs itself again with it set.
  if (const char* level = std::getenv("UCX_LOG_LEVEL"); level == nullptr || std::string(level) != "fatal") {
    setenv("UCX_LOG_LEVEL", "fatal", 1);
    execv("/proc/self/exe", argv);
    Say(std::string("setup\texecv: ") + std::strerror(errno) + "\n");
    return 2;
  }
  const int port = std::atoi(argv[1]);
  const uint64_t address = std::strtoull(argv[2], nullptr, 0);
  const bool remote_host = argc >= 5 && argv[3][0] != '\0';
  in_addr host{};
  if (remote_host && inet_pton(AF_INET, argv[3], &host) != 1) {
    Say(std::string("usage	HOST '") + argv[3] + "' is not an IPv4 address\n");
    return 2;
  }
  const std::string device_name = remote_host ? argv[4] : "lo";
  // Over tcp from that device, and UCT's put switched on on this side (its own choice).
  setenv("UCX_NET_DEVICES", device_name.c_str(), 1);
  setenv("UCX_TCP_PUT_ENABLE", "y", 1);
  setenv("UCX_TCP_MAX_CONN_RETRIES", "2", 1);
  // KVAGENT_PROBE_AM_BYTES=N: each active message carries N bytes (bcopy), past the
  // 8 KiB segment UCT sends by default when N asks for it (a frame longer than the
  // agent's receive buffer).
  std::vector<size_t> am_sizes = {0};
  if (const char* bytes = std::getenv("KVAGENT_PROBE_AM_BYTES"); bytes != nullptr) {
    am_sizes.clear();
    size_t largest = 0;
    for (const char* at = bytes; *at != '\0';) {
      char* end = nullptr;
      am_sizes.push_back(std::strtoull(at, &end, 0));
      largest = std::max(largest, am_sizes.back());
      at = *end == ',' ? end + 1 : end + std::strlen(end);
    }
    if (largest + 64 > (8u << 10)) {
      setenv("UCX_TCP_TX_SEG_SIZE", std::to_string(largest + 64).c_str(), 1);
      setenv("UCX_TCP_RX_SEG_SIZE", std::to_string(largest + 64).c_str(), 1);
    }
  }

  kvagent::testing::StockUctTcp uct;
  std::string failed;
  if (ucs_status_t status = kvagent::testing::OpenStockUctTcp(device_name, &uct, &failed);
      status != UCS_OK) {
    return Fail(failed.c_str(), status);
  }
  ucs_status_t status = UCS_OK;
  uct_worker_h worker = uct.worker;
  uct_iface_h iface = uct.iface;
  uct_iface_attr_t attr{};
  if ((status = uct_iface_query(iface, &attr)) != UCS_OK) return Fail("uct_iface_query", status);
  if ((attr.cap.flags & UCT_IFACE_FLAG_PUT_ZCOPY) == 0 || attr.iface_addr_len < 2 ||
      attr.device_addr_len > 64 || attr.iface_addr_len > 64) {
    return Fail("tcp iface without put or with unexpected addresses", UCS_ERR_UNSUPPORTED);
  }
  // On lo both ends share a device address: the agent's is this one's. A tcp iface's
  // address is its listening port (network order).
  unsigned char device[64] = {};
  unsigned char remote[64] = {};
  uct_iface_get_device_address(iface, reinterpret_cast<uct_device_addr_t*>(device));
  if (remote_host) {
    // UCX 1.13's tcp device address of an IPv4 interface: a flags byte (0: not
    // loopback), the family, then the in_addr. HOST's takes this device's place.
    if (attr.device_addr_len != 2 + sizeof host || device[0] != 0 || device[1] != AF_INET) {
      return Fail("the tcp device address is not UCX 1.13's IPv4 layout", UCS_ERR_UNSUPPORTED);
    }
    std::memcpy(device + 2, &host, sizeof host);
  }
  uct_iface_get_address(iface, reinterpret_cast<uct_iface_addr_t*>(remote));
  const uint16_t network_port = htons(static_cast<uint16_t>(port));
  std::memcpy(remote, &network_port, sizeof network_port);
  uct_ep_params_t ep_params{};
  ep_params.field_mask =
      UCT_EP_PARAM_FIELD_IFACE | UCT_EP_PARAM_FIELD_DEV_ADDR | UCT_EP_PARAM_FIELD_IFACE_ADDR;
  ep_params.iface = iface;
  ep_params.dev_addr = reinterpret_cast<uct_device_addr_t*>(device);
  ep_params.iface_addr = reinterpret_cast<uct_iface_addr_t*>(remote);
  uct_ep_h ep = nullptr;
  if ((status = uct_ep_create(&ep_params, &ep)) != UCS_OK) return Fail("uct_ep_create", status);

  // KVAGENT_PROBE_AM=ID:COUNT: COUNT active messages of UCT id ID instead of the put
  // (what a peer's UCT may send that UCP registers no handler for).
  if (const char* am = std::getenv("KVAGENT_PROBE_AM"); am != nullptr) {
    unsigned id = 0, count = 0;
    if (std::sscanf(am, "%u:%u", &id, &count) != 2 || id >= UCT_AM_ID_MAX) {
      Say(std::string("usage\tKVAGENT_PROBE_AM='") + am + "' is not ID:COUNT with ID below 32\n");
      return 2;
    }
    unsigned sent = 0;
    std::string body;
    std::string hex_body;
    if (const char* hex = std::getenv("KVAGENT_PROBE_AM_HEX"); hex != nullptr) {
      for (size_t i = 0; hex[i] != '\0' && hex[i + 1] != '\0'; i += 2) {
        hex_body.push_back(static_cast<char>(std::stoi(std::string(hex + i, 2), nullptr, 16)));
      }
      if (am_sizes == std::vector<size_t>{0}) am_sizes = {hex_body.size()};  // not the short form
    }
    const char* fill_env = std::getenv("KVAGENT_PROBE_AM_FILL");
    const std::string fills = fill_env != nullptr && *fill_env != '\0' ? fill_env : "P";
    const unsigned total =
        count * static_cast<unsigned>(am_sizes.size()) * static_cast<unsigned>(fills.size());
    for (int spins = 0; sent < total && spins < 2000000; ++spins) {
      const unsigned kind = sent / count;  // which size and fill
      const size_t am_bytes = am_sizes[kind / fills.size()];
      body.assign(am_bytes, fills[kind % fills.size()]);
      if (!hex_body.empty()) body = hex_body;
      if (am_bytes == 0) {
        status =
            uct_ep_am_short(ep, static_cast<uint8_t>(id), 0x4b564147454e5421ull, "probe", 5);
      } else {
        const ssize_t packed = uct_ep_am_bcopy(
            ep, static_cast<uint8_t>(id),
            [](void* dest, void* arg) -> size_t {
              const auto* text = static_cast<const std::string*>(arg);
              std::memcpy(dest, text->data(), text->size());
              return text->size();
            },
            &body, 0);
        status = packed >= 0 ? UCS_OK : static_cast<ucs_status_t>(packed);
      }
      if (status == UCS_OK) {
        ++sent;
      } else if (status != UCS_ERR_NO_RESOURCE) {
        break;
      }
      uct_worker_progress(worker);
    }
    for (int i = 0; i < 2000; ++i) {  // let them go out
      uct_worker_progress(worker);
      usleep(200);
    }
    Say(fmt_sent(sent, id, status));
    return sent == total ? 0 : 3;
  }
  static char payload[16] = "WRITTEN-BY-UCT!";
  uct_iov_t iov{};
  iov.buffer = payload;
  iov.length = sizeof payload;
  iov.memh = UCT_MEM_HANDLE_NULL;
  iov.count = 1;
  // Until the connection is up (no resources meanwhile), for at most about 3 s.
  int tries = 0;
  do {
    status = uct_ep_put_zcopy(ep, &iov, 1, address, 0, nullptr);
    if (status == UCS_ERR_NO_RESOURCE) {
      uct_worker_progress(worker);
      usleep(200);
    }
  } while (status == UCS_ERR_NO_RESOURCE && ++tries < 15000);
  int code = 0;
  if (status != UCS_OK && status != UCS_INPROGRESS) {
    Say("refused\tput: " + std::string(ucs_status_string(status)) + " after " +
        std::to_string(tries) + " tries\n");
    code = 3;
  }
  // Let the put go out and be answered.
  for (int i = 0; code == 0 && i < 2000; ++i) {
    uct_worker_progress(worker);
    usleep(200);
  }
  if (code == 0) {
    char line[160];
    std::snprintf(line, sizeof line, "sent\tput of 16 bytes to %#llx: %s after %d tries\n",
                  static_cast<unsigned long long>(address), ucs_status_string(status), tries);
    Say(line);
  }
  uct_ep_destroy(ep);
  kvagent::testing::CloseStockUctTcp(&uct);
  return code;
}
