"""kvagent_fuzz_target: one fuzz target, built two ways (fuzz/run.sh runs the first).

  <name>          the fuzzer: libFuzzer + ASan/UBSan under --config=fuzz (clang), else a
                  standalone driver that runs the files it is given (gcc)
  <name>_replay   cc_test: seeds, regressions and deterministic mutations (gcc, //...)
  <name>_seeds    the seed corpus: seeds/<corpus>/*.textpb (text protos: the replay test
                  parses them, fuzz/run.sh encodes them with protoc for libFuzzer)
"""

def kvagent_fuzz_target(name, corpus, srcs, deps, replay_size = "small"):
    native.filegroup(
        name = name + "_seeds",
        srcs = native.glob(["seeds/%s/*.textpb" % corpus]),
    )
    native.filegroup(
        name = name + "_regressions",
        srcs = native.glob(["regressions/%s/**" % corpus]),
    )
    native.cc_library(
        name = name + "_lib",
        srcs = srcs,
        deps = deps + [":fuzz_check", ":fuzz_target"],
        alwayslink = True,
    )
    native.cc_binary(
        name = name,
        deps = [":" + name + "_lib"] + select({
            ":libfuzzer": [":libfuzzer_mutator"],
            "//conditions:default": [":standalone_main"],
        }),
        linkopts = select({
            ":libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
    )
    native.cc_test(
        name = name + "_replay",
        size = replay_size,
        srcs = ["replay_test.cc"],
        data = [":" + name + "_seeds", ":" + name + "_regressions"],
        deps = [
            ":" + name + "_lib",
            ":corpus_files",
            ":mutator",
            "//tests/unit:catch_main",
            "//third_party:catch2",
            "//third_party:fmt",
        ],
    )
