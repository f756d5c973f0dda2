"""kvagent: the Python client of the kvagent transfer agent.

    import kvagent
    agent = kvagent.connect("/run/kvagent/kvagent.sock")
    k = [agent.empty((pages, 16, 8, 128), torch.bfloat16) for _ in range(layers)]
    ...
    agent.register_kv_cache(k, v)
    agent.transfer("decode", "req-1", pages=([1, 2], [7, 8])).result()

connect() is the blocking client (client.py); kvagent.aio.connect() the asyncio one.
"""
from ._core import byte_segment, items_segment
from ._proto import kvagent_pb2 as pb
from .client import ChunkedTransfer, Client, Notification, Transfer, connect
from .errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, KvAgentError,
                     NotFound, PermissionDenied, ResourceExhausted, TransferFailed, Unauthenticated,
                     Unavailable)
from .memory import SharedBuffer

__all__ = [
    "connect", "Client", "Transfer", "ChunkedTransfer", "Notification", "SharedBuffer", "pb",
    "byte_segment", "items_segment", "KvAgentError", "InvalidArgument", "NotFound",
    "PermissionDenied", "FailedPrecondition", "Unavailable", "DeadlineExceeded",
    "ResourceExhausted", "Unauthenticated", "TransferFailed",
]
