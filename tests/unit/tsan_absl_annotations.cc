// TSan only (compiled empty otherwise): tells ThreadSanitizer about Debian's Abseil
// locks. libabsl_synchronization is not built with -fsanitize=thread, so TSan never
// sees absl::Mutex, CondVar or Notification order memory, and every access guarded by
// one (ABSL_GUARDED_BY) from two threads reads as a data race (measured: a two-thread
// counter under absl::MutexLock is reported). These definitions take precedence over
// the library's (the test binary is linked statically under --config=tsan), add the
// happens-before edges (__tsan_release before a lock is given up, __tsan_acquire after
// it is taken) and call the library's own function. Linked into every test through
// //tests/unit:catch_main. kvagentd processes that tests start do not have it, which
// is why .ci/run runs TSan on the unit tests only (docs/ARCHITECTURE.md, Tests).
// Abseil evaluates an Await/LockWhen condition in whichever thread releases the lock,
// with the lock held; those reads are ignored (they are under the lock by design).
// Also here: the TSan suppressions every test uses, one reason each.
#if defined(__SANITIZE_THREAD__)

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

extern "C" {
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);

// What TSan cannot judge because the synchronization is inside an uninstrumented
// library:
//  race:ucp_put_handler: UCX copies RMA data (memcpy in ucp_put_handler) on the
//    target worker's progress thread, and the initiator learns that it landed through
//    UCX's own shared-memory or network protocol (flush), which TSan cannot see: a
//    test reading the bytes after the flush was reported racing with that memcpy
//    (ucx_worker_test PutGetRoundTrip). Matching the writer's stack needs TSan to
//    keep it, hence history_size=7 below. (called_from_lib on UCX's libraries is not
//    an option: it also hides UCX's own spinlock calls and TSan then reports bogus
//    lock misuse in libucs.)
const char* __tsan_default_suppressions() { return "race:ucp_put_handler\n"; }
const char* __tsan_default_options() { return "history_size=7"; }
}  // extern "C"

namespace {

// Runs one call of the library with the calling thread's reads ignored (see top).
struct IgnoreReads {
  IgnoreReads() { AnnotateIgnoreReadsBegin(__FILE__, __LINE__); }
  ~IgnoreReads() { AnnotateIgnoreReadsEnd(__FILE__, __LINE__); }
};

// The library's symbol, found past ours; mangled names carry Abseil's inline
// namespace (absl::debian3 on Debian 12), so it is spliced in.
#define KVAGENT_STR2(x) #x
#define KVAGENT_STR(x) KVAGENT_STR2(x)

void* Real(const char* mangled_tail, bool const_method) {
  const std::string ns = KVAGENT_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  const std::string name = std::string(const_method ? "_ZNK4absl" : "_ZN4absl") +
                           std::to_string(ns.size()) + ns + mangled_tail;
  void* fn = dlsym(RTLD_NEXT, name.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "tsan_absl_annotations: %s not found in libabsl_synchronization\n",
                 name.c_str());
    std::abort();
  }
  return fn;
}

template <typename Fn>
Fn Lookup(const char* mangled_tail, bool const_method = false) {
  return reinterpret_cast<Fn>(Real(mangled_tail, const_method));
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  static auto real = Lookup<void (*)(Mutex*)>("5Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}
void Mutex::ReaderLock() {
  static auto real = Lookup<void (*)(Mutex*)>("5Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}
bool Mutex::TryLock() {
  static auto real = Lookup<bool (*)(Mutex*)>("5Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
bool Mutex::ReaderTryLock() {
  static auto real = Lookup<bool (*)(Mutex*)>("5Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}
void Mutex::Unlock() {
  static auto real = Lookup<void (*)(Mutex*)>("5Mutex6UnlockEv");
  __tsan_release(this);
  {
    IgnoreReads ignore;
    real(this);
  }
}
void Mutex::ReaderUnlock() {
  static auto real = Lookup<void (*)(Mutex*)>("5Mutex12ReaderUnlockEv");
  __tsan_release(this);
  {
    IgnoreReads ignore;
    real(this);
  }
}
void Mutex::LockWhen(const Condition& cond) {
  static auto real = Lookup<void (*)(Mutex*, const Condition&)>("5Mutex8LockWhenERKNS0_9ConditionE");
  {
    IgnoreReads ignore;
    real(this, cond);
  }
  __tsan_acquire(this);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  static auto real =
      Lookup<void (*)(Mutex*, const Condition&)>("5Mutex14ReaderLockWhenERKNS0_9ConditionE");
  {
    IgnoreReads ignore;
    real(this, cond);
  }
  __tsan_acquire(this);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Lookup<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, cond, timeout);
  }
  __tsan_acquire(this);
  return result;
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Lookup<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, cond, deadline);
  }
  __tsan_acquire(this);
  return result;
}
// Await releases the lock while it waits and holds it again on return.
void Mutex::Await(const Condition& cond) {
  static auto real = Lookup<void (*)(Mutex*, const Condition&)>("5Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  {
    IgnoreReads ignore;
    real(this, cond);
  }
  __tsan_acquire(this);
}
bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static auto real = Lookup<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  __tsan_release(this);
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, cond, timeout);
  }
  __tsan_acquire(this);
  return result;
}
bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static auto real = Lookup<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_release(this);
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, cond, deadline);
  }
  __tsan_acquire(this);
  return result;
}
void CondVar::Wait(Mutex* mu) {
  static auto real = Lookup<void (*)(CondVar*, Mutex*)>("7CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  {
    IgnoreReads ignore;
    real(this, mu);
  }
  __tsan_acquire(mu);
}
bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static auto real = Lookup<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, mu, timeout);
  }
  __tsan_acquire(mu);
  return result;
}
bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static auto real = Lookup<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  bool result;
  {
    IgnoreReads ignore;
    result = real(this, mu, deadline);
  }
  __tsan_acquire(mu);
  return result;
}
// Notification: Notify publishes; a wait that saw it acquires. (HasBeenNotified is
// inline over an atomic the library writes, so a poll that sees it gets no edge: the
// few tests that poll also wait.)
void Notification::Notify() {
  static auto real = Lookup<void (*)(Notification*)>("12Notification6NotifyEv");
  __tsan_release(this);
  {
    IgnoreReads ignore;
    real(this);
  }
}
void Notification::WaitForNotification() const {
  static auto real = Lookup<void (*)(const Notification*)>("12Notification19WaitForNotificationEv", true);
  {
    IgnoreReads ignore;
    real(this);
  }
  __tsan_acquire(const_cast<Notification*>(this));
}
bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  static auto real = Lookup<bool (*)(const Notification*, absl::Duration)>(
      "12Notification30WaitForNotificationWithTimeoutENS0_8DurationE", true);
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}
bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static auto real = Lookup<bool (*)(const Notification*, absl::Time)>(
      "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE", true);
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(const_cast<Notification*>(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

#endif  // __SANITIZE_THREAD__
