"""An HTTP/2 client over cleartext (prior knowledge, as `curl --http2-prior-knowledge` and gRPC
speak it to Envoy): several requests multiplexed on one connection, each read as its frames come,
and any one reset on its own (RST_STREAM) while the connection and its other streams go on; a
request may end in trailers.

Clients reach an Istio gateway or an Envoy front over HTTP/2 more often than not (TLS with ALPN
`h2`); a stream reset is how such a client cancels one request, and it closes no connection,
unlike an HTTP/1.1 client's only way out. The framing is the `h2` package's state machine; this
file only moves its bytes and keeps each stream's response.

Source of truth: none; a connection and its streams live in one test."""

import socket
import time

import h2.config
import h2.connection
import h2.errors
import h2.events


class Stream:
    """One request's response as it has arrived so far."""

    def __init__(self):
        self.status = None
        self.headers = {}
        self.body = bytearray()
        self.ended = False
        self.reset = False

    @property
    def done(self):
        return self.ended or self.reset


class H2Connection:
    """One HTTP/2 connection to `port` on loopback."""

    def __init__(self, port, timeout=10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.streams = {}
        self.terminated = False
        self._flush()

    def _flush(self):
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def post(self, path, body: bytes, headers=None, trailers=None):
        """Opens a stream with a POST of `body` (sent whole: the tests' bodies fit the peer's
        initial window), ended by `trailers` when given; returns its id."""
        sid = self.conn.get_next_available_stream_id()
        head = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "kvgate"),
                ("content-type", "application/json"), ("content-length", str(len(body))),
                *(headers or {}).items()]
        self.conn.send_headers(sid, head)
        self.conn.send_data(sid, body, end_stream=not trailers)
        if trailers:
            self.conn.send_headers(sid, list(trailers.items()), end_stream=True)
        self.streams[sid] = Stream()
        self._flush()
        return sid

    def reset(self, sid):
        """Cancels one stream, as a client abandoning that request does."""
        self.conn.reset_stream(sid, error_code=h2.errors.ErrorCodes.CANCEL)
        self.streams[sid].reset = True
        self._flush()

    def pump(self, until=lambda: False, timeout=5.0):
        """Reads frames until `until()` holds or `timeout` passes; returns `until()`."""
        deadline = time.monotonic() + timeout
        while not until() and not self.terminated:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(min(left, 0.2))
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                self.terminated = True
                break
            for event in self.conn.receive_data(data):
                self._on(event)
            self._flush()
        return until()

    def _on(self, event):
        s = self.streams.get(getattr(event, "stream_id", None))
        if isinstance(event, h2.events.ResponseReceived) and s:
            s.headers = dict(event.headers)
            s.status = int(s.headers.get(":status", 0))
        elif isinstance(event, h2.events.DataReceived):
            if s:
                s.body += event.data
            # Credit the window back, or a long answer stalls the whole connection.
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded) and s:
            s.ended = True
        elif isinstance(event, h2.events.StreamReset) and s:
            s.reset = True
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.terminated = True

    def close(self):
        """Drops the connection without a word more (its open streams die with it)."""
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
