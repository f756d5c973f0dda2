#!/usr/bin/env python3
"""Generates kvagent's Python stubs (kvagent_pb2.py, kvagent_pb2_grpc.py) from
proto/kvagent.proto with Debian's protoc and grpc_python_plugin, offline.

Used by the Bazel genrule (//python:kvagent_proto_py) and by setup.py, so both build
the stubs the same way. The gRPC stub imports its messages with a package-relative
import, so the pair works as the subpackage kvagent._proto.

usage: gen_stubs.py PROTO OUT_DIR
"""
import os
import subprocess
import sys

PROTOC = "/usr/bin/protoc"
GRPC_PLUGIN = "/usr/bin/grpc_python_plugin"


def generate(proto, out_dir):
    for tool, package in ((PROTOC, "protobuf-compiler"), (GRPC_PLUGIN, "protobuf-compiler-grpc")):
        if not os.access(tool, os.X_OK):
            sys.exit(f"gen_stubs: {tool} not found; install Debian's {package} "
                     "(deploy/bootstrap.sh does)")
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([PROTOC, f"--proto_path={os.path.dirname(os.path.abspath(proto))}",
                    f"--python_out={out_dir}", f"--grpc_out={out_dir}",
                    f"--plugin=protoc-gen-grpc={GRPC_PLUGIN}", os.path.basename(proto)],
                   check=True)
    grpc_stub = os.path.join(out_dir, "kvagent_pb2_grpc.py")
    with open(grpc_stub, encoding="utf-8") as f:
        text = f.read()
    text = text.replace("import kvagent_pb2 as kvagent__pb2",
                        "from . import kvagent_pb2 as kvagent__pb2")
    with open(grpc_stub, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    generate(sys.argv[1], sys.argv[2])
