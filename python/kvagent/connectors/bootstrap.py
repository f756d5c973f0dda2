"""The bootstrap that pairs a prefill sender with a decode receiver by request (SGLang's
bootstrap room): a small TCP server (JSON, one request per connection) where prefill
workers register their agent, and decode receivers leave, per room, their agent's
address and the destination pages, state slots and aux index. Senders read the room's
entry when it is there. It carries only this pairing; bytes move between agents."""
import json
import socket
import socketserver
import threading

from .. import errors

MAX_LINE = 1 << 20


class _Handler(socketserver.StreamRequestHandler):
    def handle(self):
        line = self.rfile.readline(MAX_LINE)
        try:
            request = json.loads(line)
            reply = self.server.answer(request)
        except (ValueError, KeyError, TypeError) as e:
            reply = {"error": f"bad bootstrap request: {e}"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class BootstrapServer(socketserver.ThreadingTCPServer):
    """Serves on HOST:PORT (port 0: the kernel picks; see .address)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host="127.0.0.1", port=0):
        super().__init__((host, port), _Handler)
        self._lock = threading.Lock()
        self.prefill = {}  # engine rank -> {"agent", "agent_name"}
        self.rooms = {}    # room -> decode's info
        # close() waits for the loop's next look (0.5 s at socketserver's default).
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kvagent-bootstrap", daemon=True)
        self._thread.start()

    @property
    def address(self):
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def answer(self, request):
        op = request["op"]
        with self._lock:
            if op == "register_prefill":
                self.prefill[str(request["rank"])] = request["info"]
                return {"ok": True}
            if op == "get_prefill":
                return {"info": self.prefill.get(str(request["rank"]))}
            if op == "put_room":
                self.rooms[str(request["room"])] = request["info"]
                return {"ok": True}
            if op == "get_room":
                return {"info": self.rooms.get(str(request["room"]))}
            if op == "drop_room":
                self.rooms.pop(str(request["room"]), None)
                return {"ok": True}
        return {"error": f"unknown op '{op}'"}

    def close(self):
        self.shutdown()
        self.server_close()


def ask(address, op, timeout=5.0, **fields):
    """One request to the bootstrap server at HOST:PORT; its reply."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
            reply = json.loads(s.makefile().readline(MAX_LINE))
    except (OSError, ValueError) as e:
        raise errors.error(14, f"bootstrap {address}: {op} failed ({e}); check that the "
                           "bootstrap server runs there", entry=f"bootstrap {address}") from None
    if "error" in reply:
        raise errors.error(3, f"bootstrap {address}: {reply['error']}; use a matching client")
    return reply
