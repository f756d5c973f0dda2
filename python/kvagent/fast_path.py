"""The local fast path from Python (client/fast_ring.h's layout): a submission ring and
a completion ring in a memfd the agent creates for the session, mapped here, with two
eventfd doorbells. Transfers go in as serialized SubmitTransferRequests, many per
doorbell, and their outcomes come back in batches: the same checks, states and
errors as gRPC's SubmitTransfer, without a round trip per transfer. A ring that
watches (watch_notifications) also gets the session's notifications as completions,
each taken once (not by gRPC's WatchNotifications/PollNotifications too), or, through a
durable subscription, held by the agent until ack_notifications (at-least-once).

Memory order: the ring's counters are 32-bit words written and read through a
memoryview (single aligned loads and stores). x86-64 keeps stores in order (an entry's
bytes are visible before the sq_tail that publishes it); the store-then-load of the
doorbell handshake needs a full fence, which an uncontended lock's atomic exchange
gives there. Other architectures are refused. Waits also wake every millisecond, so a
missed doorbell costs at most that.
"""
import logging
import mmap
import os
import platform
import select
import struct
import threading
import time
import weakref

from . import errors
from ._proto import kvagent_pb2 as pb

log = logging.getLogger("kvagent.fast_path")

VERSION, MAGIC, SLOT_BYTES, COMPLETION_BYTES = 1, 0x5246564B, 256, 512
PAD, SUBMIT, CANCEL, PING, WATCH_NOTIFICATIONS, NOTIFICATION = 0, 1, 2, 3, 4, 5
ACK_NOTIFICATIONS = 6
SLEEPING = WAITING = 1
WAIT_COUNT = 2  # client, with WAITING: ring only once cq_tail reaches WAKE_AT
CLOSED = 2
ROOM_WANTED = 4  # agent: notifications wait for room (ring the doorbell after reaping)
FEATURE_NOTIFICATIONS = 1  # FastPathInfo.features: the ring takes WATCH_NOTIFICATIONS
# ... a watch with a subscription, and ACK_NOTIFICATIONS
FEATURE_DURABLE_NOTIFICATIONS = 2
FEATURE_WAKE_COUNT = 4  # ... and rings a client waiting for a count only once it came
REASON_OFFSET, REASON_BYTES = 1024, 3072
# How long a FastPath dropped without close() waits for the agent's answer to its close
# (the session's timeout if shorter), as C++ ~FastPath does.
CLOSE_ON_DROP_S = 1.0
HEADER = struct.Struct("<IHHIIQ")        # SubmissionHeader: 24 bytes
COMPLETION = struct.Struct("<QHHiIIQQ")  # CompletionHeader: 40 bytes
# Word indices of the counters (one cache line each after the 64-byte header).
SQ_TAIL, SQ_HEAD, CQ_TAIL, CQ_HEAD, AGENT_FLAGS, CLIENT_FLAGS, WAKE_AT = (
    16, 32, 48, 64, 80, 96, 112)


class Completion:
    """One entry's outcome: user_data, opcode, code (a gRPC code number; 0 OK), phase
    (TransferPhase name for submit/cancel), bytes_done, latency_us, message. A
    notification (opcode NOTIFICATION, the watch entry's user_data) has it in
    `notification` (a pb Notification; its kind there, phase empty; its `sequence` on a
    durable watch), else None; a notification the agent could not fit on the ring
    (durable watch) has code 8 (RESOURCE_EXHAUSTED), no notification, and names its
    sequence in message. An ACK_NOTIFICATIONS completion's bytes_done is how many were
    released."""

    def __init__(self, data, message, notification=None):
        (self.user_data, self.opcode, _, self.code, phase, _, self.bytes_done,
         self.latency_us) = data
        self.phase = pb.TransferPhase.Name(phase) if phase and notification is None else ""
        self.message = message
        self.notification = notification

    @property
    def ok(self):
        return self.code == 0

    def error(self):
        """The refusal or the transfer's error as a KvAgentError (None when OK)."""
        return None if self.ok else errors.error(self.code, self.message,
                                                 where=f"fast path entry {self.user_data}")

    def __repr__(self):
        return f"Completion({self.user_data}, code={self.code}, {self.phase or self.opcode})"


class FastPath:
    """The session's ring pair (one per session). submit/cancel/ping from one thread
    at a time, reap from one thread at a time."""

    def __init__(self, client, submission_slots=0, completion_entries=0):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise errors.error(9, f"the Python fast path runs on x86-64 only (this is "
                               f"{platform.machine()}); submit through gRPC (client.transfer)")
        request = pb.SessionRequest()
        request.open_fast_path.submission_slots = submission_slots
        request.open_fast_path.completion_entries = completion_entries
        reply, fds = client.session.call(request, what="opening the fast path")
        self.info = reply.fast_path
        if (len(fds) != 3 or self.info.version != VERSION or self.info.slot_bytes != SLOT_BYTES
                or self.info.completion_bytes != COMPLETION_BYTES):
            for fd in fds:
                os.close(fd)
            raise errors.error(9, "the agent's fast path ring does not match this client (ring "
                               f"version {self.info.version}); use a matching kvagent package")
        self.client = client
        ring_fd, self.submit_fd, self.complete_fd = fds
        self._mmap = mmap.mmap(ring_fd, self.info.ring_bytes, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(ring_fd)
        self._words = memoryview(self._mmap).cast("I")
        if self._words[0] != MAGIC or self._words[1] != VERSION:
            raise errors.error(9, "the fast path ring file's header is not this client's layout")
        self.slots = self.info.submission_slots
        self.entries = self.info.completion_entries
        self._tail = self._words[SQ_TAIL]
        self._cq_head = self._words[CQ_HEAD]
        self._fence_lock = threading.Lock()
        self.transfers_running = 0  # set by close(): transfers the ring's close left running
        # A ring dropped without close() is closed at garbage collection. The finalizer
        # holds the session weakly: it never keeps a session alive (a session collected
        # with its ring ends, and its end closes the ring).
        self._finalizer = weakref.finalize(self, _close_dropped, weakref.ref(client.session),
                                           self._mmap, self.submit_fd, self.complete_fd)

    def _fence(self):
        with self._fence_lock:  # an atomic exchange: a full barrier on x86-64
            pass

    def closed_reason(self):
        if not self._words[AGENT_FLAGS] & CLOSED:
            return ""
        raw = bytes(self._mmap[REASON_OFFSET:REASON_OFFSET + REASON_BYTES]).split(b"\0")[0]
        return raw.decode(errors="replace") or "the agent closed this fast path"

    def _put(self, opcode, user_data, payload):
        max_payload = (self.slots // 2) * SLOT_BYTES - HEADER.size
        if len(payload) > max_payload:
            raise errors.invalid(f"fast path entry {user_data}", f"{len(payload)} bytes exceed "
                                 f"the ring's {max_payload}", "split the transfer into chunks, "
                                 "open the ring with more slots, or submit through gRPC")
        reason = self.closed_reason()
        if reason:
            raise errors.error(9, reason, where="fast path")
        need = (HEADER.size + len(payload) + SLOT_BYTES - 1) // SLOT_BYTES
        used = (self._tail - self._words[SQ_HEAD]) & 0xFFFFFFFF
        index = self._tail & (self.slots - 1)
        pad = self.slots - index if need > self.slots - index else 0
        if pad + need > self.slots - min(used, self.slots):
            raise errors.error(8, f"the fast path's submission ring is full ({used} of "
                               f"{self.slots} slots wait for the agent); reap completions, then "
                               "submit again", where="fast path")
        base = self.info.submission_offset
        if pad:
            at = base + index * SLOT_BYTES
            self._mmap[at:at + HEADER.size] = HEADER.pack(0, PAD, pad, 0, 0, 0)
            self._tail = (self._tail + pad) & 0xFFFFFFFF
        at = base + (self._tail & (self.slots - 1)) * SLOT_BYTES
        self._mmap[at + HEADER.size:at + HEADER.size + len(payload)] = payload
        self._mmap[at:at + HEADER.size] = HEADER.pack(len(payload), opcode, need, 0, 0, user_data)
        self._tail = (self._tail + need) & 0xFFFFFFFF
        self._words[SQ_TAIL] = self._tail  # publishes: x86 keeps the stores above first
        self._fence()
        if self._words[AGENT_FLAGS] & SLEEPING:
            os.write(self.submit_fd, (1).to_bytes(8, "little"))

    def submit(self, request, user_data):
        """Puts a SubmitTransferRequest on the ring and publishes it."""
        self._put(SUBMIT, user_data, request.SerializeToString())

    def transfer(self, user_data, peer, request_id, **engine_terms):
        """submit() of the request client.transfer would send (pages, slots, aux, ...,
        complete_when="acknowledged"|"placed"; a bad value raises ValueError, nothing
        written). A completion's phase is the transfer's end: with "placed" it comes as
        soon as every byte is in place; gRPC GetTransfer tells peer_acknowledged later."""
        self.submit(self.client._transfer_request(peer, request_id, **engine_terms), user_data)

    def cancel(self, transfer_id, user_data):
        self._put(CANCEL, user_data, str(transfer_id).encode())

    def ping(self, user_data):
        self._put(PING, user_data, b"")

    def delivers_notifications(self):
        """Whether the agent takes watch_notifications on this ring (FastPathInfo.features)."""
        return bool(self.info.features & FEATURE_NOTIFICATIONS)

    def delivers_durable_notifications(self):
        """Whether the agent takes a watch with a subscription, and ack_notifications."""
        return bool(self.info.features & FEATURE_DURABLE_NOTIFICATIONS)

    def _require_durable(self, what):
        if not self.delivers_durable_notifications():
            raise errors.error(
                9, f"{what}: this agent's fast path has no durable subscriptions (it is older "
                "than this client: FastPathInfo.features lacks durable notifications); use gRPC "
                "WatchNotifications / AckNotifications with the subscription, or upgrade the "
                "agent", where=what)

    def watch_notifications(self, transfer_ids=(), user_data=0, subscription=""):
        """Asks the agent to post this session's notifications (of transfer_ids; empty:
        any) on the completion ring, as NOTIFICATION completions carrying user_data. The
        entry completes OK once the watch is in place (one per ring). Notifications on
        the ring and not reaped when the session ends are lost; one spanning more than
        half the completion ring stays with gRPC's takers. FailedPrecondition, with
        nothing written, when the agent is older than notifications on the ring (an older
        agent closes the whole ring on an entry it does not know).

        With `subscription` (1 to 64 of A-Z a-z 0-9 . _ : -): the ring attaches to that
        durable subscription of this session's uid and client name, as gRPC
        WatchNotifications does: the unacknowledged ones first, in order, each with its
        `sequence`, held by the agent until ack_notifications (so those not reaped when
        the session ends come again to the next attachment)."""
        if subscription:
            self._require_durable(f"watch_notifications with subscription '{subscription}'")
        if not self.delivers_notifications():
            raise errors.error(
                9, "this agent's fast path does not deliver notifications (it is older than this "
                "client: FastPathInfo.features lacks notifications); take them with gRPC "
                "WatchNotifications, or upgrade the agent", where="watch_notifications")
        request = pb.WatchNotificationsRequest(transfer_ids=list(transfer_ids),
                                               subscription=subscription)
        self._put(WATCH_NOTIFICATIONS, user_data, request.SerializeToString())

    def ack_notifications(self, subscription, through=0, sequences=(), user_data=0):
        """Acknowledges `subscription`'s notifications up to sequence `through` (0: none)
        and those in `sequences`, as gRPC AckNotifications; completes with its code and
        message (5 NOT_FOUND for a subscription this identity does not have) and
        bytes_done = how many were released. FailedPrecondition, with nothing written,
        against an agent without durable subscriptions on the ring."""
        self._require_durable(f"ack_notifications of subscription '{subscription}'")
        request = pb.AckNotificationsRequest(subscription=subscription, through_sequence=through,
                                             sequences=list(sequences))
        self._put(ACK_NOTIFICATIONS, user_data, request.SerializeToString())

    def reap(self, max_count=64, timeout=1.0, min_count=1):
        """Up to max_count completions; waits up to `timeout` s until min_count (1 to
        max_count) have come, and returns what came by then. With several wanted, an
        agent with FEATURE_WAKE_COUNT rings the doorbell once they all have (one wake-up
        per batch); an older one at the first, and this waits again. The first ones wait
        for the rest: for throughput, not where one completion's latency counts."""
        deadline = time.monotonic() + timeout
        min_count = max(1, min(min_count, max_count))
        counts = bool(self.info.features & FEATURE_WAKE_COUNT)
        out = []
        while True:
            out += self._take(max_count - len(out))
            if len(out) >= min_count or time.monotonic() >= deadline:
                return out
            # at most a ring's worth: no more fit before this side reaps
            want = min(min_count - len(out), self.entries)
            if counts and want > 1:
                # wake_at before the flags: the agent reads it after them
                self._words[WAKE_AT] = (self._cq_head + want) & 0xFFFFFFFF
                self._words[CLIENT_FLAGS] = WAITING | WAIT_COUNT
            else:
                self._words[CLIENT_FLAGS] = WAITING
            self._fence()
            if self._words[CQ_TAIL] == self._cq_head:
                left = max(0.0, min(0.001, deadline - time.monotonic()))
                if select.select([self.complete_fd], [], [], left)[0]:
                    try:
                        os.read(self.complete_fd, 8)
                    except BlockingIOError:
                        pass
            self._words[CLIENT_FLAGS] = 0
            if self.closed_reason() and self._words[CQ_TAIL] == self._cq_head:
                if out:
                    return out
                raise errors.error(9, self.closed_reason(), where="fast path")

    def _take(self, max_count):
        tail = self._words[CQ_TAIL]
        start_head = self._cq_head
        out = []
        while self._cq_head != tail and len(out) < max_count:
            index = self._cq_head & (self.entries - 1)
            at = self.info.completion_offset + index * COMPLETION_BYTES
            data = COMPLETION.unpack_from(self._mmap, at)
            # A completion spans data[2] entries (never wrapping, never past cq_tail; an
            # impossible span is read as 1).
            span = data[2]
            if span == 0 or span > self.entries - index or span > ((tail - self._cq_head)
                                                                   & 0xFFFFFFFF):
                span = 1
            start = at + COMPLETION.size
            if data[1] == PAD:
                pass
            elif data[1] == NOTIFICATION and data[3] == 0:
                out.append(self._notification(data, span, start))
            else:
                length = min(data[5], COMPLETION_BYTES - COMPLETION.size)
                out.append(Completion(data, bytes(self._mmap[start:start + length]).decode(
                    errors="replace")))
            self._cq_head = (self._cq_head + span) & 0xFFFFFFFF
        if self._cq_head != start_head:
            self._words[CQ_HEAD] = self._cq_head
            self._fence()
            flags = self._words[AGENT_FLAGS]
            if flags & SLEEPING and (self._tail != self._words[SQ_HEAD] or flags & ROOM_WANTED):
                # entries or notifications waited for room
                os.write(self.submit_fd, (1).to_bytes(8, "little"))
        return out

    def _notification(self, data, span, start):
        length = data[5]
        note = pb.Notification()
        try:
            if length > span * COMPLETION_BYTES - COMPLETION.size:
                raise ValueError("longer than its entries")
            note.ParseFromString(bytes(self._mmap[start:start + length]))
        except Exception as e:  # a ring this client does not read as the agent wrote it
            data = (data[0], data[1], data[2], 13, 0, 0, data[6], data[7])  # INTERNAL
            return Completion(data, f"a notification completion of {length} bytes in {span} "
                              f"entries does not parse as a Notification ({e}); the agent and "
                              f"this client disagree on the ring (version {VERSION})")
        return Completion(data, "", note)

    def close(self):
        """Closes the ring and keeps the session (SessionRequest close_fast_path): the
        agent ends the ring's notification watch first (those not yet written stay queued
        for other takers, e.g. client.poll_notifications(), or with the durable
        subscription), takes no more entries, and lets the ring's transfers run to their
        end, their completions dropped (`transfers_running` says how many). Returns the
        completions written before the close and not reaped yet (notifications included),
        then unmaps. Against an agent older than the request the ring is only unmapped (the
        agent keeps it until the session ends), as is one the agent closed already.
        Idempotent: a second call returns []."""
        if self._mmap.closed:
            return []
        self._finalizer.detach()
        try:
            if not self.closed_reason():
                self._close_on_agent()
            left = self._take(1 << 32)  # what the agent wrote before it closed the ring
        finally:
            self._words.release()
            self._mmap.close()
            os.close(self.submit_fd)
            os.close(self.complete_fd)
        return left

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        """`with FastPath(client) as ring:` closes the ring on the agent at the block's
        end (close(); the completions left are dropped: call close() inside the block to
        get them)."""
        self.close()

    def _close_on_agent(self):
        request = pb.SessionRequest()
        request.close_fast_path.SetInParent()
        try:
            reply, fds = self.client.session.call(request, what="closing the fast path")
        except errors.KvAgentError as e:
            if e.code.name in ("UNIMPLEMENTED", "INVALID_ARGUMENT"):
                log.debug("the agent does not know close_fast_path (%s); the ring is only "
                          "unmapped: the agent keeps it until the session ends", e.message)
            elif e.code.name in ("FAILED_PRECONDITION", "UNAVAILABLE"):
                # Closed by the agent meanwhile, or the session is gone: nothing to close.
                log.debug("closing the fast path: %s", e.message)
            else:
                raise
            return
        for fd in fds:
            os.close(fd)
        self.transfers_running = reply.fast_path_closed.transfers_running


def _close_dropped(session_ref, ring, submit_fd, complete_fd):
    """A FastPath's finalizer (it was dropped without close()): closes a ring the agent
    has not closed, as close() does, best effort: close_fast_path waiting at most
    CLOSE_ON_DROP_S (the session's timeout if shorter), a warning naming what was
    dropped; raises nothing. An agent gone answers at once; a slow one only costs that
    wait (it then closes the ring when it reads the request, else when the session
    ends). Does nothing when the session is gone or closed (its end closed the ring)."""
    try:
        session = session_ref()
        if session is None or session.fileno() == -1:
            return
        if struct.unpack_from("<I", ring, AGENT_FLAGS * 4)[0] & CLOSED:
            return
        request = pb.SessionRequest()
        request.close_fast_path.SetInParent()
        try:
            reply, fds = session.call(request, what="closing a fast path dropped without "
                                      "close()", timeout=min(CLOSE_ON_DROP_S, session.timeout))
        except errors.KvAgentError as e:
            if e.code.name == "DEADLINE_EXCEEDED":
                log.warning("a fast path of the session with %s was dropped without close(), "
                            "and closing it failed: %s; the agent closes the ring if it still "
                            "reads the request, else when the session ends", session.path,
                            e.message)
            else:  # the session ended (its end closed the ring), or the agent is older
                log.debug("a fast path dropped without close(): close_fast_path: %s", e)
            return
        for fd in fds:
            os.close(fd)
        # The agent wrote nothing after the close's answer: what is on the ring now is
        # what the finalizer drops.
        cq_tail, cq_head = (struct.unpack_from("<I", ring, word * 4)[0]
                            for word in (CQ_TAIL, CQ_HEAD))
        log.warning("a fast path of the session with %s was dropped without close(); the "
                    "agent closed its ring, dropping %d completion-ring entries not reaped; %d "
                    "of its transfers still run (look them up with gRPC GetTransfer); call "
                    "close() or use `with FastPath(...)` to get the completions",
                    session.path, (cq_tail - cq_head) & 0xFFFFFFFF,
                    reply.fast_path_closed.transfers_running)
    except Exception as e:  # a finalizer never raises
        log.debug("closing a fast path dropped without close(): %r", e)
    finally:
        for fd in (submit_fd, complete_fd):
            try:
                os.close(fd)
            except OSError:
                pass
