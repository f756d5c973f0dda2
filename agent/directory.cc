#include "agent/directory.h"

#include <pthread.h>

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("directory");
constexpr absl::Duration kRetry = absl::Seconds(1);

// The first key after every key that starts with `prefix` (etcd's range_end).
std::string PrefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    if (static_cast<unsigned char>(prefix.back()) < 0xff) {
      prefix.back() = static_cast<char>(prefix.back() + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

}  // namespace

absl::StatusOr<std::string> DialAddress(const directory::AgentRecord& record,
                                        const std::string& host_id) {
  if (!host_id.empty() && record.host() == host_id && absl::StartsWith(record.local_socket(), "unix:")) {
    return record.local_socket();
  }
  if (!record.address().empty()) return record.address();
  return absl::FailedPreconditionError(fmt::format(
      "agent '{}' runs on another host and has no network door in the directory; start it "
      "with --listen HOST:PORT (and TLS) so that peers elsewhere can reach it",
      Printable(record.name(), 128)));
}

absl::StatusOr<std::unique_ptr<Directory>> Directory::Create(DirectoryOptions options) {
  ASSIGN_OR_RETURN(std::vector<EtcdEndpoint> endpoints, ParseEtcdUrl(options.url));
  if (options.prefix.empty() || options.prefix.front() != '/' || options.prefix.size() > 256 ||
      Printable(options.prefix, 256) != options.prefix) {
    return absl::InvalidArgumentError(fmt::format(
        "--directory-prefix '{}': give a printable key prefix that starts with '/' (at most "
        "256 bytes), e.g. /kvagent/",
        Printable(options.prefix, 100)));
  }
  if (options.prefix.back() != '/') options.prefix += '/';
  if (options.ttl_s < 2 || options.ttl_s > 3600) {
    return absl::InvalidArgumentError(fmt::format(
        "--directory-ttl-s {}: give 2..3600 seconds (how long a dead agent stays listed)",
        options.ttl_s));
  }
  EtcdTlsContext tls;
  if (!endpoints.empty() && endpoints.front().tls) {
    ASSIGN_OR_RETURN(tls, MakeEtcdTlsContext(options.tls));
  } else if (options.tls.any()) {
    return absl::InvalidArgumentError(fmt::format(
        "--directory-ca, --directory-cert and --directory-key are for TLS to etcd, but "
        "--directory '{}' is plain etcd://: write etcds:// where etcd serves TLS, or drop "
        "those flags",
        Printable(options.url, 200)));
  }
  return std::unique_ptr<Directory>(
      new Directory(std::move(options), std::move(endpoints), std::move(tls)));
}

Directory::Directory(DirectoryOptions options, std::vector<EtcdEndpoint> endpoints,
                     EtcdTlsContext tls)
    : options_(std::move(options)),
      tls_(std::move(tls)),
      etcd_(std::move(endpoints), absl::Milliseconds(options_.timeout_ms), tls_) {}

Directory::~Directory() { Stop(); }

void Directory::Start(directory::AgentRecord self) {
  self_ = std::move(self);
  started_ = true;
  publisher_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "dir-publish");
    PublishLoop();
  });
  watcher_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "dir-watch");
    WatchLoop();
  });
}

void Directory::Stop() {
  if (!started_ || stop_.exchange(true)) return;
  {
    absl::MutexLock lock(&sleep_mu_);
    sleep_cv_.SignalAll();
  }
  if (publisher_.joinable()) publisher_.join();
  if (watcher_.joinable()) watcher_.join();
}

void Directory::Sleep(absl::Duration d) {
  absl::MutexLock lock(&sleep_mu_);
  const absl::Time until = absl::Now() + d;
  while (!stop_.load() && absl::Now() < until) sleep_cv_.WaitWithDeadline(&sleep_mu_, until);
}

void Directory::SetError(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  last_error_ = std::string(status.message());
}

void Directory::PublishLoop() {
  const absl::Duration tick = absl::Seconds(options_.ttl_s) / 3;
  int64_t lease = 0;
  bool warned = false;
  bool told = false;  // `published` as the state listener last heard it
  auto tell = [&] {
    bool published;
    {
      absl::MutexLock lock(&mu_);
      published = published_;
    }
    if (published == told) return;
    told = published;
    if (state_listener_) state_listener_();
  };
  while (!stop_.load()) {
    tell();
    absl::Status status;
    if (lease == 0) {
      directory::EtcdLeaseGrantRequest grant;
      grant.set_ttl(options_.ttl_s);
      directory::EtcdLeaseGrantResponse granted;
      status = etcd_.Call("/v3/lease/grant", grant, &granted);
      if (status.ok() && granted.id() == 0) {
        status = absl::UnavailableError(fmt::format("no lease granted: {}", granted.error()));
      }
      if (status.ok()) {
        directory::AgentRecord record = self_;
        record.set_published_unix_ms(absl::ToUnixMillis(absl::Now()));
        directory::EtcdPutRequest put;
        put.set_key(Key(self_.name()));
        put.set_value(EtcdJson(record));
        put.set_lease(granted.id());
        directory::EtcdHeader ignored;
        status = etcd_.Call("/v3/kv/put", put, &ignored);
        if (status.ok()) {
          lease = granted.id();
          uint64_t count;
          {
            absl::MutexLock lock(&mu_);
            published_ = true;
            lease_id_ = lease;
            count = ++publishes_;
            last_error_.clear();
          }
          kLog.Info("published '{}' in etcd ({}) under {} with a {} s lease{}", self_.name(),
                    etcd_.CurrentEndpoint(), Key(self_.name()), options_.ttl_s,
                    count > 1 ? " (again)" : "");
          warned = false;
        }
      }
    } else {
      directory::EtcdLeaseIdRequest keep;
      keep.set_id(lease);
      directory::EtcdKeepAliveStreamed kept;
      status = etcd_.Call("/v3/lease/keepalive", keep, &kept);
      if (status.ok() && kept.has_error()) {
        status = absl::UnavailableError(fmt::format("keepalive refused: {}", kept.error().message()));
      }
      if (status.ok() && kept.result().ttl() <= 0) {
        kLog.Warn("etcd let the lease of '{}' expire (unreachable longer than {} s?); publishing "
                  "again", self_.name(), options_.ttl_s);
        lease = 0;
        absl::MutexLock lock(&mu_);
        published_ = false;
        lease_id_ = 0;
        continue;
      }
      if (status.ok()) {
        absl::MutexLock lock(&mu_);
        published_ = true;
        last_error_.clear();
      }
    }
    if (!status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        published_ = false;
        last_error_ = std::string(status.message());
      }
      if (!warned) {
        kLog.Warn("etcd ({}) unreachable: {}; peers already connected keep working, lookups by "
                  "name fail until it answers; retrying every second",
                  etcd_.EndpointsText(), status.message());
        warned = true;
      }
      tell();
      Sleep(kRetry);
      continue;
    }
    tell();
    Sleep(tick);
  }
  if (lease != 0) {
    // Leave at once instead of after the TTL.
    EtcdClient quick(*ParseEtcdUrl(options_.url), absl::Milliseconds(500), tls_);
    directory::EtcdLeaseIdRequest revoke;
    revoke.set_id(lease);
    directory::EtcdHeader ignored;
    (void)quick.Call("/v3/lease/revoke", revoke, &ignored);
  }
}

void Directory::WatchLoop() {
  while (!stop_.load()) {
    absl::StatusOr<int64_t> revision = Resync();
    if (!revision.ok()) {
      SetError(revision.status());
      Sleep(kRetry);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      watching_ = true;
      last_error_.clear();
    }
    directory::EtcdWatchRequest watch;
    watch.mutable_create_request()->set_key(Key(""));
    watch.mutable_create_request()->set_range_end(PrefixEnd(Key("")));
    watch.mutable_create_request()->set_start_revision(*revision + 1);
    absl::Status failure;
    absl::Status ended = etcd_.Stream(
        "/v3/watch", watch,
        [&](std::string_view message) {
          directory::EtcdWatchStreamed streamed;
          if (absl::Status parsed = ParseEtcdJson(message, &streamed); !parsed.ok()) {
            failure = parsed;
            return false;
          }
          if (streamed.has_error()) {
            failure = absl::UnavailableError(streamed.error().message());
            return false;
          }
          if (streamed.result().canceled()) {
            failure = absl::UnavailableError(fmt::format(
                "etcd cancelled the watch ({}); reading the prefix again",
                streamed.result().cancel_reason()));
            return false;
          }
          for (const auto& event : streamed.result().events()) {
            Apply(event.kv().key(),
                  event.type() == directory::EtcdEvent::DELETE ? nullptr : &event.kv().value());
          }
          return true;
        },
        stop_);
    {
      absl::MutexLock lock(&mu_);
      watching_ = false;
    }
    if (stop_.load()) break;
    SetError(!failure.ok() ? failure : ended.ok() ? absl::UnavailableError("the watch ended") : ended);
    Sleep(absl::Milliseconds(200));
  }
}

absl::StatusOr<int64_t> Directory::Resync() {
  // In pages, all read as of the first page's revision: the prefix is whatever anyone
  // who can write it put there, and one answer is bounded (EtcdClient::kMaxBodyBytes),
  // so a prefix holding more than that in one range kept the directory from ever
  // watching. A page too large for one answer is asked again with half the keys.
  constexpr int64_t kPageKeys = 512;
  const std::string end = PrefixEnd(Key(""));
  std::string from = Key("");
  int64_t limit = kPageKeys;
  int64_t revision = 0;
  // Names in the view that etcd still has (bounded by the view, not by the prefix).
  absl::flat_hash_set<std::string> found;
  for (;;) {
    directory::EtcdRangeRequest range;
    range.set_key(from);
    range.set_range_end(end);
    range.set_limit(limit);
    range.set_revision(revision);
    directory::EtcdRangeResponse answer;
    absl::Status read = etcd_.Call("/v3/kv/range", range, &answer);
    if (absl::IsResourceExhausted(read) && limit > 1) {
      limit = std::max<int64_t>(1, limit / 2);
      continue;
    }
    RETURN_IF_ERROR(read);
    if (revision == 0) revision = answer.header().revision();
    for (const auto& kv : answer.kvs()) {
      Apply(kv.key(), &kv.value());
      const std::string& key = kv.key();
      if (absl::StartsWith(key, Key(""))) {
        const std::string name = key.substr(Key("").size());
        absl::MutexLock lock(&mu_);
        if (view_.contains(name)) found.insert(name);
      }
    }
    if (!answer.more() || answer.kvs_size() == 0) break;
    from = answer.kvs(answer.kvs_size() - 1).key();
    from.push_back('\0');  // the next key after the last one read
    limit = kPageKeys;
  }
  // Whatever the view held that etcd no longer has went while we were not watching.
  std::vector<std::string> gone;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, record] : view_) {
      if (!found.contains(name)) gone.push_back(Key(name));
    }
  }
  for (const auto& key : gone) Apply(key, nullptr);
  return revision;
}

void Directory::Apply(const std::string& key, const std::string* value) {
  const std::string base = Key("");
  if (!absl::StartsWith(key, base)) return;
  const std::string name = key.substr(base.size());
  std::optional<directory::AgentRecord> before;
  std::optional<directory::AgentRecord> now;
  {
    absl::MutexLock lock(&mu_);
    auto it = view_.find(name);
    if (it != view_.end()) before = it->second;
    if (value == nullptr) {
      if (it != view_.end()) view_.erase(it);
    } else {
      directory::AgentRecord record;
      if (!ParseEtcdJson(*value, &record).ok() || record.name() != name ||
          (it == view_.end() && view_.size() >= options_.max_agents)) {
        ++ignored_;
        return;
      }
      view_[name] = record;
      now = std::move(record);
    }
  }
  if (name == self_.name() || (!before.has_value() && !now.has_value())) return;
  if (before.has_value() && now.has_value() && now->incarnation() == before->incarnation()) return;
  if (listener_) {
    listener_(name, before.has_value() ? &*before : nullptr, now.has_value() ? &*now : nullptr);
  }
}

absl::StatusOr<directory::AgentRecord> Directory::Lookup(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  if (!watching_) {
    return absl::UnavailableError(fmt::format(
        "the directory cannot resolve agent '{}': etcd ({}) is not answering ({}); peers already "
        "connected keep working; connect by address (HOST:PORT or unix:PATH) meanwhile, or bring "
        "etcd back",
        Printable(name, 128), etcd_.EndpointsText(),
        last_error_.empty() ? "not read yet" : last_error_));
  }
  auto it = view_.find(name);
  if (it == view_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, r] : view_) names.push_back(Printable(n, 128));
    std::sort(names.begin(), names.end());
    if (names.size() > 20) names.resize(20);
    return absl::NotFoundError(fmt::format(
        "no agent '{}' is published under {} in etcd ({}); listed: [{}]; check the name, and "
        "that agent's --directory and --directory-prefix",
        Printable(name, 128), Key(""), etcd_.EndpointsText(), fmt::join(names, ", ")));
  }
  return it->second;
}

DirectoryState Directory::State() const {
  DirectoryState state;
  state.endpoints = etcd_.EndpointsText();
  state.prefix = options_.prefix;
  absl::MutexLock lock(&mu_);
  state.published = published_;
  state.watching = watching_;
  state.lease_id = lease_id_;
  state.publishes = publishes_;
  state.ignored = ignored_;
  state.last_error = last_error_;
  for (const auto& [name, record] : view_) state.agents.push_back(record);
  std::sort(state.agents.begin(), state.agents.end(),
            [](const auto& a, const auto& b) { return a.name() < b.name(); });
  return state;
}

}  // namespace kvagent::agent
