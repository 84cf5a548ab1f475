"""Health of the gang: a heartbeat file per rank, and a watchdog that names a dead or hung rank and its step.

Each rank's thread rewrites `<run>/health/rank_NNNNN.json` (attempt, step, pid, host, time) every `period`
seconds and reads everyone else's. A rank of this gang whose process is gone (same host, by /proc) is dead;
one whose heartbeat is older than `reliability.heartbeat_timeout_s` is hung. Then the lowest live rank records a
`detected` event and prints one line naming the rank and its step, and every live rank exits with
EXIT_PEER_FAILED, so that torchrun (`--max-restarts`) restarts the gang from the last checkpoint instead of
waiting out the collective timeout. A collective that fails in training ('Connection reset by peer' when a gloo
peer dies) and torchrun's SIGTERM to the survivors go through the same diagnosis, so whichever comes first
names the culprit. Heartbeat files live in the run directory, which multi-node runs already share for records.

Each gang claims the run directory (`<run>/health/gang.json`, rank 0 at start) and every rank watches the claim:
a gang that finds another's there leaves (EXIT_SUPERSEDED). This fences off a node that torchrun's c10d
rendezvous declared dead while it was only late with its keep-alive: the rendezvous drops it without telling it,
and it would otherwise go on training as a second gang in the same run directory (seen on a loaded 2-core
machine with keep_alive_interval=1, keep_alive_max_attempt=2). Leaving sends its agent back to the rendezvous.

The verdict is also kept in `<run>/health/failure.json` (the failed gang's shape, the dead rank's last heartbeat
as the failure time) until the next gang's first step, when rank 0 times the restart (`executor.elastic`). The
first failure of a run of failed attempts is kept: the restart is timed from it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import NoReturn

EXIT_PEER_FAILED = 4
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_SUPERSEDED = 5
FAILURE_FILE = "failure.json"
GANG_FILE = "gang.json"


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat."""

    rank: int
    attempt: int
    step: int
    pid: int
    host: str
    time_unix: float
    done: bool = False
    gang: str = ""
    """The claim token of the gang the rank belongs to: two gangs on one run directory share rank numbers."""


@dataclass(frozen=True)
class Verdict:
    """A rank found dead or hung, and at which step."""

    rank: int
    step: int
    cause: str
    """'died' or 'hung'."""
    silent_s: float

    def message(self, timeout_s: float) -> str:
        if self.cause == "died":
            what = f"rank {self.rank} died at step {self.step} (its process is gone)"
        else:
            what = f"rank {self.rank} hung at step {self.step} (no heartbeat for {self.silent_s:.1f} s > {timeout_s} s)"
        return f"{what}; the gang stops so that torchrun --max-restarts restarts it from the last checkpoint"


def pid_alive(pid: int) -> bool:
    """Whether a process on this host is running (a zombie, exited but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def diagnose(
    beats: list[Beat],
    attempt: int,
    now: float,
    timeout_s: float,
    host: str,
    alive: Callable[[int], bool],
    gang: str = "",
) -> Verdict | None:
    """The rank of this attempt that is dead or hung, by its heartbeat; None if all are well.

    Of several, the one silent longest: the first to fail takes its peers' collectives down with it.
    """
    found = []
    for beat in beats:
        if beat.attempt != attempt or beat.gang != gang or beat.done:
            continue
        if beat.host == host and not alive(beat.pid):
            found.append(Verdict(beat.rank, beat.step, "died", now - beat.time_unix))
        elif now - beat.time_unix > timeout_s:
            found.append(Verdict(beat.rank, beat.step, "hung", now - beat.time_unix))
    return max(found, key=lambda v: (v.silent_s, -v.rank), default=None)


class Health:
    """This rank's heartbeat and its watch over the others."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        timeout_s: float,
        event: Callable[..., None],
        gang: Mapping[str, int] | None = None,
        token: str = "",
    ) -> None:
        self.dir = run_dir / "health"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.timeout_s, self.event, self.gang = rank, timeout_s, event, dict(gang or {})
        self.token = token
        """This gang's claim on the run directory ('' claims nothing and watches nothing)."""
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.period = min(0.5, timeout_s / 6)
        self.host, self.step = socket.gethostname(), 0
        self.stopped = threading.Event()
        self.paused = False
        self.lock = threading.Lock()  # the beat thread and the main thread both write this rank's file
        self.done = False
        """This rank has said it is done (finished, failing or superseded): every later write says so too, so that
        the heartbeat thread, past its wait when `finish` runs, cannot write an undone beat over the done one and
        have the rank's exit taken for a death."""
        self.failing = False
        """A verdict is being recorded: the heartbeat thread, the main thread (`explain`) and the SIGTERM handler
        can each reach one, at once when torchrun stops the gang while the watchdog names the dead rank."""
        self.failing_lock = threading.RLock()  # reentrant: the SIGTERM handler can interrupt the main thread's fail
        self.thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._write()
        self.thread.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def beat(self, step: int) -> None:
        """A new step begins: say so at once, so that a verdict names the step a rank died in."""
        self.step = step
        self._write()

    def pause(self) -> None:
        """Stop beating and watching: what a hung rank looks like from outside."""
        self.paused = True
        self.stopped.set()

    def finish(self) -> None:
        """This rank is done: the others must not take its exit for a death."""
        self.stopped.set()
        self._write(done=True)

    def _write(self, done: bool = False) -> None:
        path = self.dir / f"rank_{self.rank:05d}.json"
        with self.lock:
            self.done = self.done or done
            beat = Beat(self.rank, self.attempt, self.step, os.getpid(), self.host, time.time(), self.done, self.token)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(asdict(beat)))
            tmp.replace(path)

    def read(self) -> list[Beat]:
        beats = []
        for path in self.dir.glob("rank_*.json"):
            try:
                beats.append(Beat(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # being replaced right now; the next round reads it
        return beats

    def check(self) -> Verdict | None:
        return diagnose(self.read(), self.attempt, time.time(), self.timeout_s, self.host, pid_alive, self.token)

    def claim(self) -> None:
        """Rank 0 of a new gang: the run directory is this gang's from now on."""
        path = self.dir / GANG_FILE
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"token": self.token, "gang": self.gang, "time_unix": time.time()}))
        tmp.replace(path)

    def superseded(self) -> bool:
        """Whether another gang has claimed the run directory since this one did."""
        if not self.token:
            return False
        try:
            return bool(json.loads((self.dir / GANG_FILE).read_text())["token"] != self.token)
        except (OSError, ValueError, KeyError):
            return False  # being replaced right now, or never claimed: the next round reads it

    def _leave_superseded(self) -> NoReturn:
        if self.rank == 0:
            message = (
                f"another gang has taken over {self.dir.parent} (the rendezvous dropped this node, most likely "
                "for a late keep-alive); this gang stops so that its agent rejoins the rendezvous"
            )
            self.event("superseded", self.step, {"message": message})
            print(f"error: {message}", file=sys.stderr, flush=True)
        self.stopped.set()
        self._write(done=True)
        os._exit(EXIT_SUPERSEDED)

    def _loop(self) -> None:
        while not self.stopped.wait(self.period):
            if self.superseded():
                self._leave_superseded()
            self._write()
            verdict = self.check()
            if verdict is not None and not self.stopped.is_set():
                self.fail(verdict)

    def fail(self, verdict: Verdict) -> NoReturn:
        """Record the verdict (once, from the lowest live rank) and leave, for torchrun to restart the gang."""
        with self.failing_lock:
            first, self.failing = not self.failing, True
        if not first:  # another thread of this rank records the verdict and ends the process
            while True:
                time.sleep(self.period)
        mine = [b for b in self.read() if b.attempt == self.attempt and b.gang == self.token]
        live = [b.rank for b in mine if b.rank != verdict.rank]
        if self.rank == min(live, default=self.rank):
            message = verdict.message(self.timeout_s)
            detail = {"cause": verdict.cause, "silent_s": verdict.silent_s, "message": message}
            self.event("detected", verdict.step, detail, rank=verdict.rank, duration_s=verdict.silent_s)
            self._keep_failure(verdict)
            print(f"error: {message}", file=sys.stderr, flush=True)
        self.stopped.set()
        self._write(done=True)  # leaving on purpose: whoever looks next must not blame this rank
        os._exit(EXIT_PEER_FAILED)

    def _keep_failure(self, verdict: Verdict) -> None:
        """Write failure.json for the next gang's restart clock, unless an earlier failure still waits there."""
        now = time.time()
        facts = {
            "time_unix": now - verdict.silent_s,
            "detected_unix": now,
            "rank": verdict.rank,
            "step": verdict.step,
            "cause": verdict.cause,
            "attempt": self.attempt,
            "gang": self.gang,
        }
        try:
            fd = os.open(self.dir / FAILURE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            json.dump(facts, f)

    def explain(self) -> None:
        """After a failed collective: wait for the watchdog's verdict and leave with it; return if there is none.

        This rank first marks itself done, so that its own exit is not taken for the failure it reports.
        """
        self.stopped.set()
        self._write(done=True)
        deadline = time.monotonic() + self.timeout_s + 2 * self.period
        while time.monotonic() < deadline:
            verdict = self.check()
            if verdict is not None:
                self.fail(verdict)
            time.sleep(self.period)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """torchrun stops the gang because some rank failed: name it if we can; either way, this one is not it."""
        if self.failing:
            return  # this rank is recording a verdict already (maybe in the frame this handler interrupted)
        verdict = None if self.paused else self.check()
        if verdict is not None:
            self.fail(verdict)
        if not self.paused:
            self.stopped.set()
            self._write(done=True)
        os._exit(EXIT_TERMINATED)
