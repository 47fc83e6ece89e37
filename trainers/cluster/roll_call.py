"""The roll call before JAX's join: distinct ``distributed.process_id``s, one ``num_processes``.

JAX's coordination service cannot be asked whether a launch is consistent without joining it,
and joining it with a launch mistake ends processes in C++: a second process with a
``process_id`` already taken makes the service abort every process (``Check failure``, exit
134), and a process started with another ``num_processes`` joins, then waits in the first
collective until JAX aborts it. Two processes 0 on one host both take the port (gRPC shares it)
and each waits for peers until ``distributed.initialization_timeout_s``.

So before ``jax.distributed.initialize``, when ``coordinator_address``, ``num_processes`` and
``process_id`` are all given (a launch by hand; a cluster JAX detects assigns them itself),
every process answers a roll call held by process 0 on the coordinator's own port, over plain
TCP, which nothing can abort:

- process 0 listens on that port (all interfaces, as JAX's service will) in a thread
  (`RollCall`); if the port is taken, it only answers the roll there like every other process,
  so a second process 0 on one host is refused as a duplicate;
- every process connects to ``coordinator_address`` and sends its `Answer` (``process_id``,
  ``num_processes``, host:pid) (`answer_roll`); process 0's own counts from the moment it
  listens, and it answers at the address too, so that a process 0 on another host holding the
  roll there (the same address given to two processes 0) refuses it as a duplicate;
- process 0's listener replies to every process with one line as soon as it can: the error of
  the first mistake it sees (a ``process_id`` given twice, a ``num_processes`` other than
  process 0's), or "ok" once every id in ``0..num_processes-1`` answered; then it closes the
  port and JAX's service takes it over.

A mistake is thus found as soon as the processes involved have started, whatever
``distributed.initialization_timeout_s`` is; that timeout still bounds the wait for a process
that never comes (`trainers.cluster.join`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from xshard.config.nodes import shown
from xshard.errors import ConfigError

if TYPE_CHECKING:
    from trainers.config import DistributedOptions

logger = logging.getLogger(__name__)

#: How often a process retries the coordinator's port, and how often process 0's listener
#: checks its deadline.
PROBE_EVERY_S = 0.5
#: The longest line either side reads: more is not a roll call.
MAX_LINE = 16384
#: Seconds process 0's listener gives one reply to be sent.
SEND_TIMEOUT_S = 2.0


class Answer(NamedTuple):
    """What one process says at the roll call."""

    process_id: int
    num_processes: int
    host: str  # "host:pid", for messages

    def line(self) -> bytes:
        """The answer as sent: one JSON line."""
        return json.dumps({"xshard_roll_call": list(self)}).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> Answer | None:
        """The answer in `line`, or None if it is not one."""
        try:
            pid, count, host = json.loads(line)["xshard_roll_call"]
        except (ValueError, KeyError, TypeError):
            return None
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, count))
        return cls(pid, count, host) if ints and isinstance(host, str) else None


def this_process(opts: DistributedOptions) -> Answer:
    """This process's `Answer` (explicit ``process_id`` and ``num_processes``)."""
    assert opts.process_id is not None and opts.num_processes is not None
    return Answer(opts.process_id, opts.num_processes, f"{socket.gethostname()}:{os.getpid()}")


class CoordinatorProbe:
    """Connections to the coordinator's address, remembering whether anything answered there."""

    def __init__(self) -> None:
        self.answered = False
        self.error: str | None = None
        self._next = 0.0

    def connect(self, address: str) -> socket.socket | None:
        """A connection to `address` (host:port), or None (`error` says why) if none is due yet
        (one try every `PROBE_EVERY_S`) or it failed."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + PROBE_EVERY_S
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=1.0)
        except socket.gaierror as e:
            self.error = f"cannot resolve {host}: {e.strerror or e}"
            return None
        except (OSError, ValueError) as e:
            self.error = getattr(e, "strerror", None) or str(e) or type(e).__name__
            return None
        self.answered = True
        return sock

    def poke(self, address: str) -> None:
        """One connection attempt to `address` if due and none answered yet."""
        if not self.answered and (sock := self.connect(address)) is not None:
            sock.close()


def answer_roll(opts: DistributedOptions, deadline: float, probe: CoordinatorProbe) -> bool:
    """Answers the roll call at ``distributed.coordinator_address``; process 0 holds it.

    Args:
      opts: the ``distributed`` node, with coordinator_address, num_processes and process_id.
      deadline: ``time.monotonic()`` after which this process stops waiting.
      probe: records whether anything answered at the address, for the caller's message.

    Returns:
      True once every process answered without a mistake; False at the deadline.

    Raises:
      ConfigError: on every process that answered, as soon as process 0 sees a launch mistake
        (naming the key, each process's value and what is allowed); or if what answered at the
        address is not a roll call (another program, or a run that formed already).
    """
    assert opts.coordinator_address is not None
    me = this_process(opts)
    roll = RollCall.hold(opts, me, deadline) if me.process_id == 0 else None
    try:
        while time.monotonic() < deadline:
            if roll is not None and roll.reply is not None:  # maybe before this one answered
                roll.thread.join(timeout=SEND_TIMEOUT_S * (me.num_processes + 1))
                return _accepted(roll.reply, opts, me)
            sock = probe.connect(opts.coordinator_address)
            if sock is None:
                time.sleep(min(PROBE_EVERY_S, max(0.0, deadline - time.monotonic())))
                continue
            with sock:
                reply = _exchange(sock, me, deadline)
            if reply is not None:
                if roll is not None:  # every other process gets its reply first
                    roll.thread.join(timeout=SEND_TIMEOUT_S * (me.num_processes + 1))
                return _accepted(reply, opts, me)
        return False
    finally:
        if roll is not None:
            roll.stop()


def _exchange(sock: socket.socket, me: Answer, deadline: float) -> bytes | None:
    """Sends `me` and reads the reply: a line, the bytes before the connection closed, or None
    if it closed at once (process 0's listener ending: try again) or the deadline passed."""
    received = b""
    try:
        sock.sendall(me.line())
        while b"\n" not in received and len(received) < MAX_LINE and received[:1] in (b"", b"{"):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(min(left, PROBE_EVERY_S))
            try:
                chunk = sock.recv(MAX_LINE)
            except TimeoutError:
                continue
            if not chunk:
                break
            received += chunk
    except OSError:
        pass
    return received or None


def _accepted(reply: bytes, opts: DistributedOptions, me: Answer) -> bool:
    """True for process 0's "ok"; raises `ConfigError` for its error or a foreign reply."""
    address = shown(opts.coordinator_address)
    if _http2(reply):  # JAX's service (gRPC) holds the port: the roll call is over
        raise ConfigError(_too_late(address, me))
    try:
        message = json.loads(reply.split(b"\n", 1)[0])
    except ValueError:
        message = None
    if isinstance(message, dict) and message.get("xshard_roll_call") == "ok":
        return True
    if isinstance(message, dict) and isinstance(message.get("error"), str):
        raise ConfigError(message["error"])
    raise ConfigError(
        f"distributed.coordinator_address={address}: what answered there is not xshard's "
        "process 0 calling the roll of its processes, but another program. Give every process "
        "of one run process 0's host:port, a port no other program uses."
    )


def _http2(reply: bytes) -> bool:
    """Whether `reply` begins as an HTTP/2 server does: a SETTINGS frame on stream 0."""
    return len(reply) >= 9 and reply[3] == 0x04 and reply[5:9] == bytes(4)


def _too_late(address: str, me: Answer) -> str:
    """The one line of a process that came after its run formed."""
    return (
        f"distributed.process_id={me.process_id}: the run at distributed.coordinator_address="
        f"{address} formed already (JAX's coordinator answered there): every one of its "
        "processes had answered the roll, so this process is one too many, and was kept out "
        "so as not to disturb it. Give each process its own distributed.process_id, "
        f"0 <= process_id < distributed.num_processes={me.num_processes}, and start "
        "num_processes of them."
    )


class RollCall:
    """Process 0's side: listens on the coordinator's port until every process answered.

    Answers are kept per connection; a connection that closes takes its answer with it (the
    process ended, and may be started again). Process 0's own answer counts from the start
    (its own connection, if it makes one, says the same). `reply`, once set, is what every
    process is told. Use `hold`.
    """

    def __init__(
        self, listener: socket.socket, opts: DistributedOptions, me: Answer, deadline: float
    ):
        self.listener, self.me, self.deadline = listener, me, deadline
        self.reply: bytes | None = None
        self.address = opts.coordinator_address
        self.count = opts.num_processes
        self.answers: dict[socket.socket, Answer] = {}
        self.unread: dict[socket.socket, bytes] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._serve, name="xshard-roll-call", daemon=True)
        self._stopped = threading.Event()

    @classmethod
    def hold(cls, opts: DistributedOptions, me: Answer, deadline: float) -> RollCall | None:
        """Listens on the coordinator's port and calls the roll in a thread; None if the port
        is taken (this process then answers whoever holds it).

        Raises:
          ConfigError: if the port cannot be listened on for another reason.
        """
        port = int(str(opts.coordinator_address).rpartition(":")[2])
        try:
            if socket.has_dualstack_ipv6():
                listener = socket.create_server(
                    ("::", port), family=socket.AF_INET6, dualstack_ipv6=True
                )
            else:
                listener = socket.create_server(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                logger.warning("Port %d is taken: answering the roll call held there.", port)
                return None
            raise ConfigError(
                f"distributed.coordinator_address={shown(opts.coordinator_address)}: process 0 "
                f"cannot listen on port {port} ({e.strerror or e}). Choose a port this host "
                "lets a process listen on (above 1023, not in use)."
            ) from e
        roll = cls(listener, opts, me, deadline)
        roll.thread.start()
        return roll

    def stop(self) -> None:
        """Stops listening (after the reply, or when this process gives up) and waits for it."""
        self._stopped.set()
        self.thread.join(timeout=SEND_TIMEOUT_S * (len(self.answers) + 2))

    def _serve(self) -> None:
        try:
            while self.reply is None and not self._stopped.is_set():
                if time.monotonic() >= self.deadline:
                    break
                self._read_ready()
                self.reply = self._reply()
            if self.reply is not None:
                for conn in list(self.answers):
                    _send(conn, self.reply)
        except Exception as e:  # the roll call must never end the process
            logger.error("The roll call on the coordinator's port failed: %r", e)
        finally:
            for conn in [*self.unread, *self.answers]:
                with contextlib.suppress(OSError):
                    conn.close()
            self.selector.close()
            self.listener.close()

    def _read_ready(self) -> None:
        """Accepts connections and reads answers for up to `PROBE_EVERY_S`."""
        for key, _ in self.selector.select(PROBE_EVERY_S):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is self.listener:
                conn, _ = self.listener.accept()
                conn.setblocking(False)
                self.unread[conn] = b""
                self.selector.register(conn, selectors.EVENT_READ)
                continue
            try:
                chunk = sock.recv(MAX_LINE)
            except OSError:
                chunk = b""
            if not chunk:  # the process ended (or gave up): its answer goes with it
                self._drop(sock)
                continue
            if sock in self.answers:  # one answer per connection: the rest is ignored
                continue
            self.unread[sock] += chunk
            line, newline, _ = self.unread[sock].partition(b"\n")
            answer = Answer.parse(line) if newline else None
            if answer is not None:
                del self.unread[sock]
                self.answers[sock] = answer
            elif newline or len(self.unread[sock]) > MAX_LINE:
                self._drop(sock)  # not a roll call

    def _drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        self.answers.pop(sock, None)
        self.unread.pop(sock, None)
        sock.close()

    def _reply(self) -> bytes | None:
        """The reply to send every process: an error, "ok" when all answered, or None yet."""
        answers = [self.me, *self.answers.values()]
        error = roll_call_mistake(answers, self.count, str(self.address))
        if error is not None:
            return json.dumps({"error": error}).encode() + b"\n"
        ids = sorted({a.process_id for a in answers})  # (each from one process: no mistake)
        if ids == list(range(self.count or 0)):
            return b'{"xshard_roll_call": "ok"}\n'
        return None


def _send(conn: socket.socket, reply: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.settimeout(SEND_TIMEOUT_S)
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)


def roll_call_mistake(answers: list[Answer], count: int | None, address: str) -> str | None:
    """The one line naming the first launch mistake among `answers`, or None.

    Args:
      answers: every process's answer so far (process 0's own among them once it arrived).
      count: process 0's ``distributed.num_processes``, which every process must have.
      address: ``distributed.coordinator_address``, for the message.
    """
    answers = list(dict.fromkeys(answers))  # one process answering twice (its own, a retry)
    where = f"the run at distributed.coordinator_address={shown(address)}"
    others = [a for a in answers if a.num_processes != count]
    if others:
        values: dict[int, list[str]] = {}
        for a in sorted(answers, key=lambda a: (a.num_processes != count, a.process_id)):
            values.setdefault(a.num_processes, []).append(_named(a))
        given = "; ".join(f"{n} on {', '.join(who)}" for n, who in values.items())
        return (
            f"distributed.num_processes differs between the processes of {where}: {given}. "
            f"Give every process the same distributed.num_processes (process 0 has {count}), "
            "the number of processes started, each with its own distributed.process_id in "
            "0..num_processes-1."
        )
    for a in answers:
        twice = sorted({b.host for b in answers if b.process_id == a.process_id})
        if len(twice) > 1:
            hosts = " and ".join(twice)
            return (
                f"distributed.process_id={a.process_id} was given to {len(twice)} processes of "
                f"{where} ({hosts}). Give each process its own distributed.process_id, "
                f"0 <= process_id < distributed.num_processes={count}."
            )
    return None


def _named(answer: Answer) -> str:
    return f"process {answer.process_id} ({answer.host})"
