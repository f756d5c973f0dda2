"""What the Python tests share: two real kvagentd ("prefill", "decode") started per test
class, engines only (--scheduler-uids none, so ownership is enforced as for engines),
and a runner that writes one JUnit <testcase> per test method to $XML_OUTPUT_FILE, so
.ci/count_tests.py counts every case (a skip with its reason)."""
import collections
import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET

from kvagent._proto import kvagent_pb2 as pb
from kvagent.daemon import AgentPair

ENGINES_ONLY = ("--scheduler-uids", "none")


class PairTestCase(unittest.TestCase):
    """Starts a pair for the class; self.pre and self.dec are fresh clients per test."""

    agent_args = ENGINES_ONLY

    @classmethod
    def setUpClass(cls):
        cls.pair = AgentPair(extra_args=cls.agent_args)

    @classmethod
    def tearDownClass(cls):
        cls.pair.stop()

    def clients(self, prefix):
        """A prefill and a decode client named after the test (region names are
        agent-wide), closed at the end of the test, prefill connected to decode."""
        import kvagent
        pre = kvagent.connect(self.pair.prefill.socket, name=f"{prefix}-pre")
        dec = kvagent.connect(self.pair.decode.socket, name=f"{prefix}-dec")
        self.addCleanup(pre.close)
        self.addCleanup(dec.close)
        return pre, dec


def count_calls(client):
    """Counts the gRPC calls `client` makes from now on, by method (the calls still go
    to the agent): a Counter."""
    counts = collections.Counter()
    real = client.call

    def call(method, *args, **kwargs):
        counts[method] += 1
        return real(method, *args, **kwargs)

    client.call = call
    return counts


def agent_status(agent):
    """GetStatus of a kvagent.daemon.Agent, from a short session of its own."""
    import kvagent
    with kvagent.connect(agent.socket, name=f"status-{time.monotonic_ns()}") as c:
        return c.status()


def ring_use(pair):
    """A function giving, for each agent of `pair`, (fast path entries taken,
    notifications posted on rings) since ring_use was called (GetStatus counters)."""
    agents = {"prefill": pair.prefill, "decode": pair.decode}
    before = {name: agent_status(agent) for name, agent in agents.items()}

    def since():
        now = {name: agent_status(agent) for name, agent in agents.items()}
        return {name: (now[name].fast_path_entries - before[name].fast_path_entries,
                       now[name].fast_path_notifications - before[name].fast_path_notifications)
                for name in agents}
    return since


TRANSFER_RPCS = ("SubmitTransfer", "GetTransfer", "WatchTransfer", "PollNotifications")


def transfer_rpcs(*counters):
    """The gRPC transfer and notification calls count_calls counted: {method: calls}."""
    return {m: sum(c[m] for c in counters) for m in TRANSFER_RPCS if any(c[m] for c in counters)}


def wait_status(agent, check, seconds=5.0):
    """The agent's status once check(status) holds (or the last one after `seconds`)."""
    deadline = time.monotonic() + seconds
    while True:
        status = agent_status(agent)
        if check(status) or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cases = []
        self._start = 0.0

    def startTest(self, test):
        self._start = time.monotonic()
        super().startTest(test)

    def _record(self, test, kind=None, text=""):
        self.cases.append((test.id(), time.monotonic() - self._start, kind, text))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)



def stages(state):
    """A TransferState's timeline as stage names, in order."""
    return [pb.TransferStage.Name(e.stage) for e in state.timeline]


def record_notifications(route):
    """A list that gets every notification `route` hands out from now on (its owner
    still gets them): a connector's per-request sets would hide a second one."""
    got, real = [], route.notifications

    def notifications():
        notes = real()
        got.extend(notes)
        return notes

    route.notifications = notifications
    return got


def placed_and_acknowledged(case, read_state, transfer_id, seconds=5.0):
    """read_state() (a GetTransfer) until the transfer, submitted with complete_when
    placed, has its peer's acknowledgement recorded, after its end in the timeline;
    fails naming the last state after `seconds`, or at once when it was not submitted
    as placed."""
    deadline = time.monotonic() + seconds
    while True:
        state = read_state()
        if (state.peer_acknowledged or state.complete_when != pb.COMPLETE_WHEN_PLACED
                or time.monotonic() > deadline):
            break
        time.sleep(0.01)
    case.assertEqual(pb.CompletionPoint.Name(state.complete_when), "COMPLETE_WHEN_PLACED",
                     f"transfer '{transfer_id}': not submitted with complete_when placed")
    case.assertTrue(state.peer_acknowledged,
                    f"transfer '{transfer_id}': peer_acknowledged still false {seconds} s after "
                    f"{pb.TransferPhase.Name(state.phase)} (peer_note {state.peer_note!r}, "
                    f"timeline {stages(state)})")
    order = stages(state)
    case.assertLess(order.index("STAGE_ENDED"), order.index("STAGE_ACKNOWLEDGED"),
                    f"transfer '{transfer_id}' completed when placed must end before its "
                    f"peer's acknowledgement: {order}")
    return state


def main():
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules["__main__"])
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2)
    result = runner.run(suite)
    path = os.environ.get("XML_OUTPUT_FILE")
    if path:
        suites = ET.Element("testsuites")
        ts = ET.SubElement(suites, "testsuite", name=os.path.basename(sys.argv[0]),
                           tests=str(len(result.cases)))
        for name, seconds, kind, text in result.cases:
            case = ET.SubElement(ts, "testcase", name=name, time=f"{seconds:.3f}")
            if kind == "skipped":
                ET.SubElement(case, "skipped", message=text)
            elif kind:
                ET.SubElement(case, kind, message=text.strip().splitlines()[-1]).text = text
        ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
    sys.exit(0 if result.wasSuccessful() else 1)
