"""Functions kvagentd puts in front of a shared library's own (libc's, UCX's)."""

def stand_in(name, srcs, symbols, deps):
    """A library that defines `symbols` for kvagentd only.

    It is linked whole and its symbols are exported from the binary, so that the shared
    libraries calling them (libucp, libuct, libucs, UCX's modules) bind to these
    definitions; each reaches the library's own with dlsym(RTLD_NEXT).

    Args:
      name: the target.
      srcs: the stand-ins' sources.
      symbols: the functions they define, each exported.
      deps: what they call.
    """
    native.cc_library(
        name = name,
        srcs = srcs,
        linkopts = ["-Wl,--export-dynamic-symbol=" + s for s in symbols] + ["-ldl"],
        alwayslink = True,
        deps = deps,
    )
