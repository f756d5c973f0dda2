// Mutual TLS for the network door (peer agents, remote schedulers): checks the
// --tls-cert/--tls-key/--tls-ca files with OpenSSL, builds gRPC server and channel
// credentials against the cluster CA, and reads a peer's identity from its certificate.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace kvagent::agent {

// Paths given by the flags; one certificate serves as both server and client identity.
struct TlsFiles {
  std::string cert;  // --tls-cert: PEM certificate (leaf first, then any intermediates)
  std::string key;   // --tls-key: PEM private key of the leaf, unencrypted
  std::string ca;    // --tls-ca: PEM cluster CA, the only trust anchor
  // True when none of the three is set (the network door stays closed, or is insecure
  // behind its own flag). Partly set files are an error in CheckTlsFiles.
  bool empty() const;
};

// Checks the files before gRPC sees them (gRPC only logs why a handshake failed):
// all three set, readable and PEM; the key matches the certificate; the certificate is
// valid now and chains to the CA, with the CA as the only trust anchor. `who` names the
// entry in the message ("kvagentd", "kvagentctl"). INVALID_ARGUMENT when a flag names
// the wrong thing (unset, missing, not PEM, a key of another certificate, a certificate
// of another CA); FAILED_PRECONDITION when the certificate is right but not valid now.
// Each message names the flag, the path, the cause and the fix.
absl::Status CheckTlsFiles(const TlsFiles& files, std::string_view who);

// Server side of mutual TLS: presents files.cert and requires every client to present
// a certificate that chains to files.ca (no certificate, another CA's, or an expired one
// fail the handshake). Reads the files only: call CheckTlsFiles first.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files);

// Client side of mutual TLS: presents files.cert and verifies the server's chain against
// files.ca, but does NOT compare the server's certificate with the host name dialed
// (agents are reached by IP or any host name; identity is the agent name in the
// certificate, checked with IdentityMatches after the call). No channel argument is
// needed (GRPC_SSL_TARGET_NAME_OVERRIDE_ARG is not used). Reads the files only: call
// CheckTlsFiles first.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& files);

// The authenticated peer's names: its DNS subject alternative names, then its common
// name (once, if not among them). Empty when the peer is not authenticated (insecure or
// local door). On a server: CallbackServerContext::auth_context(); on a client, after a
// call: ClientContext::auth_context().
std::vector<std::string> PeerIdentities(const grpc::AuthContext& context);

// True when `name` (non-empty) equals one of PeerIdentities(context), byte for byte.
bool IdentityMatches(const grpc::AuthContext& context, std::string_view name);

}  // namespace kvagent::agent
