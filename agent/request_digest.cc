#include "agent/request_digest.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvagent::agent {
namespace {

absl::string_view View(const std::string& s) { return absl::string_view(s.data(), s.size()); }

template <typename T>
absl::Span<const T> Values(const google::protobuf::RepeatedField<T>& field) {
  return absl::MakeConstSpan(field.data(), static_cast<size_t>(field.size()));
}

// Every field but timeout_ms and wait. Strings and spans hash with their lengths, and
// each segment with its kind, so no two different requests line up into one sequence.
struct Hashed {
  const v1::SubmitTransferRequest& r;

  template <typename H>
  friend H AbslHashValue(H h, const Hashed& d) {
    const v1::SubmitTransferRequest& r = d.r;
    h = H::combine(std::move(h), View(r.transfer_id()), View(r.peer()), static_cast<int>(r.op()),
                   View(r.notification()), r.chunk(), r.more_chunks(), View(r.request_id()),
                   static_cast<int>(r.complete_when()), r.segments_size());
    for (const v1::Segment& s : r.segments()) {
      h = H::combine(std::move(h), static_cast<int>(s.kind_case()));
      if (s.has_items()) {
        const v1::ItemSegment& i = s.items();
        h = H::combine(std::move(h), View(i.local_group()), View(i.remote_group()),
                       Values(i.local_indices()), Values(i.remote_indices()));
      } else if (s.has_bytes()) {
        const v1::ByteSegment& b = s.bytes();
        h = H::combine(std::move(h), View(b.local_region()), b.local_offset(),
                       View(b.remote_region()), b.remote_offset(), b.length());
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
