// Directory publishes this agent in etcd and keeps a live view of the fleet
// (`--directory etcd://HOST:PORT[,...]` or `etcds://` with TLS, `--directory-prefix`).
//
// - Publish: a lease of `ttl_s` is granted and the agent's record (name, network
//   address, local socket, host, incarnation, metadata version) is put under
//   <prefix>agents/<name> with it; a keepalive every ttl/3 holds it. A lease that
//   expired (etcd lost us longer than the TTL) is granted anew and the record put
//   again; while etcd is unreachable the agent goes on and retries every second.
// - View: the prefix is read once and then watched; every change updates the view,
//   and a record that disappears (its lease expired: the agent died or lost etcd) or
//   is replaced by another incarnation (a restart) is reported to the listener, which
//   fails that peer's transfers at once and reconnects.
// - Lookup(name) answers from the view; while the watch is broken (etcd unreachable)
//   it fails with UNAVAILABLE naming the endpoints and the error, so a caller never
//   connects by a stale address. Peers already connected keep working.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/etcd_client.h"
#include "proto/directory.pb.h"

namespace kvagent::agent {

struct DirectoryOptions {
  std::string url;                  // etcd://HOST:PORT[,HOST:PORT...] or etcds://...
  EtcdTlsFiles tls;                 // for etcds://: --directory-ca, -cert, -key
  std::string prefix = "/kvagent/";
  uint32_t ttl_s = 10;              // the lease: how long a dead agent stays listed
  uint32_t timeout_ms = 2000;       // per etcd call and connect
  uint32_t max_agents = 65536;      // records kept in the view; more are ignored, counted
};

struct DirectoryState {
  std::string endpoints;
  std::string prefix;
  bool published = false;  // our record is in etcd under a live lease
  bool watching = false;   // the view follows etcd
  int64_t lease_id = 0;
  uint64_t publishes = 0;  // records put (1 + one per re-grant after an expiry)
  uint64_t ignored = 0;    // records dropped: unparsable, over max_agents, name mismatch
  std::string last_error;
  std::vector<directory::AgentRecord> agents;  // sorted by name
};

// Where to reach `record` from an agent on host `host_id`: its local socket when it
// runs on the same host (memory then moves by descriptor), else its network door;
// FAILED_PRECONDITION when it has neither for us.
absl::StatusOr<std::string> DialAddress(const directory::AgentRecord& record,
                                        const std::string& host_id);

class Directory {
 public:
  // Agent `name`'s record changed: `before` is the record the view held (null when it
  // was not listed), `now` the new one (null when it was deleted or its lease
  // expired). Called for another incarnation or an appearance or a disappearance,
  // never for this agent's own record, on the watch thread, outside the lock.
  using Listener = std::function<void(const std::string& name, const directory::AgentRecord* before,
                                      const directory::AgentRecord* now)>;

  static absl::StatusOr<std::unique_ptr<Directory>> Create(DirectoryOptions options);
  ~Directory();

  void SetListener(Listener listener) { listener_ = std::move(listener); }
  // Called when State().published changes (the health monitor's Recheck), on the
  // publishing thread, outside the lock. Before Start.
  void SetStateListener(std::function<void()> listener) { state_listener_ = std::move(listener); }
  // Starts publishing `self` and watching the prefix, in the background (etcd may be
  // down now; it is retried).
  void Start(directory::AgentRecord self);
  // Revokes the lease (so peers see this agent leave at once) and stops.
  void Stop();

  // A published record of agent `name`: NOT_FOUND naming the agents listed; UNAVAILABLE
  // while etcd cannot be reached.
  absl::StatusOr<directory::AgentRecord> Lookup(const std::string& name) const;
  DirectoryState State() const;
  const DirectoryOptions& options() const { return options_; }

 private:
  Directory(DirectoryOptions options, std::vector<EtcdEndpoint> endpoints, EtcdTlsContext tls);
  std::string Key(const std::string& name) const { return options_.prefix + "agents/" + name; }
  void PublishLoop();
  void WatchLoop();
  // Reads the whole prefix, replaces the view (reporting what went or changed) and
  // returns the revision to watch from.
  absl::StatusOr<int64_t> Resync();
  // Applies one record put (value) or deleted (null value) under `key`.
  void Apply(const std::string& key, const std::string* value);
  void SetError(const absl::Status& status);
  void Sleep(absl::Duration d);

  DirectoryOptions options_;
  EtcdTlsContext tls_;  // null for etcd://
  EtcdClient etcd_;
  Listener listener_;
  std::function<void()> state_listener_;
  directory::AgentRecord self_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, directory::AgentRecord> view_ ABSL_GUARDED_BY(mu_);
  bool published_ ABSL_GUARDED_BY(mu_) = false;
  bool watching_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lease_id_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t publishes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ignored_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  bool started_ = false;

  std::atomic<bool> stop_{false};
  absl::Mutex sleep_mu_;
  absl::CondVar sleep_cv_;
  std::thread publisher_;
  std::thread watcher_;
};

}  // namespace kvagent::agent
