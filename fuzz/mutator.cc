#include "fuzz/mutator.h"

#include <limits>
#include <memory>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"

namespace kvagent::fuzz {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// Every string the message holds: reusing one makes duplicate names and matching
// group/region references, which random bytes almost never produce.
void CollectStrings(const Message& message, std::vector<std::string>* out) {
  const Reflection* reflection = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const FieldDescriptor* field : fields) {
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
      if (field->is_repeated()) {
        for (int i = 0; i < reflection->FieldSize(message, field); ++i) {
          out->push_back(reflection->GetRepeatedString(message, field, i));
        }
      } else {
        out->push_back(reflection->GetString(message, field));
      }
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (field->is_repeated()) {
        for (int i = 0; i < reflection->FieldSize(message, field); ++i) {
          CollectStrings(reflection->GetRepeatedMessage(message, field, i), out);
        }
      } else {
        CollectStrings(reflection->GetMessage(message, field), out);
      }
    }
  }
}

}  // namespace

uint64_t Mutator::InterestingUint64() {
  static constexpr uint64_t kValues[] = {
      0, 1, 2, 3, 7, 8, 15, 16, 63, 64, 255, 256, 4095, 4096, 4097, 65536,
      0x7fffffffULL, 0x80000000ULL, 0xffffffffULL, 0x100000000ULL,
      0x7fffffffffffffffULL, 0x8000000000000000ULL, 0xfffffffffffffffeULL,
      0xffffffffffffffffULL};
  switch (Next(4)) {
    case 0: return rng_();
    case 1: return Next(64);
    default: return kValues[Next(sizeof(kValues) / sizeof(kValues[0]))];
  }
}

std::string Mutator::InterestingString(const Message& root) {
  std::vector<std::string> existing;
  CollectStrings(root, &existing);
  switch (Next(6)) {
    case 0: return "";
    case 1: return std::string(1 + Next(300), static_cast<char>('a' + Next(26)));
    case 2: return std::string(64, '\x42');  // the size of a CUDA IPC handle
    case 3: {  // control characters and quotes, valid UTF-8 (else parsing fails)
      std::string s(Next(12), '\0');
      for (char& c : s) c = static_cast<char>(Next(128));
      return s;
    }
    default:
      if (existing.empty()) return "x";
      return existing[Next(existing.size())];
  }
}

bool Mutator::MutateMessage(Message* message) {
  Message* root = message;
  // Walk down a few levels, picking a field at random at each.
  for (int depth = 0; depth < 4; ++depth) {
    const auto* descriptor = message->GetDescriptor();
    const Reflection* reflection = message->GetReflection();
    if (descriptor->field_count() == 0) return false;
    const FieldDescriptor* field = descriptor->field(static_cast<int>(Next(descriptor->field_count())));
    if (field->is_repeated()) {
      const int size = reflection->FieldSize(*message, field);
      const uint64_t action = Next(4);
      if (size > 0 && action == 0) {  // remove the last entry
        reflection->RemoveLast(message, field);
        return true;
      }
      if (size > 0 && action == 1 && field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        Message* entry = reflection->MutableRepeatedMessage(message, field,
                                                            static_cast<int>(Next(size)));
        if (Next(2) == 0) {  // duplicate it, then maybe edit the copy further down
          Message* copy = reflection->AddMessage(message, field);
          copy->CopyFrom(*entry);
          message = copy;
        } else {
          message = entry;
        }
        continue;
      }
      if (size > 0 && action == 2 && field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) {
        const int i = static_cast<int>(Next(size));
        switch (field->cpp_type()) {
          case FieldDescriptor::CPPTYPE_UINT64:
            reflection->SetRepeatedUInt64(message, field, i, InterestingUint64());
            return true;
          case FieldDescriptor::CPPTYPE_STRING:
            reflection->SetRepeatedString(message, field, i, InterestingString(*root));
            return true;
          default:
            break;
        }
      }
      switch (field->cpp_type()) {  // add an entry
        case FieldDescriptor::CPPTYPE_MESSAGE:
          message = reflection->AddMessage(message, field);
          continue;
        case FieldDescriptor::CPPTYPE_UINT64:
          for (uint64_t n = 1 + Next(3 * (1 + Next(8))); n > 0; --n) {
            reflection->AddUInt64(message, field, Next(3) == 0 ? InterestingUint64() : Next(40));
          }
          return true;
        case FieldDescriptor::CPPTYPE_STRING:
          reflection->AddString(message, field, InterestingString(*root));
          return true;
        default:
          return false;
      }
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        if (Next(8) == 0) {
          reflection->ClearField(message, field);
          return true;
        }
        message = reflection->MutableMessage(message, field);
        continue;
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection->SetUInt64(message, field, InterestingUint64());
        return true;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection->SetInt64(message, field, static_cast<int64_t>(InterestingUint64()));
        return true;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection->SetUInt32(message, field, static_cast<uint32_t>(InterestingUint64()));
        return true;
      case FieldDescriptor::CPPTYPE_INT32: {
        static constexpr int32_t kValues[] = {-1, 0, 1, 2, 7, std::numeric_limits<int32_t>::max(),
                                              std::numeric_limits<int32_t>::min()};
        reflection->SetInt32(message, field, kValues[Next(7)]);
        return true;
      }
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection->SetBool(message, field, !reflection->GetBool(*message, field));
        return true;
      case FieldDescriptor::CPPTYPE_ENUM:  // proto3 keeps unknown values: try them too
        reflection->SetEnumValue(message, field, static_cast<int>(Next(5)) - (Next(8) == 0 ? 7 : 0));
        return true;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection->SetString(message, field, InterestingString(*root));
        return true;
      default:
        return false;
    }
  }
  return false;
}

std::string Mutator::MutateBytes(const std::string& input, const std::vector<std::string>& pool) {
  std::string out = input;
  switch (Next(7)) {
    case 0:  // flip a bit
      if (!out.empty()) out[Next(out.size())] ^= static_cast<char>(1u << Next(8));
      break;
    case 1: {  // an interesting byte
      static constexpr unsigned char kBytes[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0x0a, 0x12};
      if (!out.empty()) out[Next(out.size())] = static_cast<char>(kBytes[Next(7)]);
      break;
    }
    case 2: {  // insert random bytes
      std::string bytes(1 + Next(8), '\0');
      for (char& c : bytes) c = static_cast<char>(Next(256));
      out.insert(Next(out.size() + 1), bytes);
      break;
    }
    case 3:  // erase a range
      if (!out.empty()) {
        const size_t at = Next(out.size());
        out.erase(at, 1 + Next(out.size() - at));
      }
      break;
    case 4:  // a maximal varint (10 bytes): lengths and counts far beyond the input
      out.insert(Next(out.size() + 1), std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 10));
      break;
    case 5:  // duplicate a range (repeated fields, fields given twice)
      if (!out.empty()) {
        const size_t at = Next(out.size());
        out.insert(Next(out.size() + 1), out.substr(at, 1 + Next(out.size() - at)));
      }
      break;
    default:  // splice with another corpus entry
      if (!pool.empty()) {
        const std::string& other = pool[Next(pool.size())];
        out = out.substr(0, Next(out.size() + 1)) + other.substr(Next(other.size() + 1));
      }
      break;
  }
  return out;
}

std::string Mutator::Mutate(const std::string& input, const std::vector<std::string>& pool,
                            const Message& prototype) {
  std::string out = input;
  for (uint64_t edits = 1 + Next(4); edits > 0; --edits) {
    if (Next(5) != 0) {
      std::unique_ptr<Message> message(prototype.New());
      if (message->ParseFromString(out) && MutateMessage(message.get())) {
        out = message->SerializeAsString();
        continue;
      }
    }
    out = MutateBytes(out, pool);
  }
  return out;
}

}  // namespace kvagent::fuzz
