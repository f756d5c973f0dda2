"""Compiles a .proto with Debian's protoc and grpc_cpp_plugin into two cc_librarys.

Bazel 4's own proto rules want to fetch protobuf's sources; the system compiler and
plugin match the system libraries we link, so a genrule run from the workspace root
does the job offline. `<name>` holds the messages (protobuf only, for layers below
agent/ that must not know gRPC); `<name>_grpc` adds the service stubs.
"""

def cc_grpc_proto_library(name, src, **kwargs):
    base = src[:-len(".proto")]
    pkg = native.package_name()
    native.genrule(
        name = name + "_gen",
        srcs = [src],
        outs = [
            base + ".pb.h",
            base + ".pb.cc",
            base + ".grpc.pb.h",
            base + ".grpc.pb.cc",
        ],
        cmd = ("/usr/bin/protoc --proto_path=. " +
               "--cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin " +
               pkg + "/" + src),
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc"],
        hdrs = [base + ".pb.h"],
        deps = ["//third_party:protobuf"],
        **kwargs
    )
    native.cc_library(
        name = name + "_grpc",
        srcs = [base + ".grpc.pb.cc"],
        hdrs = [base + ".grpc.pb.h"],
        deps = [
            ":" + name,
            "//third_party:grpc",
        ],
        **kwargs
    )
