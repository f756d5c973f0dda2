// RequestDigest, the engine's test of whether a submit repeats an earlier one (an
// idempotent retry) or differs from it: walked over SubmitTransferRequest's descriptor,
// changing any one field of the request, or of any message in it, changes the digest,
// except timeout_ms and wait, which a retry may change. A field added to the proto and
// not to RequestDigest fails here (every field reachable from the request must have been
// changed once). Equal requests, however they were built (copied, parsed from bytes),
// have equal digests.
#include "agent/request_digest.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Every field set, and a segment of each kind.
v1::SubmitTransferRequest Full() {
  v1::SubmitTransferRequest r;
  r.set_transfer_id("req-7-layer-3");
  r.set_peer("decode-0");
  r.set_op(v1::WRITE);
  r.set_notification("payload");
  r.set_chunk(2);
  r.set_more_chunks(true);
  r.set_timeout_ms(5000);
  r.set_wait(true);
  r.set_request_id("req-7");
  r.set_complete_when(v1::COMPLETE_WHEN_PLACED);
  v1::ItemSegment* items = r.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv-remote");
  items->add_local_indices(1);
  items->add_local_indices(2);
  items->add_remote_indices(5);
  items->add_remote_indices(6);
  v1::ByteSegment* bytes = r.add_segments()->mutable_bytes();
  bytes->set_local_region("aux");
  bytes->set_local_offset(64);
  bytes->set_remote_region("aux-remote");
  bytes->set_remote_offset(128);
  bytes->set_length(4096);
  return r;
}

// Where a message sits in the request: (field, index) from the root; index -1 for a
// singular field.
using Path = std::vector<std::pair<const FieldDescriptor*, int>>;

Message* Locate(Message* root, const Path& path) {
  Message* m = root;
  for (const auto& [field, index] : path) {
    const Reflection* r = m->GetReflection();
    m = index < 0 ? r->MutableMessage(m, field) : r->MutableRepeatedMessage(m, field, index);
  }
  return m;
}

// Changes `field` of `m`: appends to a repeated field, drops a set message (or sets an
// unset one), otherwise sets another value.
void Change(Message* m, const FieldDescriptor* field) {
  const Reflection* r = m->GetReflection();
  INFO("field " << field->full_name());
  if (field->is_repeated()) {
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_UINT64:
        r->AddUInt64(m, field, 99);
        return;
      case FieldDescriptor::CPPTYPE_MESSAGE:
        r->AddMessage(m, field);
        return;
      default:
        FAIL("a repeated field of a type this test cannot change yet: teach Change");
        return;
    }
  }
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      r->SetString(m, field, r->GetString(*m, field) + "x");
      return;
    case FieldDescriptor::CPPTYPE_UINT32:
      r->SetUInt32(m, field, r->GetUInt32(*m, field) + 1);
      return;
    case FieldDescriptor::CPPTYPE_UINT64:
      r->SetUInt64(m, field, r->GetUInt64(*m, field) + 1);
      return;
    case FieldDescriptor::CPPTYPE_BOOL:
      r->SetBool(m, field, !r->GetBool(*m, field));
      return;
    case FieldDescriptor::CPPTYPE_MESSAGE:  // a singular one: dropped, or set empty
      if (r->HasField(*m, field)) {
        r->ClearField(m, field);
      } else {
        r->MutableMessage(m, field);
      }
      return;
    case FieldDescriptor::CPPTYPE_ENUM: {
      const int now = r->GetEnumValue(*m, field);
      const auto* type = field->enum_type();
      for (int i = 0; i < type->value_count(); ++i) {
        if (type->value(i)->number() != now) {
          r->SetEnumValue(m, field, type->value(i)->number());
          return;
        }
      }
      FAIL("an enum with one value");
      return;
    }
    default:
      FAIL("a field of a type this test cannot change yet: teach Change");
  }
}

struct Walk {
  const v1::SubmitTransferRequest base = Full();
  const uint64_t digest = RequestDigest(base);
  std::set<std::string> changed;  // full names of fields changed at least once
  std::set<std::string> ignored = {"kvagent.v1.SubmitTransferRequest.timeout_ms",
                                   "kvagent.v1.SubmitTransferRequest.wait"};

  // Changes each field of the message at `path` (in a fresh copy of the request each
  // time), and goes into the messages it holds.
  void Visit(const Path& path) {
    v1::SubmitTransferRequest copy = base;
    const Message& here = *Locate(&copy, path);
    const Descriptor* type = here.GetDescriptor();
    for (int i = 0; i < type->field_count(); ++i) {
      const FieldDescriptor* field = type->field(i);
      const Reflection* r = here.GetReflection();
      if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        if (field->is_repeated()) {
          for (int k = 0; k < r->FieldSize(here, field); ++k) {
            Path inner = path;
            inner.emplace_back(field, k);
            Visit(inner);
          }
        } else if (r->HasField(here, field)) {
          Path inner = path;
          inner.emplace_back(field, -1);
          Visit(inner);
        } else {
          continue;  // a oneof member another element sets
        }
      }
      v1::SubmitTransferRequest changed_copy = base;
      Change(Locate(&changed_copy, path), field);
      const bool same = RequestDigest(changed_copy) == digest;
      INFO("changing " << field->full_name());
      if (ignored.count(field->full_name()) != 0) {
        CHECK(same);
      } else {
        CHECK_FALSE(same);
      }
      changed.insert(field->full_name());
    }
  }
};

void AllFields(const Descriptor* type, std::set<std::string>* names) {
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    if (!names->insert(field->full_name()).second) continue;
    if (field->message_type() != nullptr) AllFields(field->message_type(), names);
  }
}

TEST_CASE("Changing any field of a submit but timeout_ms and wait changes its digest") {
  Walk walk;
  walk.Visit({});
  std::set<std::string> all;
  AllFields(v1::SubmitTransferRequest::descriptor(), &all);
  for (const std::string& name : all) {
    INFO("a field of the request that the walk never changed: " << name);
    CHECK(walk.changed.count(name) == 1);
  }
  CHECK(walk.changed.size() == all.size());
}

TEST_CASE("Equal submits have equal digests, however they were built") {
  const v1::SubmitTransferRequest base = Full();
  v1::SubmitTransferRequest parsed;
  REQUIRE(parsed.ParseFromString(base.SerializeAsString()));
  CHECK(RequestDigest(parsed) == RequestDigest(base));
  v1::SubmitTransferRequest copy;
  copy.CopyFrom(base);
  CHECK(RequestDigest(copy) == RequestDigest(base));
  // A retry with another deadline, or waiting where the first did not.
  copy.set_timeout_ms(1);
  copy.set_wait(false);
  CHECK(RequestDigest(copy) == RequestDigest(base));
}

TEST_CASE("Requests that differ only in how their values line up differ") {
  // The same characters split differently between two strings.
  v1::SubmitTransferRequest a = Full();
  v1::SubmitTransferRequest b = Full();
  a.set_transfer_id("ab");
  a.set_peer("c");
  b.set_transfer_id("a");
  b.set_peer("bc");
  CHECK(RequestDigest(a) != RequestDigest(b));
  // The same indices moved from one side to the other.
  v1::SubmitTransferRequest c = Full();
  v1::SubmitTransferRequest d = Full();
  c.mutable_segments(0)->mutable_items()->add_local_indices(7);
  d.mutable_segments(0)->mutable_items()->add_remote_indices(7);
  CHECK(RequestDigest(c) != RequestDigest(d));
  // A segment's kind with the same names and numbers.
  v1::SubmitTransferRequest e = Full();
  v1::SubmitTransferRequest f = Full();
  e.mutable_segments(1)->mutable_bytes()->set_local_region("kv");
  f.mutable_segments(1)->mutable_items()->set_local_group("kv");
  CHECK(RequestDigest(e) != RequestDigest(f));
  // An empty segment against none.
  v1::SubmitTransferRequest g = Full();
  v1::SubmitTransferRequest h = Full();
  g.add_segments();
  CHECK(RequestDigest(g) != RequestDigest(h));
}

}  // namespace
}  // namespace kvagent::agent
