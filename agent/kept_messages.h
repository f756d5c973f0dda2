// KeptMessages: protobuf messages that one thread parses into or builds, handed back
// after use with their storage, so that the next message's strings and repeated fields
// reuse it. The Inbox (what it parses) and the TransferEngine (the notices it builds)
// keep theirs.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace kvagent::agent {

// One thread only: messages to fill, handed back after use, so that their
// strings and repeated fields keep their storage from message to message (a parse into
// one allocates nothing for them once warm; a fresh message allocates each). A use
// inside another (a send that progressed the worker into the next message) takes a
// second one. What a user moved out of its message is simply not kept.
// A message whose serialized size is over `KeepBytes` when handed back is let go.
template <typename Message, size_t KeepBytes = (16 << 10)>
class KeptMessages {
 public:
  class Lease {
   public:
    Lease(KeptMessages* pool, std::unique_ptr<Message> message)
        : pool_(pool), message_(std::move(message)) {}
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { pool_->GiveBack(std::move(message_)); }
    Message& operator*() const { return *message_; }
    Message* operator->() const { return message_.get(); }
    Message* get() const { return message_.get(); }

   private:
    KeptMessages* pool_;
    std::unique_ptr<Message> message_;
  };

  Lease Take() { return Lease(this, TakeMessage()); }

  // Without a lease, for a message that outlives the scope that takes it (the engine's
  // late open, sent by a later Pump): handed back with GiveBack, as a lease would.
  // Cleared by the user, as a leased one is.
  std::unique_ptr<Message> TakeMessage() {
    if (free_.empty()) return std::make_unique<Message>();
    std::unique_ptr<Message> message = std::move(free_.back());
    free_.pop_back();
    return message;
  }

  // A few (nesting is rare and shallow), of bounded size: a large message's storage
  // (a notification's payload may be 64 KiB) is let go.
  void GiveBack(std::unique_ptr<Message> message) {
    if (message != nullptr && free_.size() < kKeep && message->ByteSizeLong() <= KeepBytes) {
      free_.push_back(std::move(message));
    }
  }

  size_t kept() const { return free_.size(); }

 private:
  static constexpr size_t kKeep = 4;
  std::vector<std::unique_ptr<Message>> free_;
};

}  // namespace kvagent::agent
