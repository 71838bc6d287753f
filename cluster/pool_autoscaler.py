"""The pool manager's control loop: worker readiness, drains, and each pool's scaling
policy, once every `autoscaling.interval_s`.

One step:
1. Readiness. A started worker is *ready* once its first ping answers; one not
   ready within `start_timeout_s` is given up (killed). It is *serving* from the
   first request a scheduler reports having routed to it.
   A worker has *started* once its start-up profile answers (a call the
   autoscaler makes as the worker starts).
2. Stats of every ready worker (`WorkerStats`: KV blocks, running, waiting,
   reserved requests; why its start-up profile failed, if it did).
   Start failures (died before its profile answered, the profile failed, not
   ready in time) are started again after a delay that grows with each in a row
   (cluster/restart_backoff.py); restarts that wait count as starting workers.
3. Drains. A drain that waits for another worker of its role to start (make
   before break: pool_manager.py `drain`) begins once one has. A draining worker
   is retired (its block accounting checked, then the actor killed) once it has
   drained for `drain_grace_s`, holds no request (nothing running, waiting or
   reserved) and every live scheduler replica reports it as draining with nothing
   in flight there. After `drain_timeout_s` it is killed regardless; the
   scheduler retries what had no token yet.
4. Policies (cluster/autoscaling.py), one per pool that autoscales: observation ->
   decision. `up` starts a worker with the pool's placement (not while a run of
   start failures holds the role's next start: `RestartBackoff.held_s`); `down`
   drains the serving worker with the least work (the newest on a tie). A fixed
   pool is kept at its `replicas` (`_keep_size`).

Every change is logged and kept as a `ScalingEvent` (kinds: up, down, started,
ready, serving, start_failed, restart, drain_waits, drain_started, drained, drain_timeout,
died_draining, died (not replaced: the pool at its maximum without it), replaced, resized,
taken_back: a worker scaled down, still draining, serving again at a scale-up);
decisions are counted in `ray_tandem_autoscale_decisions_total`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import ray

from actors.deadlines import within
from actors.worker_base import WorkerStats
from cluster.actor_errors import actor_died, actor_unavailable
from cluster.autoscaling import Action, Decision, PoolObservation, make_policy
from cluster.config import AppSettings
from cluster.pool_metrics import PoolMetrics
from cluster.restart_backoff import RestartBackoff, StartFailure, death_reason
from cluster.scaling_signals import SchedulerReport, SignalBook

log = logging.getLogger("tandem.autoscaler")
FIGURE = {"prefill": "ttft", "decode": "tbt"}
MAX_EVENTS = 10_000


@dataclass(frozen=True)
class ScalingEvent:
    time_s: float  # wall clock (time.time)
    role: str
    kind: str
    worker_id: str | None = None
    signal: str = ""
    reason: str = ""
    stats: WorkerStats | None = None  # drained: the worker's counts at its accounting check


@dataclass
class _Track:
    """The control loop's notes on one worker."""

    started_s: float
    ready: object  # concurrent Future of the worker's first answer (its WorkerStartup)
    profiled: object  # concurrent Future of its start-up profile (`profile`)
    requested_wall: float = 0.0  # time.time() when the actor was asked for
    ready_s: float | None = None
    profiled_s: float | None = None  # a step saw its profile answered (and told the restart backoff)
    serving_s: float | None = None
    drain_started_s: float | None = None
    stats: WorkerStats | None = None


def log_to_stderr() -> None:
    """Scaling events at INFO on stderr (the actor's log file; the driver's console
    with `log_to_driver`). A plain actor has no handler for them otherwise."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class PoolAutoscaler:
    stats_timeout_s = 10.0

    def __init__(self, manager, settings: AppSettings, roles: tuple[str, ...], clock=time.monotonic) -> None:
        self.manager = manager  # the PoolManager: members, _start, drain
        self.knobs = settings.autoscaling
        self.clock = clock
        self.roles = roles
        slo = settings.slo
        self.signals = SignalBook(slo.ttft_ms / 1e3, slo.tbt_ms / 1e3, self.knobs.window_s)
        self.attainment_target = slo.attainment
        self.policies = {role: make_policy(role, getattr(settings, role), self.knobs, slo.attainment)
                         for role in roles if getattr(settings, role).autoscales}
        self.tracks: dict[str, _Track] = {}
        # Drains waiting for another worker of their role to start: worker id -> (the drain's reason, since)
        self.awaiting_drain: dict[str, tuple[str, float]] = {}
        self.scaled_down: set[str] = set()  # workers a policy's DOWN drains: a scale-up takes one back
        self.history: dict[str, deque[tuple[float, int, int]]] = {role: deque() for role in roles}  # load per step
        self.events: deque[ScalingEvent] = deque(maxlen=MAX_EVENTS)
        self.num_events = 0  # ever recorded (the index of the next one)
        self.metrics = PoolMetrics()
        self.restarts = RestartBackoff(self.knobs.restart_backoff_s, self.knobs.restart_backoff_max_s)

    # ---- what the manager tells us --------------------------------------------------------
    def on_started(self, member) -> None:
        handle = member.handle
        self.tracks[member.worker_id] = _Track(self.clock(), handle.startup_times.remote().future(),
                                               handle.profile.remote().future(), time.time())
        self.record(member.role, "started", member.worker_id)

    def is_ready(self, worker_id: str) -> bool:
        track = self.tracks.get(worker_id)
        if track is None:
            return False
        return _succeeded(track.ready)

    def has_started(self, worker_id: str) -> bool:
        """The worker answered its start-up profile: a death after it is no start
        failure. Read from the profile's future, not the latest stats (up to
        `interval_s` old), so that a worker killed just after its profile is
        replaced at once, not started again after a backoff as a failure."""
        track = self.tracks.get(worker_id)
        return track is not None and _succeeded(track.profiled)

    def state_of(self, member) -> str:
        """starting (no first answer yet), ready, serving (a scheduler routed it a
        request), or draining."""
        track = self.tracks.get(member.worker_id)
        if member.draining:
            return "draining"
        if track is None or not self.is_ready(member.worker_id):
            return "starting"
        return "serving" if track.serving_s is not None else "ready"

    def on_gone(self, member) -> None:
        """A worker found dead is out of the pool. One that ran its profile, which
        no step saw yet, still ends its role's run of start failures."""
        track = self.tracks.pop(member.worker_id, None)
        if track is not None:
            self._note_profiled(member, track, self.clock())
        self.awaiting_drain.pop(member.worker_id, None)
        self.scaled_down.discard(member.worker_id)

    @staticmethod
    def _ask_again_if_unreachable(member, track: _Track) -> None:
        """A worker's first answer or profile that failed as unreachable for a
        moment (not dead) is asked for again: kept failed, a healthy worker was
        never ready, held its pool "in progress" until `start_timeout_s`, and was
        then killed as a start failure (and one whose profile failed so was never
        "started": its later death was taken for a start failure)."""
        if track.ready.done() and actor_unavailable(track.ready.exception()):
            track.ready = member.handle.startup_times.remote().future()
        if track.profiled.done() and actor_unavailable(track.profiled.exception()):
            track.profiled = member.handle.profile.remote().future()

    def _note_profiled(self, member, track: _Track, now: float) -> None:
        """Once a worker's start-up profile answered: its start ends a run of
        start failures of its role (`RestartBackoff.started`)."""
        if track.profiled_s is None and _succeeded(track.profiled):  # a failed one: its stats say why
            track.profiled_s = now
            self.restarts.started(member.role, track.started_s)

    def start_failed(self, member, reason: str) -> None:
        """The worker failed to start: gone (killed), another of its role started
        after the backoff's delay; unless it was leaving (draining, or waiting to),
        which is only removed, as `PoolManager.report_dead` does: its replacement,
        if it needed one, was started by the drain, and a restart besides counted
        as one more worker of the pool, which then drained a serving one. In an
        autoscaling pool that keeps its minimum without it (a scale-up no node
        took), none is restarted: the policy decides again. Restarted, such a
        worker was given up and started again for good, and the policy held
        ("in progress") all the while: an idle pool never scaled down. Judged
        by the member as it stands now: a caller's copy from before an await
        (`_poll_stats`' stats) did not say a drain begun meanwhile, and the
        drained worker counted as a start failure besides."""
        member = self.manager.members.get(member.worker_id)
        if member is None:  # (gone meanwhile: whoever removed it said why)
            return
        leaving = self.is_leaving(member)
        track = self.tracks.get(member.worker_id)
        self._remove(member)
        if leaving:
            self.record(member.role, "died_draining", member.worker_id, reason=reason)
            return
        role = member.role
        kept = self.num_staying(role) + self.restarts.num_waiting(role)
        restart = role not in self.policies or kept < self.manager.pools[role].min_size
        delay_s = self.restarts.failed(role, member.worker_id, reason, self.clock(), restart,
                                       None if track is None else track.started_s)
        self.metrics.start_failed(role)
        self.record(role, "start_failed", member.worker_id, reason=f"{reason}; " + (
            f"next start in {delay_s:g} s" if restart
            else f"not started again: the pool's policy decides, its next start in {delay_s:g} s at the soonest"))

    def set_pool(self, role: str, pool) -> None:
        """A pool's new sizes (a redeploy): its policy anew, or none for a fixed pool."""
        if pool.autoscales:
            before = self.policies.get(role)
            self.policies[role] = make_policy(role, pool, self.knobs, self.attainment_target)
            if before is not None:
                self.policies[role].carry_on_from(before)
        else:
            self.policies.pop(role, None)
        sizes = f"{pool.min_size} to {pool.max_size} workers" if pool.autoscales else f"size {pool.replicas}"
        self.record(role, "resized", reason=f"redeployed: {sizes}")

    def retune(self, settings: AppSettings) -> None:
        """A redeploy's autoscaling knobs and SLO targets, from now on: the signals
        judge new outcomes by the new SLO (those already in the window keep their
        verdicts until they age out of it), and each autoscaling pool's policy is
        rebuilt on them, keeping what the old one learned (`ScalingPolicy.carry_on_from`)."""
        self.knobs, slo = settings.autoscaling, settings.slo
        self.attainment_target = slo.attainment
        self.signals.slo_s = {"ttft": slo.ttft_ms / 1e3, "tbt": slo.tbt_ms / 1e3}
        self.signals.window_s = self.knobs.window_s
        self.restarts.first_s, self.restarts.max_s = self.knobs.restart_backoff_s, self.knobs.restart_backoff_max_s
        for role, policy in list(self.policies.items()):
            self.policies[role] = make_policy(role, getattr(settings, role), self.knobs, slo.attainment)
            self.policies[role].carry_on_from(policy)
        for role in self.roles:
            self.record(role, "retuned", reason="redeployed: autoscaling and slo settings")

    def _remove(self, member) -> None:
        """The worker out of the pool (and of the drains waiting) and its actor killed."""
        self.manager.members.pop(member.worker_id, None)
        self.tracks.pop(member.worker_id, None)
        self.awaiting_drain.pop(member.worker_id, None)
        self.scaled_down.discard(member.worker_id)
        try:
            ray.kill(member.handle)
        except Exception:  # already gone
            pass

    def start_failures(self) -> dict[str, StartFailure]:
        return self.restarts.failures(self.clock())

    def drain_when_replaced(self, member, reason: str) -> None:
        """Drain `member` once another worker of its role has started; it serves until then."""
        self.awaiting_drain[member.worker_id] = (reason, self.clock())
        self.record(member.role, "drain_waits", member.worker_id,
                    reason=f"{reason}; it serves until another {member.role} worker has started")

    def _begin_awaited_drains(self, now: float) -> None:
        for worker_id, (reason, since) in list(self.awaiting_drain.items()):
            member = self.manager.members.get(worker_id)
            if member is None:
                del self.awaiting_drain[worker_id]
            elif any(self.has_started(m.worker_id) for m in self._members(member.role) if not self.is_leaving(m)):
                del self.awaiting_drain[worker_id]
                self.manager.begin_drain(member, reason)
            elif now - since >= self.knobs.start_timeout_s:
                del self.awaiting_drain[worker_id]
                self.manager.begin_drain(member, f"{reason}; none started within {self.knobs.start_timeout_s:g} s")

    def num_staying(self, role: str) -> int:
        """The role's workers not leaving (starting ones included)."""
        return sum(1 for m in self._members(role) if not self.is_leaving(m))

    def is_leaving(self, member) -> bool:
        """Draining, or waiting to drain: not counted, chosen or replaced as a serving worker."""
        return member.draining or member.worker_id in self.awaiting_drain

    def on_drain(self, member, reason: str) -> None:
        track = self.tracks.get(member.worker_id)
        if track is not None:
            track.drain_started_s = self.clock()
        self.record(member.role, "drain_started", member.worker_id, reason=reason)

    def on_taken_back(self, member, reason: str) -> None:
        track = self.tracks.get(member.worker_id)
        if track is not None:
            track.drain_started_s = None
        self.scaled_down.discard(member.worker_id)
        self.record(member.role, "taken_back", member.worker_id, reason=reason)

    def _recallable(self, role: str) -> list:
        """The role's workers draining because a policy scaled the pool down."""
        return [m for m in self._members(role) if m.draining and m.worker_id in self.scaled_down]

    def on_report(self, report: SchedulerReport) -> None:
        now = self.clock()
        self.signals.add(report, now)
        for worker_id, count in report.routed.items():
            track = self.tracks.get(worker_id)
            member = self.manager.members.get(worker_id)
            if count and track is not None and member is not None and track.serving_s is None:
                track.serving_s = now
                self.record(member.role, "serving", worker_id)

    def record(self, role: str, kind: str, worker_id: str | None = None, signal: str = "", reason: str = "",
               stats: WorkerStats | None = None) -> None:
        self.events.append(ScalingEvent(time.time(), role, kind, worker_id, signal, reason, stats))
        self.num_events += 1
        log.info("pool %s: %s %s %s %s", role, kind, worker_id or "", signal, reason)

    def events_since(self, index: int) -> list[ScalingEvent]:
        first = self.num_events - len(self.events)
        return list(self.events)[max(index - first, 0):]

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.knobs.interval_s)
            try:
                await self.step()
            except Exception:  # keep scaling; one bad step is logged
                log.exception("autoscaler step failed")

    async def step(self) -> None:
        now = self.clock()
        due = self.restarts.take_due(now)
        failures = self.restarts.failures(now) if due else {}
        for role in due:
            latest = failures.get(role)
            self.record(role, "restart", reason=f"after {latest.worker_id} failed to start ({latest.failures_in_a_row} "
                        "in a row)" if latest else "after a start failure")
            self.manager._start(role)
        self._check_readiness(now)
        await self._poll_stats(now)
        self._begin_awaited_drains(now)
        await self._finish_drains(now)
        for role in self.roles:
            try:
                await self._step_role(role, now)
            except Exception:  # (the roles after it are still decided: one role's failing start stalled them)
                log.exception("autoscaler step failed for the %s pool", role)

    async def _step_role(self, role: str, now: float) -> None:
        observation = self.observe(role, now)
        self._export(role, observation)
        policy = self.policies.get(role)
        if policy is None:
            await self._keep_size(role, observation)
            return
        decision = policy.decide(observation, now)
        if decision.action is Action.UP and not self._recallable(role) and self.restarts.held_s(role, now) > 0:
            return  # a run of start failures: the scale-up waits as a restart would (one taken back starts nothing)
        if decision.action is not Action.HOLD and await self._carry_out(role, decision):
            policy.stepped(now)

    def _members(self, role: str | None = None) -> list:
        return [m for m in self.manager.members.values() if role is None or m.role == role]

    def _check_readiness(self, now: float) -> None:
        for member in self._members():
            track = self.tracks.get(member.worker_id)
            if track is None:
                continue
            self._ask_again_if_unreachable(member, track)
            self._note_profiled(member, track, now)
            if track.ready_s is not None:
                # Its profile (a few prefills and decode steps) given as long after its first answer: one
                # that never answered counted as serving, never routed to, never started again
                if (track.profiled_s is None and not track.profiled.done()
                        and now - track.ready_s > self.knobs.start_timeout_s):
                    self.start_failed(member, f"its start-up profile did not answer within "
                                              f"{self.knobs.start_timeout_s:.0f} s of its start")
                continue
            error = track.ready.exception() if track.ready.done() else None
            if track.ready.done() and error is None:
                track.ready_s = now
                where = track.ready.result().describe(track.requested_wall)
                self.record(member.role, "ready", member.worker_id,
                            reason=f"{now - track.started_s:.1f} s after start: {where}")
            elif actor_died(error):  # died starting
                self.start_failed(member, f"died starting: {death_reason(error)}")
            elif now - track.started_s > self.knobs.start_timeout_s:  # (its first answer unreachable too)
                self.start_failed(member, f"not ready within {self.knobs.start_timeout_s:.0f} s (no node for it?)")

    async def _poll_stats(self, now: float) -> None:
        ready = [m for m in self._members() if self.tracks.get(m.worker_id) and self.tracks[m.worker_id].ready_s]
        results = await asyncio.gather(
            *(within(m.handle.stats.remote(), self.stats_timeout_s) for m in ready), return_exceptions=True)
        for member, stats in zip(ready, results):
            track = self.tracks.get(member.worker_id)
            if track is None or not isinstance(stats, WorkerStats):
                continue
            track.stats = stats
            if stats.profile_error is not None:
                self.start_failed(member, f"start-up profile failed: {stats.profile_error}")

    def _starting(self, role: str) -> list:
        """The role's workers started and not ready yet (none leaving)."""
        return [m for m in self._members(role) if not self.is_leaving(m)
                and not (self.tracks.get(m.worker_id) and self.tracks[m.worker_id].ready_s is not None)]

    def observe(self, role: str, now: float) -> PoolObservation:
        members = self._members(role)
        tracks = {m.worker_id: self.tracks.get(m.worker_id) for m in members}
        serving = [m.worker_id for m in members if not self.is_leaving(m) and tracks[m.worker_id]
                   and tracks[m.worker_id].ready_s is not None]
        num_starting = len(self._starting(role)) + self.restarts.num_waiting(role)
        draining = [m for m in members if self.is_leaving(m)]
        policy = self.policies.get(role)
        since = policy.settled_s if policy is not None else float("-inf")
        attainment, num_samples = (self.signals.attainment(FIGURE[role], now, since, self.knobs.min_samples)
                                   if role in FIGURE else (None, 0))
        stats = {w: tracks[w].stats for w in serving if tracks[w].stats is not None}
        # Blocks reserved for prompts still in prefill measure the prefill backlog, not decode load. D
        # counts them itself: the same moment as its blocks in use (the schedulers' reports are not).
        decoding = sum(max(s.num_used_blocks - s.num_reserved_blocks, 0) for s in stats.values())
        # Handshakes in D's lines: no scale-down while any waits (a full pool with a line read as 10% used,
        # and was scaled down). Not load: a burst passes through an idle D's line too, one call each.
        waiting = sum(s.num_waiting_handshakes for s in stats.values()) if role == "decode" else 0
        backlog = self.signals.backlog_tokens(serving, now) if role == "prefill" else 0
        history = self.history[role]
        history.append((now, backlog, decoding))
        while history[0][0] < now - self.knobs.window_s:
            history.popleft()
        return PoolObservation(
            num_serving=len(serving), num_starting=num_starting, num_draining=len(draining),
            num_recallable=len(self._recallable(role)),
            attainment=attainment, num_samples=num_samples, samples_span_s=min(self.knobs.window_s, now - since),
            backlog_tokens=backlog,
            kv_blocks_used=decoding, kv_blocks_total=sum(s.num_blocks for s in stats.values()),
            handshakes_waiting=waiting,
            backlog_tokens_peak=max(b for _, b, _ in history), kv_blocks_used_peak=max(k for _, _, k in history))

    def _export(self, role: str, obs: PoolObservation) -> None:
        self.metrics.pool(role, obs.num_serving, obs.num_starting, obs.num_draining)
        serving = max(obs.num_serving, 1)
        self.metrics.signals(role, obs.attainment,
                             obs.backlog_tokens / serving if role == "prefill" else None,
                             obs.kv_blocks_used / obs.kv_blocks_total if role == "decode" and obs.kv_blocks_total
                             else None)

    async def _carry_out(self, role: str, decision: Decision) -> bool:
        """A policy's step; whether it was taken (`ScalingPolicy.stepped`)."""
        self.metrics.decision(role, decision.action.value, decision.signal)
        if decision.action is Action.UP:
            self.record(role, "up", signal=decision.signal, reason=decision.reason)
            recallable = self._recallable(role)
            if recallable:  # (the latest drained: the most of its cache left)
                latest = max(recallable, key=lambda m: self.tracks[m.worker_id].drain_started_s)
                self.manager.take_back(latest, f"scale up: {decision.reason}")
            else:
                self.manager._start(role)
            return True
        victim = self._least_loaded(role)
        if victim is None:
            return False
        self.record(role, "down", victim, decision.signal, decision.reason)
        if await self.manager.drain(victim, f"scale down: {decision.reason}") == "draining":
            self.scaled_down.add(victim)
            return True
        return False

    async def _keep_size(self, role: str, obs: PoolObservation) -> None:
        """A fixed pool at its `replicas`: what is missing started (a worker no
        node took, one drained by hand, a bigger size redeployed), one too many
        drained each step (a smaller size)."""
        size = self.manager.pools[role].replicas
        have = obs.num_serving + obs.num_starting
        for _ in range(size - have):
            self.record(role, "up", signal="below_size", reason=f"{have} workers, the pool's size is {size}")
            self.manager._start(role)
        if have <= size:
            return
        # One too many: a restart still waiting, else a worker not ready yet (the newest),
        # else the least loaded serving one. (Serving ones alone were drained: one still
        # starting stayed, and the role could be left without a worker taking requests.)
        reason = f"{have} workers, the pool's size is {size}"
        if self.restarts.drop_waiting(role):
            self.record(role, "down", None, "above_size", f"{reason}: a waiting restart dropped")
            return
        # (a first answer that came during this step's awaits: the schedulers list that worker,
        # and route to it at once; it is drained, not stopped as one not ready yet)
        self._check_readiness(self.clock())
        starting = self._starting(role)
        if starting:
            newest = max(starting, key=lambda m: self.tracks[m.worker_id].started_s if m.worker_id in self.tracks
                         else float("inf"))
            self.record(role, "down", newest.worker_id, "above_size", f"{reason}: one not ready yet stopped")
            self._remove(newest)
            return
        victim = self._least_loaded(role)
        if victim is not None:
            self.record(role, "down", victim, "above_size", reason)
            await self.manager.drain(victim, f"the pool's size is {size}")

    def _least_loaded(self, role: str) -> str | None:
        now = self.clock()
        candidates = []
        for member in self._members(role):
            track = self.tracks.get(member.worker_id)
            if self.is_leaving(member) or track is None or track.ready_s is None:
                continue
            stats = track.stats
            work = self.signals.inflight(member.worker_id, now)
            if stats is not None:
                work += stats.num_running + stats.num_waiting + stats.num_reserved + stats.num_waiting_handshakes
            candidates.append((work, -track.started_s, member.worker_id))
        return min(candidates)[2] if candidates else None

    # ---- drains ---------------------------------------------------------------------------------
    async def _finish_drains(self, now: float) -> None:
        for member in [m for m in self._members() if m.draining]:
            track = self.tracks.get(member.worker_id)
            if track is None or track.drain_started_s is None:
                continue
            elapsed = now - track.drain_started_s
            stats = track.stats
            holds_nothing = stats is not None and not (stats.num_running or stats.num_waiting or stats.num_reserved
                                                       or stats.num_waiting_handshakes)
            if elapsed >= self.knobs.drain_grace_s and holds_nothing and self.signals.released(member.worker_id, now):
                await self._retire(member, "drained", f"idle after draining {elapsed:.1f} s")
            elif elapsed >= self.knobs.drain_timeout_s:
                await self._retire(member, "drain_timeout", f"still busy after {elapsed:.0f} s; killed")

    async def _retire(self, member, kind: str, reason: str) -> None:
        stats = None
        try:
            stats = await within(member.handle.check_accounting.remote(), self.stats_timeout_s)
            reason += f"; accounting ok, {stats.num_used_blocks} blocks in use"
        except Exception as exc:  # a broken invariant or a dead worker: say so, retire anyway
            reason += f"; accounting check failed: {type(exc).__name__}: {exc}"
        self._remove(member)
        self.record(member.role, kind, member.worker_id, reason=reason, stats=stats)


def _succeeded(future) -> bool:
    """A concurrent Future of an actor call that has answered, without an error."""
    return future.done() and not future.cancelled() and future.exception() is None
