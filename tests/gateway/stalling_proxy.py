"""A TCP relay in front of a worker that can stop completing new connections for a while,
as a starved host does under a burst: its accept queue full, a new connection's handshake
is not completed and the client's connect times out, although the worker is alive.

`stall()` drops the relayed connections (so the gateway's pooled ones are gone too), stops
accepting and fills the one-slot accept queue with connections of its own; `release()` lets
everything through again. Blocking sockets and a thread per direction: small and certain.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class StallingProxy:
    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)  # Linux: one connection waits in the queue, no more
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self._relayed: list[socket.socket] = []
        self._fillers: list[socket.socket] = []
        self._closed = False

    def start(self) -> StallingProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def stall(self) -> None:
        self._open.clear()
        with self._lock:
            relayed, self._relayed = self._relayed, []
        for s in relayed:
            _close(s)
        for _ in range(4):  # the queue's slot taken, and handshakes beyond it left pending
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(self._listener.getsockname())
            self._fillers.append(s)

    def release(self) -> None:
        for s in self._fillers:
            _close(s)
        self._fillers = []
        self._open.set()

    def stop(self) -> None:
        self._closed = True
        self.release()
        _close(self._listener)
        with self._lock:
            for s in self._relayed:
                _close(s)

    def _accept(self) -> None:
        while not self._closed:
            self._open.wait()
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open.is_set():  # a filler (or a connect that raced the stall)
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._relayed += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        _close(src)
        _close(dst)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
