"""When to start again a worker that failed to start, per role: a worker that died
before its start-up profile ran (a bad checkpoint, out of memory loading weights,
no GPU where the node promised one), whose profile failed (its engine could not
run its first steps), or that no node took within `start_timeout_s`.

Started again at once, as a worker that dies while serving is, a bad checkpoint
is a crash loop: before this, a pool of one P and one D on the tiny model started
and lost a worker of each role every 4 s, for ever, and `/health` said only
"starting". So each failure in a row of a role waits twice as long as the one
before it (`restart_backoff_s`, then 2x, 4x, ... up to `restart_backoff_max_s`),
as Kubernetes spaces the restarts of a crashing container. The run ends when a
worker of the role started since its latest failure has run its start-up
profile (an older one doing so says nothing of the starts that fail; a round's
workers lost together count once, from its first failure): the next failure
waits `restart_backoff_s` again. A worker an autoscaling pool does not
start again (its policy decides what it needs) holds the policy's next start of
the role for as long: a scale-up no node took was otherwise tried again each
`scale_up_cooldown_s`, for ever.

Plain Python with the caller's clock: the pool manager's control loop
(cluster/pool_autoscaler.py) reports failures, takes the restarts that are due,
and counts those still waiting as starting workers (so a pool's policy holds,
rather than start one at once through its minimum)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class StartFailure:
    """A role's latest start failure, while its run lasts (for /health)."""

    worker_id: str
    error: str
    failures_in_a_row: int
    next_start_in_s: float | None  # a waiting restart's, else the pool's policy's next start; None: now


class RestartBackoff:
    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._in_a_row: dict[str, int] = defaultdict(int)
        self._latest: dict[str, tuple[str, str]] = {}  # role -> (worker_id, error) of its latest failure
        self._round_s: dict[str, float] = {}  # role -> when the latest failure counted in the run came
        self._waiting: dict[str, list[float]] = defaultdict(list)  # role -> when each waiting restart is due
        self._not_before: dict[str, float] = {}  # role -> when its pool's policy may start one again

    def failed(self, role: str, worker_id: str, error: str, now_s: float, restart: bool = True,
               started_s: float | None = None) -> float | None:
        """A worker of `role`, started at `started_s`, failed to start: its restart
        is due after the delay returned (seconds); with `restart` False, none
        waits, and the pool's policy starts what it needs after the delay
        (`held_s`). A worker started before
        the failure that began the role's latest round is of that round, not one
        more in the run: the workers of one start lost together (their node went)
        waited 2, 4, 8, 16 s, and /health said four failures in a row after one
        round. The round keeps its first failure's time: moved to each of its
        failures, a restart started between them that ran its profile did not end
        the run."""
        round_s = self._round_s.get(role)
        if round_s is None or started_s is None or started_s > round_s:
            self._in_a_row[role] += 1
            self._round_s[role] = now_s
        self._latest[role] = (worker_id, error)
        doublings = min(self._in_a_row[role] - 1, 64)  # (past the cap anyway: 2.0**1024 overflows a float)
        delay_s = min(self.first_s * 2.0 ** doublings, self.max_s)
        if restart:
            self._waiting[role].append(now_s + delay_s)
        else:
            self._not_before[role] = now_s + delay_s
        return delay_s

    def held_s(self, role: str, now_s: float) -> float:
        """How long the pool's policy waits yet before it starts a worker of `role`."""
        return max(self._not_before.get(role, now_s) - now_s, 0.0)

    def drop_waiting(self, role: str) -> bool:
        """One waiting restart of `role` not made (its pool shrank); whether one waited."""
        times = self._waiting[role]
        if not times:
            return False
        times.remove(max(times))
        return True

    def started(self, role: str, started_s: float) -> None:
        """A worker of `role`, started at `started_s`, ran its start-up profile:
        if it started after the failure that began the role's latest round, the
        run of failures ends (restarts already waiting keep their time)."""
        round_s = self._round_s.get(role)
        if round_s is not None and started_s >= round_s:
            self._in_a_row.pop(role, None)
            self._latest.pop(role, None)
            self._round_s.pop(role, None)
            self._not_before.pop(role, None)

    def take_due(self, now_s: float) -> list[str]:
        """The role of each restart due by now (each is taken once)."""
        due = []
        for role, times in self._waiting.items():
            due += [role] * sum(t <= now_s for t in times)
            times[:] = [t for t in times if t > now_s]
        return due

    def num_waiting(self, role: str) -> int:
        return len(self._waiting[role])

    def failures(self, now_s: float) -> dict[str, StartFailure]:
        """Each role whose latest start failed, and nothing since started."""
        out = {}
        for role, (worker_id, error) in sorted(self._latest.items()):
            times = self._waiting[role]
            held_s = self.held_s(role, now_s)
            next_start_in_s = max(min(times) - now_s, 0.0) if times else held_s if held_s > 0 else None
            out[role] = StartFailure(worker_id, error, self._in_a_row[role],
                                     None if next_start_in_s is None else round(next_start_in_s, 1))
        return out


def death_reason(exc: BaseException) -> str:
    """One line or so for why a worker died, from Ray's error: the exception its
    constructor raised (Ray's message ends with the traceback), or the first line
    of Ray's account (killed, out of memory, node lost)."""
    lines = [line for line in str(exc).replace("\x1b[36m", "").replace("\x1b[39m", "").splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if frames:  # the raised exception: what follows the last frame's (indented) source lines
        raised = [line for line in lines[frames[-1] + 1:] if not line.startswith(" ")]
        if raised:
            return " ".join(raised)[:500]
    return (lines[0] if lines else type(exc).__name__)[:500]
