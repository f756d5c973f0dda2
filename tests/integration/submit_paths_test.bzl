"""Two cc_tests of one source: NAME submits through gRPC's SubmitTransfer, NAME_fast
through the local fast path (agent_pair's SubmitThrough reads KVAGENT_TEST_SUBMIT), so
the same cases check both submission paths."""

def submit_paths_test(name, srcs, deps):
    for suffix, env in [("", {}), ("_fast", {"KVAGENT_TEST_SUBMIT": "fast"})]:
        native.cc_test(
            name = name + suffix,
            size = "medium",
            srcs = srcs,
            env = env,
            data = ["//agent:kvagentd"],
            deps = deps,
        )
