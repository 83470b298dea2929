"""What bounds the server's HTTP side against slow, many or unknown clients: a
request read within a deadline (`Deadline`), a client that hung up noticed
(`hung_up`), at most ``max_connections`` connections (`HTTPServer`), those being
handled counted (`Connections`), and the API keys (`api_keys`, `env_keys`)."""

import ipaddress
import os
import socket
import threading
import time
from http.server import ThreadingHTTPServer

from ..errors import MTPError
from ..server_checks import RequestError

API_KEY_ENV = "MLX_MTP_API_KEY"


class Deadline:
    """A connection's request stream, read within a deadline: every read waits until
    then at most (TimeoutError after), so a client that sends its request a byte at a
    time is cut off as one that sends nothing."""

    def __init__(self, raw, sock, seconds: float):
        self._raw, self._sock = raw, sock
        self._deadline = time.monotonic() + seconds

    def _wait(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)

    def readline(self, limit: int = -1) -> bytes:
        parts, size = [], 0
        while limit < 0 or size < limit:
            self._wait()
            ahead = self._raw.peek(1)  # one read of the socket at most
            if not ahead:
                break
            n = ahead.find(b"\n") + 1 or len(ahead)
            part = self._raw.read(n if limit < 0 else min(n, limit - size))
            parts.append(part)
            size += len(part)
            if part.endswith(b"\n"):
                break
        return b"".join(parts)

    def read(self, n: int = -1) -> bytes:
        parts, size = [], 0
        while n < 0 or size < n:
            self._wait()
            part = self._raw.read1(1 << 20 if n < 0 else n - size)
            if not part:
                break
            parts.append(part)
            size += len(part)
        return b"".join(parts)

    def close(self) -> None:
        self._raw.close()


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed or reset the connection: a read that does
    not wait finds its end (bytes sent ahead are left unread). A client that shut
    down only its sending side looks gone too."""
    timeout = sock.gettimeout()
    try:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        finally:
            sock.settimeout(timeout)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def env_keys() -> tuple:
    """The API keys of `API_KEY_ENV`, a comma-separated list (empty entries skipped)."""
    value = os.environ.get(API_KEY_ENV, "")
    return tuple(k.strip() for k in value.split(",") if k.strip())


def api_keys(value) -> tuple:
    """``api_key`` as a tuple of keys: None or () for none, one key, or several;
    each client that presents its own key has prompt caches of its own."""
    keys = () if value is None else (value,) if isinstance(value, str) else value
    keys = tuple(keys)
    if not all(isinstance(k, str) and k for k in keys):
        raise MTPError("an API key must be a non-empty string")
    return keys


class HTTPServer(ThreadingHTTPServer):
    """A thread per connection, ``max_connections`` at most (one more gets a 503 at
    once), and what `MTPHandler` checks requests against: whether the server is
    bound to a loopback address (then `host_allowed` guards against DNS
    rebinding), under which name, the allowed Origins, and for
    `MTPHandler._check_room` the model's context and `prompt_bytes_per_token`."""

    daemon_threads = True  # a slow client never holds the server up

    def __init__(self, address, handler, origins: frozenset, max_connections: int):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.origins, self.max_connections = origins, max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self.bytes_per_token = self.context = None
        super().__init__(address, handler)
        self.loopback = ipaddress.ip_address(self.server_address[0]).is_loopback
        self.name = address[0]

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            return self._refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request) -> None:
        """503 at once, from the accepting thread: a reply this short fits in the
        socket's empty send buffer, so sending it never waits."""
        error = RequestError(
            503,
            f"the server has {self.max_connections} connections open, its most; "
            "try again later",
            "server_error",
        )
        body = error.body()
        head = (
            "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\n\r\n"
        )
        try:
            request.setblocking(False)
            request.send(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)


class Connections:
    """The connections being handled, counted, so that `Server.close` can wait for
    them."""

    def __init__(self):
        self._count, self._changed = 0, threading.Condition()

    def __enter__(self):
        with self._changed:
            self._count += 1

    def __exit__(self, *exc):
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        """Until none is handled, ``timeout`` seconds at most."""
        with self._changed:
            self._changed.wait_for(lambda: not self._count, timeout)
