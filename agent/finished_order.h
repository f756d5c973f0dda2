// FinishedOrder: the ids of the outgoing transfers that ended, oldest first, so that
// the engine keeps the last N of them for queries and lets older ones go. An old
// record that cannot go yet (a batch of it still posted, a watcher attached) is tried
// again on a later pass instead of being forgotten: forgotten, it stayed in the
// engine's table for good (each such transfer a record the bound did not count).
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <utility>

namespace kvagent::agent {

class FinishedOrder {
 public:
  void Add(std::string id) { order_.push_back(std::move(id)); }
  size_t size() const { return order_.size(); }

  // While more than `keep` ids are held, offers the oldest to `try_erase(id)`: true
  // when its record went (or was gone already), false when it must stay for now; such
  // an id goes to the back, to be offered again once the ones after it were. The
  // records that must stay count against `keep`, so the table holds at most
  // max(keep, those + 1). Each call offers at most as many ids as there are over
  // `keep`, so records that must stay cost each pass their number, not a loop.
  template <typename TryErase>
  void Prune(size_t keep, TryErase try_erase) {
    for (size_t over = order_.size() > keep ? order_.size() - keep : 0; over > 0; --over) {
      std::string id = std::move(order_.front());
      order_.pop_front();
      if (!try_erase(id)) order_.push_back(std::move(id));
    }
  }

 private:
  std::deque<std::string> order_;
};

}  // namespace kvagent::agent
