"""kvagent's exceptions: every failure, the agent's or this client's, is a KvAgentError
carrying the gRPC status code, the entry at fault and the fix.

The agent's own message is kept intact in `message` (its texts name the entry, the
cause and the fix: "segment 0: remote index 99 ... is out of range ...; use indices
below num_items"); `entry` and `fix` are read from it (what precedes the cause's last ": ", and
what follows the last "; ") or, for checks this client makes itself, given explicitly.
"""
import grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class KvAgentError(Exception):
    """A refused call or a failed transfer."""

    def __init__(self, code, message, entry=None, fix=None, where=None):
        if isinstance(code, int):
            code = _CODES.get(code, grpc.StatusCode.UNKNOWN)
        self.code = code
        self.message = message
        self.entry = entry if entry is not None else _entry_of(message)
        self.fix = fix if fix is not None else _fix_of(message)
        self.where = where  # what this client was doing: "RegisterRegions", "transfer 'r1'"
        super().__init__(f"{code.name}: {where + ': ' if where else ''}{message}")


class InvalidArgument(KvAgentError):
    pass


class NotFound(KvAgentError):
    pass


class PermissionDenied(KvAgentError):
    pass


class FailedPrecondition(KvAgentError):
    pass


class Unavailable(KvAgentError):
    pass


class DeadlineExceeded(KvAgentError):
    pass


class ResourceExhausted(KvAgentError):
    pass


class Unauthenticated(KvAgentError):
    pass


class TransferFailed(KvAgentError):
    """A transfer ended FAILED, CANCELLED or TIMED_OUT; `state` is its last TransferState
    (error_code, error_message, failed_segment)."""

    def __init__(self, state):
        from ._proto import kvagent_pb2 as pb
        phase = pb.TransferPhase.Name(state.phase)
        code = state.error_code or (grpc.StatusCode.CANCELLED.value[0] if phase == "CANCELLED"
                                    else grpc.StatusCode.UNKNOWN.value[0])
        text = state.error_message or f"the transfer ended {phase}"
        segment = f" (segment {state.failed_segment})" if state.failed_segment >= 0 else ""
        super().__init__(code, text, where=f"transfer '{state.transfer_id}' {phase}{segment}")
        self.state = state
        self.phase = phase


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def _entry_of(message):
    cause = message.partition("; ")[0]
    head, sep, _ = cause.rpartition(": ")
    return head if sep and len(head) < 300 else None


def _fix_of(message):
    _, sep, tail = message.rpartition("; ")
    return tail if sep else None


def error(code, message, entry=None, fix=None, where=None):
    """The KvAgentError subclass for `code` (a grpc.StatusCode or its number)."""
    if isinstance(code, int):
        code = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, KvAgentError)(code, message, entry=entry, fix=fix, where=where)


def from_rpc(err, where):
    """A grpc.RpcError (sync or aio) as a KvAgentError with the agent's text intact."""
    return error(err.code(), err.details() or "", where=where)


def invalid(entry, cause, fix, where=None):
    """An INVALID_ARGUMENT found by this client before anything reached the agent."""
    return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, f"{entry}: {cause}; {fix}",
                           entry=entry, fix=fix, where=where)
