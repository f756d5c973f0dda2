"""Connectors in the shapes SGLang's and vLLM's disaggregation layers call (sglang.py,
vllm.py), built on kvagent.Client. Neither framework is imported: the classes follow
their public interfaces, so a thin subclass inside each framework can wire them."""
from .._core import completion_point
from .._proto import kvagent_pb2 as pb

_POINT_NAMES = {pb.COMPLETE_WHEN_ACKNOWLEDGED: "acknowledged", pb.COMPLETE_WHEN_PLACED: "placed"}


def completion_setting(value, setting):
    """A connector's complete_when setting as "acknowledged" (also when unset: None) or
    "placed", checked when the connector is built so that a typo stops it before it
    registers or submits anything. The client's completion_point() checks it (the pb
    CompletionPoint values and names are taken too); anything else raises
    InvalidCompletionPoint (a ValueError) naming `setting`, the value and both choices."""
    if value is None:
        return "acknowledged"
    return _POINT_NAMES[completion_point(value, setting)]
