#include "agent/request_digest.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/types/span.h"

namespace kvagent::agent {
namespace {

// Every field but timeout_ms and wait. Strings and spans hash with their lengths, and
// each segment with its kind, so no two different requests line up into one sequence.
struct Hashed {
  const v1::SubmitTransferRequest& r;

  template <typename H>
  friend H AbslHashValue(H h, const Hashed& d) {
    const v1::SubmitTransferRequest& r = d.r;
    h = H::combine(std::move(h), r.transfer_id(), r.peer(), static_cast<int>(r.op()),
                   r.notification(), r.chunk(), r.more_chunks(), r.request_id(),
                   static_cast<int>(r.complete_when()), r.segments_size());
    for (const v1::Segment& s : r.segments()) {
      h = H::combine(std::move(h), static_cast<int>(s.kind_case()));
      if (s.has_items()) {
        const v1::ItemSegment& i = s.items();
        h = H::combine(std::move(h), i.local_group(), i.remote_group(),
                       absl::MakeConstSpan(i.local_indices()),
                       absl::MakeConstSpan(i.remote_indices()));
      } else if (s.has_bytes()) {
        const v1::ByteSegment& b = s.bytes();
        h = H::combine(std::move(h), b.local_region(), b.local_offset(), b.remote_region(),
                       b.remote_offset(), b.length());
      }
    }
    return h;
  }
};

}  // namespace

uint64_t RequestDigest(const v1::SubmitTransferRequest& request) {
  return absl::Hash<Hashed>{}(Hashed{request});
}

}  // namespace kvagent::agent
