"""How the connectors reach their agent (Route): the session's fast path ring
(fast_path.py) when the session can open one, gRPC otherwise, chosen once.

Over the ring a transfer is a future (RingTransfer: done(), result(timeout), cancel(),
as client.Transfer) completed by reaping, and reaping happens inside the connector's
own calls (done(), notifications(): vLLM's get_finished, SGLang's poll); no thread of
ours, and a poll never waits. When the agent delivers notifications on the ring, the
ring watches them (one watch per ring) and the same reaps take them; else they are
polled with gRPC PollNotifications, as before the ring.
"""
import itertools
import logging
import threading
import time

from . import errors
from ._proto import kvagent_pb2 as pb
from .client import ChunkedTransfer, Notification, Transfer
from .fast_path import CANCEL, NOTIFICATION, WATCH_NOTIFICATIONS, FastPath

log = logging.getLogger("kvagent.connectors")

MODES = ("auto", "on", "off")
WATCH = 1  # user_data of the ring's notification watch; other entries count from 2
ENDED_BADLY = {"FAILED", "CANCELLED", "TIMED_OUT"}


def fast_path_mode(value, where):
    """'auto' (the ring when the session can open one; the default), 'on' (the ring or
    an error) or 'off' (gRPC only), from a knob's value (None and "" mean auto)."""
    mode = "auto" if value is None or value == "" else str(value).strip().lower()
    if mode not in MODES:
        raise errors.invalid(where, f"fast_path is {value!r}", "use 'auto' (the ring when the "
                             "agent serves one), 'on' (the ring or an error) or 'off' (gRPC only)")
    return mode


class Route:
    """A connector's way to its agent: `kind` is "fast_path" or "grpc" (`why` says why
    gRPC), `watching` whether notifications come on the ring. Calls from one thread at a
    time are the connectors' case; a lock keeps other threads' calls apart."""

    def __init__(self, client, mode="auto", slots=0, owner="connector"):
        self.client = client
        self.owner = owner
        self.ring = None
        self.watching = False
        self.why = "fast_path is 'off'"
        # Whole transfers sent through gRPC: the ring stayed full after a reap, or the
        # entry was larger than half the ring.
        self.grpc_fallbacks = 0
        self._entries = {}  # user_data -> RingTransfer waiting for its completion
        self._notes = []    # notifications reaped, not yet handed out
        self._ids = itertools.count(WATCH + 1)
        self._lock = threading.RLock()
        mode = fast_path_mode(mode, f"{owner}: fast_path")
        if mode != "off":
            try:
                self.ring = FastPath(client, submission_slots=slots, completion_entries=slots)
            except errors.KvAgentError as e:
                if mode == "on":
                    raise
                self.why = f"the session could not open a fast path ring: {e}"
        if self.ring is not None and self.ring.delivers_notifications():
            self.ring.watch_notifications(user_data=WATCH)
            self.watching = True
        log.info("%s", self.describe())

    @property
    def kind(self):
        return "fast_path" if self.ring is not None else "grpc"

    def describe(self):
        if self.ring is None:
            return f"{self.owner}: transfers and notifications through gRPC ({self.why})"
        notes = ("on the ring" if self.watching else "by gRPC PollNotifications (this agent's "
                 "ring does not deliver them)")
        return f"{self.owner}: transfers through the fast path ring, notifications {notes}"

    # ---- transfers ---------------------------------------------------------------
    def transfer(self, peer, request_id, **terms):
        """client.transfer's future: through the ring, or through gRPC when the ring is
        gone, stayed full after a reap or is too small for it (counted in grpc_fallbacks)."""
        with self._lock:
            if self.ring is not None:
                request = self.client._transfer_request(peer, request_id, **terms)
                t = RingTransfer(self, request.transfer_id)
                if self._put(t, lambda u: self.ring.submit(request, u), wait=False):
                    return t
        return self.client.transfer(peer, request_id, **terms)

    def open_transfer(self, peer, request_id, op="write", timeout_ms=0, remote_groups=None,
                      complete_when="acknowledged"):
        """client.open_transfer's chunked transfer, its chunks through the ring
        (complete_when checked here, sent on chunk 0)."""
        return RingChunkedTransfer(self, peer, request_id, op, timeout_ms, remote_groups,
                                   complete_when)

    def _put(self, transfer, put, wait):
        """Puts one entry for `transfer`. A full ring is reaped and tried again: once
        (wait False: then False, the caller goes through gRPC) or until the client's
        timeout (wait True: then ResourceExhausted). False too when the ring is gone."""
        user_data = next(self._ids)
        deadline = time.monotonic() + (self.client.timeout if wait else 0)
        tries = 0
        while self.ring is not None:
            try:
                self._entries[user_data] = transfer
                put(user_data)
                transfer._user_data = user_data
                return True
            except errors.ResourceExhausted as e:
                del self._entries[user_data]
                full = e
            except errors.InvalidArgument:  # more than half the ring: too large for it
                del self._entries[user_data]
                if wait:
                    raise
                self.grpc_fallbacks += 1
                return False
            except errors.FailedPrecondition as e:  # the agent closed the ring
                del self._entries[user_data]
                self._lose_ring(e.message)
                return False
            tries += 1
            if tries > 1 and time.monotonic() >= deadline:
                if wait:
                    raise full
                self.grpc_fallbacks += 1
                log.debug("%s: the ring stayed full; transfer '%s' goes through gRPC",
                          self.owner, transfer.id)
                return False
            self.progress(0.001 if tries > 1 else 0)
        return False

    def cancel(self, transfer):
        """Cancels through the ring (after the transfer's own entry, so never before the
        agent has it); waits up to the client's timeout for the answer, as gRPC's
        CancelTransfer would; returns the TransferState the answer carries."""
        with self._lock:
            answer = RingTransfer(self, transfer.id)
            if not self._put(answer, lambda u: self.ring.cancel(transfer.id, u), wait=True):
                return None  # the ring went meanwhile: the caller cancels through gRPC
        c = answer._wait(self.client.timeout, "cancelling")
        if c is None:
            return answer._grpc.cancel()
        if not c.ok and c.phase == "":
            raise errors.error(c.code, c.message, where=f"cancelling transfer '{transfer.id}' "
                               "(fast path)")
        return answer._state(c)

    # ---- reaping -----------------------------------------------------------------
    def progress(self, timeout=0.0):
        """Reaps what the ring has (waiting up to `timeout` s for the first) and hands
        each completion to its transfer, each notification to notifications()."""
        # Without a timeout this never waits, not even for another thread's reap (what
        # that one reaps is dispatched all the same).
        if not self._lock.acquire(blocking=timeout > 0):
            return
        try:
            if self.ring is None:
                return
            try:
                got = self.ring.reap(max_count=256, timeout=timeout)
            except errors.KvAgentError as e:  # closed by the agent, nothing left to read
                return self._lose_ring(e.message)
            for c in got:
                self._dispatch(c)
            if not got:
                reason = self.ring.closed_reason()
                if reason:
                    self._lose_ring(reason)
        finally:
            self._lock.release()

    def _dispatch(self, c):
        if c.opcode == NOTIFICATION:
            if c.notification is None:  # the ring says it does not parse: logged, lost
                log.error("%s: %s", self.owner, c.message)
            else:
                self._notes.append(Notification(self.client, c.notification, ""))
        elif c.opcode == WATCH_NOTIFICATIONS:
            if not c.ok:
                self.watching = False
                log.warning("%s: the ring refused to watch notifications (%s); polling them "
                            "with gRPC instead", self.owner, c.message)
        else:
            transfer = self._entries.pop(c.user_data, None)
            if transfer is None:
                log.error("%s: a fast path completion for unknown entry %d (%r)", self.owner,
                          c.user_data, c)
            else:
                transfer._completion = c

    def notifications(self):
        """The notifications that came since the last call (each taken once): reaped
        from the ring when it watches, else one gRPC PollNotifications."""
        with self._lock:
            self.progress()
            out, self._notes = self._notes, []
            if self.watching or (out and self.why == "closed"):
                # (Closed: those the ring held come alone, the client may be gone.)
                return out
        return out + self.client.poll_notifications()

    def _lose_ring(self, reason):
        """The ring is gone (closed by the agent, or by close()): transfers still
        waiting for a completion are followed through gRPC, new ones go there."""
        if self.ring is None:
            return
        log.warning("%s: the fast path ring is closed (%s); transfers and notifications go "
                    "through gRPC from now on", self.owner, reason)
        self.why = f"the fast path ring closed: {reason}"
        ring, self.ring, self.watching = self.ring, None, False
        for c in ring.close():  # what the agent wrote before it closed the ring
            self._dispatch(c)
        for transfer in self._entries.values():
            transfer._grpc = Transfer(self.client, transfer.id,
                                      pb.TransferState(transfer_id=transfer.id, phase=pb.PENDING))
        self._entries.clear()

    def close(self):
        """Closes the ring and keeps the session (a client given to the connector stays
        its owner's): the agent stops writing on the ring, so notifications after this
        stay with gRPC (client.poll_notifications()). What the ring held is reaped: its
        notifications are kept for the next notifications() call, completions reach their
        transfers; transfers still waiting are followed through gRPC."""
        with self._lock:
            if self.ring is not None:
                self.progress()
                ring, self.ring, self.watching = self.ring, None, False
                for c in ring.close():
                    self._dispatch(c)
                for transfer in self._entries.values():
                    transfer._grpc = Transfer(self.client, transfer.id, pb.TransferState(
                        transfer_id=transfer.id, phase=pb.PENDING))
                self._entries.clear()
                self.why = "closed"
                if self._notes:
                    log.info("%s: %d notifications reaped while closing the ring, kept for "
                             "the next notifications() call", self.owner, len(self._notes))


class RingTransfer:
    """A transfer submitted through the ring, with client.Transfer's surface: done()
    reaps without waiting, result(timeout) reaps until it ended, cancel(). A refusal
    raises the agent's KvAgentError from result(); a transfer that ended FAILED,
    CANCELLED or TIMED_OUT raises TransferFailed with its whole TransferState (read with
    GetTransfer then: the failed segment, a message the ring cut). A completed one's
    state holds what a completion carries (phase, bytes_done, latency_us), not the whole
    TransferState gRPC returns; state() reads that one (GetTransfer): complete_when,
    and with complete_when="placed" peer_acknowledged / peer_note, which the agent sets
    after COMPLETED. A chunk's entry (more_chunks) is done once the agent took it."""

    def __init__(self, route, transfer_id, chunks=()):
        self.route = route
        self.client = route.client
        self.id = transfer_id
        self.last_state = pb.TransferState(transfer_id=transfer_id, phase=pb.PENDING,
                                           failed_segment=-1)
        self.chunks = list(chunks)  # earlier chunks: a refusal there is this transfer's error
        self._user_data = 0
        self._completion = None
        self._grpc = None  # a client.Transfer once the ring is gone

    def done(self):
        if self._completion is None and self._grpc is None:
            self.route.progress()
        if self._grpc is not None:
            return self._grpc.done()
        return self._completion is not None

    def state(self):
        """The agent's whole TransferState, read with gRPC GetTransfer (the ring carries
        outcomes only), as client.Transfer.state()."""
        if self._grpc is not None:
            return self._grpc.state()
        self.last_state = Transfer(self.client, self.id, self.last_state).state()
        return self.last_state

    def _wait(self, timeout, doing):
        """This entry's completion within `timeout` s; None when the ring went (then
        _grpc follows the transfer)."""
        deadline = time.monotonic() + timeout
        while self._completion is None and self._grpc is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.error(4, f"transfer '{self.id}': no answer from the fast path in "
                                   f"{timeout} s; call result() again, or cancel() it",
                                   where=f"{doing} transfer '{self.id}'")
            self.route.progress(min(left, 0.01))
        return self._completion

    def result(self, timeout=60.0):
        start = time.monotonic()
        c = self._wait(timeout, "waiting for")
        if c is None:
            return self._grpc.result(max(timeout - (time.monotonic() - start), 0.001))
        for chunk in self.chunks:
            chunk._raise_refusal()
        if c.code != 0 and c.phase not in ENDED_BADLY:
            raise self._refusal(c)
        state = self._state(c)
        if state.phase != pb.COMPLETED and c.phase in ENDED_BADLY:
            try:  # the whole state, as gRPC's result() raises it
                whole = self.client.call("GetTransfer", pb.GetTransferRequest(transfer_id=self.id),
                                         f"transfer '{self.id}'")
                if whole.phase == state.phase:
                    state = whole
            except errors.KvAgentError:
                pass  # the record is gone: the completion's code and message stay
            self.last_state = state
            raise errors.TransferFailed(state)
        return state

    def _state(self, c):
        self.last_state = pb.TransferState(
            transfer_id=self.id, phase=pb.TransferPhase.Value(c.phase) if c.phase else pb.PENDING,
            error_code=c.code, error_message=c.message, failed_segment=-1,
            bytes_done=c.bytes_done, latency_us=c.latency_us)
        return self.last_state

    def _refusal(self, c):
        return errors.error(c.code, c.message, where=f"transfer '{self.id}' (fast path)")

    def _raise_refusal(self):
        c = self._completion
        if c is not None and c.code != 0 and c.phase not in ENDED_BADLY:
            raise self._refusal(c)

    def cancel(self):
        if self._grpc is None:
            state = self.route.cancel(self)
            if state is not None:
                return state
        if self._grpc is None:
            self._grpc = Transfer(self.client, self.id, self.last_state)
        return self._grpc.cancel()


class RingChunkedTransfer(ChunkedTransfer):
    """client.ChunkedTransfer through the ring: send() each chunk, finish() the last;
    finish() returns the transfer's RingTransfer. The first chunk chooses the route:
    when the ring is gone or stays full, every chunk of this transfer goes through
    gRPC; later chunks wait for room (up to the client's timeout), since a chunk through
    gRPC could overtake one still on the ring."""

    def __init__(self, route, peer, request_id, op, timeout_ms, remote_groups,
                 complete_when="acknowledged"):
        super().__init__(route.client, peer, request_id, op, timeout_ms, remote_groups,
                         complete_when)
        self.route = route
        self._sent = []
        self._grpc = None

    def _submit(self, more, **terms):
        if self._grpc is None:
            with self.route._lock:
                if self.route.ring is not None:
                    request = self.client._transfer_request(
                        **self.args, **terms, chunk=self.chunk, more_chunks=more,
                        complete_when=self._chunk_completion())
                    t = RingTransfer(self.route, request.transfer_id,
                                     chunks=() if more else self._sent)
                    if self.route._put(t, lambda u: self.route.ring.submit(request, u),
                                       wait=self.chunk > 0):
                        self.chunk += 1
                        self._sent.append(t)
                        return t
            self._grpc = ChunkedTransfer(self.client, **self.args,
                                         complete_when=self.complete_when)
            self._grpc.chunk = self.chunk
        return self._grpc._submit(more, **terms)

    def check(self):
        """Raises the agent's refusal of a chunk sent so far, if one came (reaps without
        waiting): what ChunkedTransfer.send() raises at once."""
        if self._sent:
            self.route.progress()
        for chunk in self._sent:
            chunk._raise_refusal()
