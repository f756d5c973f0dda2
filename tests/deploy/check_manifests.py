"""Checks deploy/kubernetes against what kvagentd needs there (run by deploy_test.sh
with Debian's /usr/bin/python3 and python3-yaml): argv[1] the manifest folder, argv[2]
kvagentd's --help text."""
import re
import sys

import yaml

folder, help_path = sys.argv[1], sys.argv[2]
usage = open(help_path).read()
docs = {}
for name in ("configmap.yaml", "daemonset.yaml"):
    for doc in yaml.safe_load_all(open(f"{folder}/{name}")):
        docs[doc["kind"]] = doc
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


ds = docs["DaemonSet"]
pod = ds["spec"]["template"]["spec"]
meta = ds["spec"]["template"]["metadata"]
(container,) = pod["containers"]
args = container["args"]
flags = {a.split("=", 1)[0]: (a.split("=", 1) + [""])[1] for a in args}

# Every flag the manifest passes exists in this kvagentd.
for flag in flags:
    check(re.search(rf"^\s+{re.escape(flag)}\b", usage, re.M), f"{flag} is not in kvagentd --help")

# Probes through grpc.health.v1 on the health door.
health_port = int(flags.get("--health-listen", ":0").rsplit(":", 1)[1])
for probe in ("readinessProbe", "livenessProbe"):
    p = container.get(probe, {})
    check("grpc" in p, f"{probe} is not a gRPC health probe")
    check(p.get("grpc", {}).get("port") == health_port, f"{probe} does not use --health-listen's port")
# Liveness leaves readiness-only conditions (the etcd directory) out.
check(container.get("livenessProbe", {}).get("grpc", {}).get("service") == "kvagent.liveness",
      "livenessProbe does not ask for service kvagent.liveness (an etcd outage would restart every agent)")
check(container.get("readinessProbe", {}).get("grpc", {}).get("service", "") == "",
      "readinessProbe does not ask for the overall service \"\"")

# The liveness door (UDP) at a fixed port, declared as a UDP container port: peers
# ping it, and a hung agent is seen only by it.
liveness_port = flags.get("--liveness-port", "")
check(liveness_port.isdigit() and int(liveness_port) > 0,
      "--liveness-port is not a fixed port (watching peers must reach the UDP door through firewalls)")
udp_ports = [p for p in container.get("ports", []) if p.get("protocol") == "UDP"]
check(any(str(p.get("containerPort")) == liveness_port for p in udp_ports),
      "no UDP container port for --liveness-port")

# Prometheus annotations name --metrics-listen's port and path.
metrics_port = flags.get("--metrics-listen", ":").rsplit(":", 1)[1]
annotations = meta.get("annotations", {})
check(annotations.get("prometheus.io/scrape") == "true", "no prometheus.io/scrape annotation")
check(annotations.get("prometheus.io/port") == metrics_port, "prometheus.io/port is not --metrics-listen's")
check(annotations.get("prometheus.io/path") == "/metrics", "prometheus.io/path is not /metrics")

# The local door on a hostPath shared with engine pods.
mounts = {m["name"]: m for m in container["volumeMounts"]}
volumes = {v["name"]: v for v in pod["volumes"]}
socket_dir = flags["--local-socket"].rsplit("/", 1)[0]
door = [n for n, m in mounts.items() if m["mountPath"] == socket_dir]
check(door and "hostPath" in volumes[door[0]], f"--local-socket's folder {socket_dir} is not a hostPath")

# Certificates from a Secret, at the paths the --tls-* flags name.
tls = [n for n, v in volumes.items() if "secret" in v]
check(len(tls) == 1, "no Secret volume for the certificates")
if tls:
    tls_dir = mounts[tls[0]]["mountPath"]
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        check(flags.get(flag, "").startswith(tls_dir + "/"), f"{flag} is not in the Secret's mount")

# CUDA IPC: the host's IPC and PID namespaces; not privileged, only IPC_LOCK, not root.
check(pod.get("hostIPC") is True, "hostIPC is not true")
check(pod.get("hostPID") is True, "hostPID is not true")
sc = container["securityContext"]
check(not sc.get("privileged", False), "the container is privileged")
check(sc["capabilities"]["add"] == ["IPC_LOCK"], "capabilities.add is not exactly IPC_LOCK")
check(sc["capabilities"]["drop"] == ["ALL"], "capabilities.drop is not ALL")
check(pod["securityContext"].get("runAsNonRoot") is True, "runAsNonRoot is not set")

# Resource requests, and the directory's address from the ConfigMap.
check("cpu" in container["resources"]["requests"], "no cpu request")
check("memory" in container["resources"]["requests"], "no memory request")
env = {e["name"]: e for e in container["env"]}
directory = flags.get("--directory", "")
m = re.fullmatch(r"\$\((\w+)\)", directory)
check(m is not None, "--directory is not taken from an environment variable")
if m:
    ref = env.get(m.group(1), {}).get("valueFrom", {}).get("configMapKeyRef", {})
    check(ref.get("name") == docs["ConfigMap"]["metadata"]["name"], "--directory is not from the ConfigMap")
    check(docs["ConfigMap"]["data"].get(ref.get("key", ""), "").startswith("etcd://"),
          "the ConfigMap's directory is not etcd://...")

if failures:
    print("deploy/kubernetes:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"deploy/kubernetes: {len(flags)} flags, probes, annotations, mounts and namespaces checked")
