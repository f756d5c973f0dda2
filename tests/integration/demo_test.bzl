"""One sh_test per demo configuration: the script runs `kvagentctl demo --json` with
DEMO_ARGS and checks the JSON line against the EXPECT_* values in `env`."""

def demo_test(name, env = {}):
    native.sh_test(
        name = name,
        size = "medium",
        srcs = ["demo_test.sh"],
        data = [
            "//agent:kvagentd",
            "//cli:kvagentctl",
        ],
        env = env,
    )
