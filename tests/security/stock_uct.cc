#include "tests/security/stock_uct.h"

#include "ucs/async/async_fwd.h"

namespace kvagent::testing {

ucs_status_t OpenStockUctTcp(const std::string& device, StockUctTcp* out, std::string* failed) {
  auto fail = [failed](const char* step, ucs_status_t status) {
    *failed = step;
    return status;
  };
  uct_component_h* components = nullptr;
  unsigned count = 0;
  ucs_status_t status = uct_query_components(&components, &count);
  if (status != UCS_OK) return fail("uct_query_components", status);
  uct_component_h tcp = nullptr;
  for (unsigned i = 0; i < count; ++i) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
    if (uct_component_query(components[i], &attr) == UCS_OK && std::string(attr.name) == "tcp") {
      tcp = components[i];
    }
  }
  uct_release_component_list(components);  // the components themselves stay
  if (tcp == nullptr) return fail("no tcp component", UCS_ERR_NO_DEVICE);
  uct_md_config_t* md_config = nullptr;
  if ((status = uct_md_config_read(tcp, nullptr, nullptr, &md_config)) != UCS_OK) {
    return fail("uct_md_config_read", status);
  }
  status = uct_md_open(tcp, "tcp", md_config, &out->md);
  uct_config_release(md_config);
  if (status != UCS_OK) return fail("uct_md_open", status);
  if ((status = ucs_async_context_create(UCS_ASYNC_MODE_THREAD_SPINLOCK, &out->async)) !=
      UCS_OK) {
    return fail("ucs_async_context_create", status);
  }
  if ((status = uct_worker_create(out->async, UCS_THREAD_MODE_SINGLE, &out->worker)) != UCS_OK) {
    return fail("uct_worker_create", status);
  }
  uct_iface_config_t* iface_config = nullptr;
  if ((status = uct_md_iface_config_read(out->md, "tcp", nullptr, nullptr, &iface_config)) !=
      UCS_OK) {
    return fail("uct_md_iface_config_read", status);
  }
  uct_iface_params_t params{};
  params.field_mask = UCT_IFACE_PARAM_FIELD_OPEN_MODE | UCT_IFACE_PARAM_FIELD_DEVICE;
  params.open_mode = UCT_IFACE_OPEN_MODE_DEVICE;
  params.mode.device.tl_name = "tcp";
  params.mode.device.dev_name = device.c_str();
  status = uct_iface_open(out->md, out->worker, &params, iface_config, &out->iface);
  uct_config_release(iface_config);
  if (status != UCS_OK) return fail("uct_iface_open", status);
  uct_iface_progress_enable(out->iface, UCT_PROGRESS_SEND | UCT_PROGRESS_RECV);
  return UCS_OK;
}

void CloseStockUctTcp(StockUctTcp* uct) {
  if (uct->iface != nullptr) uct_iface_close(uct->iface);
  if (uct->worker != nullptr) uct_worker_destroy(uct->worker);
  if (uct->async != nullptr) ucs_async_context_destroy(uct->async);
  if (uct->md != nullptr) uct_md_close(uct->md);
  *uct = StockUctTcp{};
}

}  // namespace kvagent::testing
