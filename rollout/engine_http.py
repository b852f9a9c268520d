"""The embedded engine's HTTP layer, under its routes (rollout/engine_server.py): JSON
errors, 405 for methods other than GET and POST, a deadline for reading each request and
a cap on open connections.

- `JsonRequestHandler.send_json`: every answer, strict JSON (a NaN or infinite number in
  an answer, such as a logprob of broken weights, is an engine fault: 500, not `NaN` in
  the body, which no JSON parser but Python's reads).
- `error_body(message, field)`: every error answer, `{"success": false, "error": ...,
  "message": ..., "field": ...}` ("message" as SGLang's weight endpoints answer; "field"
  the request field at fault, or null). Never a traceback: the server logs those.
- `JsonRequestHandler`: the standard library's handler with its error pages (a malformed
  request line, headers over its limits, ...) answered as JSON, and any method but GET
  and POST answered 405 with `Allow: GET, POST` on a known path (404 elsewhere) instead
  of the library's 501 HTML page.
- `EngineHTTPServer`: a `ThreadingHTTPServer` that
  - gives each request `request_timeout_s` from when it starts waiting for the request
    line until the body is read: a client that stalls or trickles bytes past that has
    the read side of its connection shut, answered 408 when a request had begun
    (reading headers or body; the per-read socket timeout alone let a client that sends
    a byte every few minutes hold a connection for ever). Handling the request (a
    generation, a weight load) and writing the answer are not counted.
  - holds at most `max_connections` connections: past that, an accepted connection waits
    for one to end (the others queue in the listen backlog) up to twice
    `request_timeout_s`, longer than a stalled client can hold its slot, then is answered
    503 and closed (the connections held are all being served, not stalled).
  `open_connections` and `peak_connections` count them (tests, diagnostics).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("rollout.engine_http")

ALLOWED_METHODS = ("GET", "POST")
DEFAULT_REQUEST_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 512
IO_TIMEOUT_S = 300  # one socket read or write (the answer's writes too)


def error_body(message: str, field: str | None = None) -> dict:
    return {"success": False, "error": message, "message": message, "field": field}


class Refused(Exception):
    """A request answered with `code` (and its connection closed), its body maybe unread."""

    def __init__(self, code: int, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.field = field


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The asynchronous agent loop opens a connection per request, dozens at once: the
    # default backlog (5) overflows into SYN cookies and resets.
    request_queue_size = 1024

    def __init__(self, address, handler_class, *, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, bind_and_activate: bool = True):
        if request_timeout_s <= 0 or max_connections < 1:
            raise ValueError(f"request_timeout_s={request_timeout_s} and max_connections={max_connections} "
                             "must be positive")
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.open_connections = 0
        self.peak_connections = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}  # connections reading a request, and until when
        self._cut: set[socket.socket] = set()  # connections whose read side the deadline shut
        self._open: set[socket.socket] = set()  # every connection a handler serves (kept alive between calls)
        self._closing = threading.Event()
        super().__init__(address, handler_class, bind_and_activate)
        threading.Thread(target=self._enforce_deadlines, name="engine-http-deadlines", daemon=True).start()

    # -- the request deadline -------------------------------------------------------------
    def reading(self, conn: socket.socket) -> None:
        """`conn` starts waiting for a request: its deadline runs from now."""
        with self._lock:
            self._deadlines[conn] = time.monotonic() + self.request_timeout_s

    def read_done(self, conn: socket.socket) -> bool:
        """`conn`'s request is read (or abandoned): its deadline stops. True when the
        deadline had cut it."""
        with self._lock:
            self._deadlines.pop(conn, None)
            return conn in self._cut

    def _enforce_deadlines(self) -> None:
        tick = min(0.25, self.request_timeout_s / 4)
        while not self._closing.wait(tick):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
                    self._cut.add(c)
            for c in late:
                try:
                    c.shutdown(socket.SHUT_RD)  # the handler's blocked read returns; it can still answer
                except OSError:
                    pass

    def server_close(self) -> None:
        """Stop listening, and end the connections clients keep open: no request reaches
        the handlers of a closed server (a new server on the same port is another one)."""
        self._closing.set()
        super().server_close()
        with self._lock:
            still_open = list(self._open)
        for conn in still_open:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- the connection cap -------------------------------------------------------------
    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(timeout=2 * self.request_timeout_s):
            _answer_raw(request, 503, f"this engine has {self.max_connections} connections open (its limit); "
                                      "try again")
            self.shutdown_request(request)
            return
        with self._lock:
            self.open_connections += 1
            self.peak_connections = max(self.peak_connections, self.open_connections)
            self._open.add(request)
        try:
            super().process_request(request, client_address)  # a thread of its own
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._lock:
            self.open_connections -= 1
            self._deadlines.pop(request, None)
            self._cut.discard(request)
            self._open.discard(request)
        self._slots.release()


def _answer_raw(conn: socket.socket, code: int, message: str) -> None:
    """A JSON error written straight to a socket no handler serves (best effort)."""
    data = json.dumps(error_body(message)).encode()
    head = (f"HTTP/1.1 {code} {HTTPStatus(code).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    try:
        conn.settimeout(1.0)
        conn.sendall(head + data)
    except OSError:
        pass


class JsonRequestHandler(BaseHTTPRequestHandler):
    """JSON answers only; a subclass sets `known_paths` and defines do_GET / do_POST."""

    protocol_version = "HTTP/1.1"  # clients keep the connection open between calls
    disable_nagle_algorithm = True  # the headers and the body go as two writes: none waits for an ACK
    timeout = IO_TIMEOUT_S
    known_paths: frozenset[str] = frozenset()
    server: EngineHTTPServer

    def log_message(self, fmt, *args):  # the default logs every request to stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def handle_one_request(self) -> None:
        self.server.reading(self.connection)
        try:
            super().handle_one_request()
        except (ConnectionResetError, BrokenPipeError):  # the client left (a kept-alive connection it dropped)
            self.close_connection = True
        finally:
            self.server.read_done(self.connection)

    def send_json(self, code: int, payload, *, close: bool = False, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload, allow_nan=False).encode()  # NaN is no JSON: a ValueError, answered 500
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:  # the body was left unread: end the connection
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's error answers (a malformed request line, too long or too
        many headers, an unsupported HTTP version), as JSON with a status line; the
        connection is closed."""
        if self.server.read_done(self.connection):
            code, message = 408, self._late()
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # no request line parsed:
            self.request_version = "HTTP/1.0"  # answer with a status line all the same (HTTP/0.9 has none)
        try:
            self.send_json(code, error_body(message or HTTPStatus(code).phrase), close=True)
        except OSError:
            self.close_connection = True

    def read_body(self, n: int) -> bytes:
        """The body of a Content-Length of `n`, read within the request's deadline."""
        raw = self.rfile.read(n) if n else b""
        if self.server.read_done(self.connection):
            raise Refused(408, self._late())
        if len(raw) < n:
            raise Refused(400, f"the body ended after {len(raw)} of its {n} bytes (Content-Length)")
        return raw

    def _late(self) -> str:
        return f"the request was not received within {self.server.request_timeout_s:g} s"

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # what the standard library looks up for each method
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        path = self.path.split("?")[0]
        if path in self.known_paths:
            self.send_json(405, error_body(f"{self.command} is not allowed on {path}; use GET or POST"), close=True,
                           headers={"Allow": ", ".join(ALLOWED_METHODS)})
        else:
            self.send_json(404, error_body(f"no endpoint {path}"), close=True)
