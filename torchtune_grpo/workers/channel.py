"""Generation workers on other machines: the worker's protocol over TCP (docs/async.md, "Workers elsewhere").

A local worker (:mod:`torchtune_grpo.workers.process`) talks to its trainer rank through two
``multiprocessing`` queues. A worker on another node serves the same messages over one TCP connection:

- on the generation node, ``python -m torchtune_grpo.workers.process --listen HOST:PORT`` waits for a trainer;
- the trainer rank ``r`` connects to ``generation_workers.addresses[r]`` and sends the
  :class:`~torchtune_grpo.workers.process.WorkerSpec` first; the worker builds its model, engine and rewards
  from it, then serves requests in order until the trainer says stop or the connection closes, and waits
  for the next trainer (a restarted run, or the same run reconnecting after a fault).

Messages are pickled with the standard pickler (tensors travel by value; ``torch.multiprocessing``'s
shared-memory reductions only work on one machine) and each side sends from a thread of its own, as a
``multiprocessing`` queue does, so a large message (the weights) never blocks its sender while the peer
is itself busy sending.

Both sides must hold the same secret in the environment variable :data:`AUTHKEY_ENV`: the connection is
authenticated with it (``multiprocessing.connection``'s HMAC challenge) before anything is unpickled, since
unpickling runs code. The trainer's config and paths travel in the spec: the worker's node must see the
same files (model checkpoint, tokenizer, data for rewards) at the same paths, as on a shared filesystem.
"""

import os
import pickle
import queue
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable, Optional, Tuple

__all__ = ["AUTHKEY_ENV", "ConnectionQueue", "authkey", "connect", "parse_address", "serve"]

AUTHKEY_ENV = "TORCHTUNE_GRPO_WORKER_KEY"


def authkey(what: str) -> bytes:
    """The shared secret from :data:`AUTHKEY_ENV`.

    Args:
        what (str): who needs it, for the error (``"generation_workers.addresses"``, ``"--listen"``).

    Raises:
        ValueError: naming the variable, when it is unset or empty.
    """
    key = os.environ.get(AUTHKEY_ENV, "")
    if not key:
        raise ValueError(
            f"{what}: set the environment variable {AUTHKEY_ENV} to the same secret on the trainer and on every "
            "generation worker (it authenticates the connection before any message is unpickled)"
        )
    return key.encode()


def parse_address(text: Any, key: str) -> Tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``.

    Args:
        text (Any): the address as written in the config.
        key (str): the config key, for the error.

    Raises:
        ValueError: naming ``key`` and the value, when it is not ``host:port`` with a port in 1..65535.
    """
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{key}: expected 'host:port' with a port in 1..65535, got {text!r}")
    return host.strip("[]"), int(port)  # [::1]:port for IPv6


class ConnectionQueue:
    """One side of a worker connection with a queue's ``put`` / ``get(timeout)``.

    ``put`` hands the message to a sender thread (it never blocks); ``get`` waits up to ``timeout`` seconds
    and raises ``queue.Empty`` when nothing came, ``EOFError`` once the peer has closed the connection.

    Args:
        conn (Connection): an authenticated ``multiprocessing.connection`` connection.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._outbox: "queue.Queue[Optional[bytes]]" = queue.Queue()
        self._sender = threading.Thread(target=self._send_all, name="grpo-worker-connection-sender", daemon=True)
        self._sender.start()
        self.broken: Optional[BaseException] = None  # the sender's error, if the connection broke under it

    def _send_all(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self.conn.send_bytes(data)
            except (OSError, ValueError) as error:  # closed under us: get() reports the EOF to the owner
                self.broken = error
                return

    def put(self, message: Any) -> None:
        """Send ``message`` (in order, after the ones put before)."""
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def get(self, timeout: Optional[float] = None) -> Any:
        """The next message; ``queue.Empty`` after ``timeout`` seconds (None: wait), ``EOFError`` when closed."""
        try:
            ready = self.conn.poll(timeout)
        except (OSError, ValueError) as error:
            raise EOFError(str(error)) from error
        if not ready:
            raise queue.Empty
        try:
            return pickle.loads(self.conn.recv_bytes())
        except OSError as error:  # reset by the peer
            raise EOFError(str(error)) from error

    def close(self, flush: float = 30.0) -> None:
        """Send what is queued (up to ``flush`` seconds), then close the connection."""
        self._outbox.put(None)
        self._sender.join(timeout=flush)
        self.conn.close()


def connect(address: Tuple[str, int], key: bytes) -> ConnectionQueue:
    """A connection to the worker listening at ``address`` (raises ``OSError`` when none answers, or
    ``multiprocessing.AuthenticationError`` when its secret differs)."""
    return ConnectionQueue(Client(address, family="AF_INET", authkey=key))


def serve(
    address: Tuple[str, int],
    key: bytes,
    worker_main: Callable[[Any, ConnectionQueue, ConnectionQueue], None],
    *,
    connections: Optional[int] = None,
) -> None:
    """Serve trainers at ``address``, one connection at a time, each with a worker built from its spec.

    Args:
        address (Tuple[str, int]): where to listen (``("0.0.0.0", port)``: every interface).
        key (bytes): the shared secret.
        worker_main (Callable): ``worker_main(spec, requests, replies)`` runs one trainer's worker until the
            connection closes (:func:`torchtune_grpo.workers.process.worker_main`; passed in, because the
            transport knows nothing of what is served over it).
        connections (Optional[int]): leave after this many connections; None serves until killed.
            Default is None.
    """
    served = 0
    with Listener(address, family="AF_INET", authkey=key) as listener:
        print(f"generation worker listening on {address[0]}:{listener.address[1]}", flush=True)
        while connections is None or served < connections:
            try:
                channel = ConnectionQueue(listener.accept())
            except (OSError, EOFError, AuthenticationError) as error:  # failed the handshake: wait for the next
                print(f"generation worker: refused a connection ({type(error).__name__}: {error})", flush=True)
                continue
            served += 1
            try:
                kind, spec = channel.get(timeout=None)
                if kind != "spec":
                    raise ValueError(f"expected the worker spec first, got {kind!r}")
                print(f"generation worker: serving rank {spec.rank}", flush=True)
                worker_main(spec, channel, channel)
            except EOFError:
                pass  # the trainer left before sending its spec
            finally:
                channel.close(flush=5.0)
            print("generation worker: trainer disconnected", flush=True)
