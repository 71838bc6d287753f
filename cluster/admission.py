"""SLO admission with prediction-based early rejection (after Mooncake).

For each candidate P: predicted TTFT = the wait for D's KV blocks when D has no
room (`cluster.decode_lines`) + the predicted prefill time still queued on P + what
this request's *uncached* tokens add to it (a step's fixed part only when they need
a step of their own: `own_prefill_s`) + the transfer of its last chunk of the
blocks D lacks (`cluster.transfer_model`, learned per pair). For each candidate D:
predicted TBT at the moment that prefill would finish, counting the requests D
will still be decoding then (those that end sooner drop out) plus those whose
prefill lands before. A request that no pair can serve
within the SLO is rejected before any prefill compute is spent on it.

The models start from each worker's start-up profile (pure compute) and then learn
from what the scheduler observes: P's timed prefill steps (read with its stats)
refit its prefill model, every gap between tokens refits D's step model, every
first token updates P's TTFT bias and every finished request D's TBT bias (see
`observe_prefill_steps`, `observe_token_gap`, `observe_ttft`, `observe_tbt`;
each bias the attainment quantile of the model's errors, `cluster.learned_bias`),
and every prefill's chunk timings refit its P-D pair's transfer model.

With several scheduler replicas each admits its own requests, so each adds the
others' load (`peers`, from the pool manager's answer to its latest report, at most
a refresh interval old) to what it knows: their prompt tokens still in prefill on a
worker, as one more prefill queued there, and their decoding requests and KV tokens
on a D, as part of its batch from now on. Without it, N replicas would each admit
as if the workers were theirs alone.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from actors.messages import PrefillStep
from cluster.cost_model import LinearCostModel, decode_features, prefill_step_features
from cluster.learned_bias import LearnedBias
from cluster.scaling_signals import PeerLoad
from cluster.transfer_model import TransferModels


@dataclass
class InFlight:
    """What the scheduler knows about one admitted request."""

    request_id: str
    prefill_id: str | None
    decode_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    predicted_ttft_s: float  # at admission: D's line, queue on P, prefill, transfer, learned bias
    admitted_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    num_generated: int = 0
    line_wait_s: float = 0.0  # the predicted part of predicted_ttft_s spent in D's line
    ttft_bias_s: float = 0.0  # the learned part of predicted_ttft_s (WorkerModels.observe_ttft)
    reserved_s: float | None = None  # when D reserved its blocks (P starts then)
    ahead_id: str | None = None  # the request whose predicted end was the queue ahead of it, at admission
    early_s: float = 0.0  # how much sooner than predicted that queue ended (WorkerModels.first_token_came)
    failed_id: str | None = None  # the worker its error came from, where the error says (a retry leaves it out)
    own_s: float = 0.0  # the predicted part of predicted_ttft_s that is its own work: prefill and transfer
    peers_s: float = 0.0  # the part of predicted_ttft_s that was the other replicas' backlog on its P
    decode_held_blocks: int = 0  # its prompt's blocks D held for running requests at admission (shared with them)
    prefix_hashes: tuple[bytes, ...] = ()  # its prompt's blocks a cache may serve (D shares them with later requests)
    num_cached_tokens: int = 0  # its prompt's tokens its P (or colocated worker) had cached, predicted at admission

    @property
    def in_prefill(self) -> bool:
        return self.first_token_s is None

    def reserved(self) -> None:
        self.reserved_s = time.monotonic()

    def waited_in_line_s(self, now_s: float) -> float:
        """Its time from admission to D's reservation (its handshake, and D's
        line), up to `now_s` while it still waits; 0 where no D reserves (colocated)."""
        if self.prefill_id is None:
            return 0.0
        return (now_s if self.reserved_s is None else self.reserved_s) - self.admitted_s

    @property
    def in_line(self) -> bool:
        """Waiting for D's reservation (its handshake)."""
        return self.prefill_id is not None and self.reserved_s is None

    @property
    def first_token_due_s(self) -> float | None:
        """When its first token is predicted (monotonic); None while it waits in a
        D's line it was predicted to wait in: not P's work yet (the line's own
        prediction counts it, cluster/decode_lines.py). Once reserved, its own
        work starts when the queue P had at its admission ends, or at the
        reservation if later: that queue ran on while it waited in the line
        (counted from the reservation, it made P look busy for that long again,
        and a later request was refused for it)."""
        if self.reserved_s is not None:
            own_s = self.own_s + self.ttft_bias_s
            queue_end_s = self.admitted_s + self.predicted_ttft_s - self.line_wait_s - own_s
            return max(self.reserved_s, queue_end_s) + own_s - self.early_s
        if self.line_wait_s:
            return None
        return self.admitted_s + self.predicted_ttft_s - self.early_s


@dataclass(frozen=True)
class Prediction:
    prefill_id: str | None
    decode_id: str
    ttft_s: float
    tbt_s: float
    uncached_tokens: int
    ttft_bias_s: float = 0.0  # the learned part of ttft_s (see WorkerModels.observe_ttft)
    line_wait_s: float = 0.0  # the part of ttft_s spent waiting for D's KV blocks (cluster/decode_lines.py)
    tbt_bias_s: float = 0.0  # the learned part of tbt_s (see WorkerModels.observe_tbt)
    ahead_id: str | None = None  # the request whose predicted end is the queue ahead (`queued_prefill_s`)
    own_s: float = 0.0  # its own prefill and transfer (the queue, the line and the bias aside)
    peers_s: float = 0.0  # the other replicas' backlog on its P, in ttft_s (`WorkerModels.queued_prefill_s`)

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        return self.ttft_s <= ttft_slo_s and self.tbt_s <= tbt_slo_s


class SloRejected(Exception):
    """No pair can meet the SLO: answer 429 with the prediction and the target."""

    def __init__(self, best: Prediction, ttft_slo_s: float, tbt_slo_s: float) -> None:
        self.best = best
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s
        over = max(best.ttft_s - ttft_slo_s, 0.0)
        self.retry_after_s = max(1, math.ceil(over))
        parts = []
        if best.ttft_s > ttft_slo_s:
            waiting = (f" (of which {best.line_wait_s * 1e3:.0f} ms waiting for a decode worker's KV blocks)"
                       if best.line_wait_s else "")
            parts.append(f"predicted TTFT {best.ttft_s * 1e3:.0f} ms{waiting} exceeds the SLO of "
                         f"{ttft_slo_s * 1e3:.0f} ms")
        if best.tbt_s > tbt_slo_s:
            parts.append(f"predicted TBT {best.tbt_s * 1e3:.0f} ms exceeds the SLO of {tbt_slo_s * 1e3:.0f} ms")
        super().__init__("; ".join(parts) or "over capacity")


class WorkerModels:
    """Per-worker cost models and in-flight bookkeeping."""

    def __init__(self, block_size: int, bias_quantile: float = 0.9, prefill_chunk_size: int = 256,
                 max_num_batched_tokens: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.clock = clock  # monotonic seconds: the in-flight requests' times are on it
        # A prompt's tokens a step, at most (the engine also keeps a chunk within a step): see prefill_s.
        self.prefill_chunk_size = min(prefill_chunk_size, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens  # a worker's step, in tokens: see own_prefill_s
        self.prefill: dict[str, LinearCostModel] = {}
        self.decode: dict[str, LinearCostModel] = {}
        self.inflight: dict[str, InFlight] = {}
        self.peers = PeerLoad()  # the other scheduler replicas' load per worker
        self.transfers = TransferModels(block_size, self.prefill_chunk_size)
        # The SLO's attainment target as a quantile of the models' errors: see observe_ttft, observe_tbt.
        self.ttft_bias = LearnedBias(bias_quantile)  # per P (or colocated worker)
        self.tbt_bias = LearnedBias(bias_quantile)  # per D (or colocated worker)
        self._steps_seen: dict[str, int] = {}  # per P: the last of its prefill steps fitted (PrefillStep.seq)

    def prefill_model(self, worker_id: str) -> LinearCostModel:
        return self.prefill.setdefault(worker_id, LinearCostModel(2))

    def decode_model(self, worker_id: str) -> LinearCostModel:
        return self.decode.setdefault(worker_id, LinearCostModel(2))

    def seed_from(self, peer_id: str, worker_id: str) -> None:
        """Start `worker_id`'s models from a copy of `peer_id`'s (same model, same
        node type); they diverge as the new worker's own timings arrive: a D's
        step model refits on the token gaps it serves, a P's prefill model on
        its steps and its TTFT bias on its first tokens, a D's TBT bias on the
        requests it finishes."""
        if peer_id in self.prefill:
            self.prefill[worker_id] = copy.deepcopy(self.prefill[peer_id])
        if peer_id in self.decode:
            self.decode[worker_id] = copy.deepcopy(self.decode[peer_id])
        self.ttft_bias.seed_from(peer_id, worker_id)
        self.tbt_bias.seed_from(peer_id, worker_id)

    def forget(self, worker_id: str) -> None:
        self.prefill.pop(worker_id, None)
        self.decode.pop(worker_id, None)
        self.ttft_bias.forget(worker_id)
        self.tbt_bias.forget(worker_id)
        self._steps_seen.pop(worker_id, None)
        self.transfers.forget(worker_id)

    # ---- observations ---------------------------------------------------------------
    def decode_load(self, decode_id: str) -> tuple[int, int]:
        """D's batch and KV tokens now, as far as the schedulers know."""
        decoding = [r for r in self.inflight.values() if r.decode_id == decode_id and not r.in_prefill]
        batch = len(decoding) + self.peers.decoding.get(decode_id, 0)
        kv_tokens = sum(r.num_prompt_tokens + r.num_generated for r in decoding)
        return max(batch, 1), kv_tokens + self.peers.decoding_kv_tokens.get(decode_id, 0)

    def observe_token_gap(self, decode_id: str, seconds: float) -> None:
        """A gap between tokens as the scheduler saw it: D's step plus everything on
        the way (streaming, this replica). Refits D's model on what clients see, so
        the start-up profile's pure step times stop making TBT look better than it is."""
        self.decode_model(decode_id).observe(decode_features(*self.decode_load(decode_id)), seconds)

    def observe_prefill_steps(self, worker_id: str, steps: Iterable[PrefillStep]) -> None:
        """A worker's timed prompt-only steps (its stats, or its start-up profile):
        those after the last one fitted refit its prefill model, so what the
        profile got wrong (a timing or two a prompt length, taken beside the
        other role's profile) does not stay in every prediction. Step numbers
        are the worker's own: an id is never reused for a new process."""
        seen = self._steps_seen.get(worker_id, 0)
        model = self.prefill_model(worker_id)
        for step in steps:
            if step.seq > seen:
                model.observe(prefill_step_features(step.chunks), step.seconds)
                seen = step.seq
        self._steps_seen[worker_id] = seen

    def skip_prefill_steps(self, worker_id: str, through: int) -> None:
        """Steps up to `through` are not live timings (a profile's own, fitted from it)."""
        self._steps_seen[worker_id] = max(self._steps_seen.get(worker_id, 0), through)

    def last_prefill_step(self, worker_id: str) -> int:
        """The worker's latest step its prefill model has seen (0: none)."""
        return self._steps_seen.get(worker_id, 0)

    def observe_ttft(self, prediction: Prediction, observed_s: float) -> None:
        """Learn P's TTFT error (handshake, Ray calls, a line's wait misjudged): the
        bias added to later predictions is the attainment quantile of observed minus
        the model's prediction (without the bias) over P's latest first tokens
        (`cluster.learned_bias`). A quantile, not a mean: a request admitted because
        its predicted TTFT is just inside the SLO meets it as often as the
        prediction is not short, and with a mean error that was about half of them
        (docs/benchmarks.md, tandem bench handshake: the residuals' median -0.12 s,
        their 90th percentile +0.41 s, while an average stayed at 0-0.1 s)."""
        self.ttft_bias.observe(prediction.prefill_id or prediction.decode_id,
                               observed_s - (prediction.ttft_s - prediction.ttft_bias_s))

    def observe_tbt(self, prediction: Prediction, observed_s: float) -> None:
        """Learn D's TBT error from a finished request: its mean gap between tokens
        (what the SLO holds it to, `RequestTimer`) less the step time predicted at
        admission for when it joined D's batch (without the bias). D's step model
        is fitted to the mean of the gaps it serves, and a request's own gaps
        follow D's batch as others join and leave it after its admission: 30-37%
        of the requests took longer than their mean prediction, 15-17% than the
        prediction with this bias (docs/benchmarks.md, tandem bench predictions)."""
        self.tbt_bias.observe(prediction.decode_id, observed_s - (prediction.tbt_s - prediction.tbt_bias_s))

    # ---- predictions ------------------------------------------------------------
    def prefill_s(self, worker_id: str, new_tokens: int, cached_tokens: int) -> float:
        """A prompt's prefill alone: a step a chunk (`prefill_chunk_size` tokens at
        most, as the engine schedules it), each attending to the cached tokens and
        the chunks before it, each paying the step's fixed part."""
        model = self.prefill_model(worker_id)
        return self._steps_s(model, self._chunks(new_tokens, cached_tokens)) if model.is_fitted else 0.0

    @staticmethod
    def _steps_s(model: LinearCostModel, chunks: tuple[tuple[int, int], ...]) -> float:
        """A step a chunk: their summed features, and the fixed part once a step."""
        return model.predict(prefill_step_features(chunks)) + (len(chunks) - 1) * model.fixed_s()

    def _chunks(self, new_tokens: int, cached_tokens: int) -> tuple[tuple[int, int], ...]:
        """The engine's chunks of a prompt: (tokens, tokens before them) each."""
        size = self.prefill_chunk_size
        starts = range(0, max(new_tokens, 1), size)
        return tuple((min(size, new_tokens - start), cached_tokens + start) for start in starts)

    def own_prefill_s(self, worker_id: str, new_tokens: int, cached_tokens: int) -> float:
        """What a new request's prefill adds to the worker's queue. Its model, a
        prompt's time alone, is a fixed part a step (the launch, the layers'
        weights read, the sampling) and a part per token; a prompt that fits in the
        steps the queue takes anyway (in `max_num_batched_tokens` steps, the queue's
        tokens and its own, at least one a chunk of it) shares them and adds its
        tokens' part alone.
        Charged the fixed part each, a burst of 16 short prompts that P computes in
        one or two steps was predicted as 16 of them one after the other
        (`tandem bench predictions`: docs/benchmarks.md)."""
        model = self.prefill_model(worker_id)
        if not model.is_fitted:
            return 0.0
        chunks = self._chunks(new_tokens, cached_tokens)
        alone = self._steps_s(model, chunks)
        queued = self.queued_prefill_tokens(worker_id)
        step = self.max_num_batched_tokens
        num_chunks = len(chunks)
        queue_steps = -(-queued // step)
        if not queued or queue_steps < num_chunks or -(-(queued + new_tokens) // step) > queue_steps:
            return alone
        return max(alone - num_chunks * model.fixed_s(), 0.0)

    def queued_prefill_tokens(self, worker_id: str) -> int:
        """Prompt tokens the worker is predicted still to compute: those of the
        requests whose predicted work there is not over (`queued_prefill_s`; their
        cached tokens counted too) and the other replicas' backlog."""
        now = self.clock()
        mine = sum(r.num_prompt_tokens for r in self.inflight.values()
                   if (r.prefill_id or r.decode_id) == worker_id and r.in_prefill
                   and r.first_token_due_s is not None and r.first_token_due_s - r.ttft_bias_s > now)
        return mine + self.peers.backlog_tokens.get(worker_id, 0)

    def queued_prefill_s(self, worker_id: str) -> float:
        """Predicted time until the worker has finished every prefill admitted to it.

        Each request's TTFT prediction already counts the queue ahead of it, so the
        queue ends with the latest predicted first token (a max, not a sum), less
        that request's learned bias: the bias is what first tokens took beyond the
        model (a handshake, Ray calls, the token's way back), each request's own and
        mostly side by side with the others', so it counts once, in the new
        request's own prediction. Kept in the queue, it was added again for every
        request ahead: a burst of 16 short prompts on an idle tiny-model cluster
        was predicted 5.3 s to its last first token and had 1 in 12 rejected,
        while every first token came within 2.5 s. A request past its predicted
        first token is not done: it is taken to need as long again as it is
        already late, and it delays everything behind it by as much, so the most
        overdue request's lateness is added to what is left. A request waiting in
        a D's line, as predicted, is not the worker's yet
        (`InFlight.first_token_due_s`); nor is one late that still
        waits for D's reservation (its handshake): P has not begun it, its delay is
        D's (a handshake stuck on a full D made every request through that P a
        429, recorded as the prefill pool's miss). The other replicas' prompts
        still in prefill there add their prefill time, once: this replica's queue
        ends where its latest request was due without the other replicas' part of
        its prediction (`InFlight.peers_s`). With it, each request ahead counted
        them again: a peer backlog of 2 s and four 300-token prompts (0.3 s each)
        were predicted 2.3, 4.6, 6.9 and 9.2 s, for about 3.2 s at the last."""
        return self._queue(worker_id)[0]

    def _queue(self, worker_id: str) -> tuple[float, str | None, float]:
        """`queued_prefill_s`, the request whose predicted end it is (None: none),
        and the other replicas' part of it (`peers_prefill_s`)."""
        now = self.clock()
        due = [(r.first_token_due_s, r.ttft_bias_s + r.peers_s, r.request_id, r.in_line) for r in self.inflight.values()
               if (r.prefill_id or r.decode_id) == worker_id and r.in_prefill]  # colocated: no prefill_id
        due = [(at, aside, request_id, in_line) for at, aside, request_id, in_line in due if at is not None]
        peers_s = self.peers_prefill_s(worker_id)
        if not due:
            return peers_s, None, peers_s
        end, _, last = max((at - aside, at, request_id) for at, aside, request_id, _ in due)
        most_late = max([now - at for at, _, _, in_line in due if not in_line], default=0.0)
        return max(end - now, 0.0) + max(most_late, 0.0) + peers_s, last, peers_s

    def peers_prefill_s(self, worker_id: str) -> float:
        """The other replicas' backlog on a P (or colocated worker), as the prompts
        it is of (of its mean length): priced as one prompt of all their tokens,
        its attention term grew with their square."""
        peers_tokens = self.peers.backlog_tokens.get(worker_id, 0)
        if not peers_tokens:
            return 0.0
        peers_prompts = max(self.peers.backlog_prompts.get(worker_id, 1), 1)
        return peers_prompts * self.prefill_s(worker_id, -(-peers_tokens // peers_prompts), 0)

    def first_token_came(self, request: InFlight, now: float) -> None:
        """A request's first token came at `now` (monotonic). Sooner than predicted,
        the queue it ended came to its end that much sooner: so did the queue of
        each request admitted behind it (`ahead_id`), and of each behind those.
        Without this a prediction stood on every one before it, none of them
        corrected when their first tokens came early, and under a steady load the
        queue's predicted end crept up to the TTFT SLO and stayed there: 8 clients
        sending short prompts back to back saw 62% of them refused for a predicted
        TTFT of about 5.07 s while the admitted ones' first tokens took 0.32 s on
        average (docs/benchmarks.md, "Admission under a steady load"). A request
        predicted to wait in a D's line is due from its reservation: not moved.
        Early is against when its worker's part was due, its learned bias aside
        (the queue's end, `_queue`): against its first token's due time, a token
        on time for the model but inside the bias moved the queue behind it by
        the bias, which `_queue` took off again (a burst's predictions then kept
        a margin of one residual, not of the bias)."""
        due = request.first_token_due_s
        if due is None or due - request.ttft_bias_s <= now:
            return
        self._move_behind(request.request_id, due - request.ttft_bias_s - now)

    def gone_before_its_first_token(self, request: InFlight, now: float) -> None:
        """A request that ended before its first token (cancelled, failed, retried
        elsewhere) does not do the work it had left on its worker: the queue of
        each request behind it ends that much sooner. Left as it was, the queue
        read the gone requests' prefill until the next first token came (half of
        a burst cancelled: the next request predicted at 1.09 s, 0.5 s of work)."""
        due = request.first_token_due_s
        if due is None or not request.in_prefill:
            return
        left = min(request.own_s, max(due - request.ttft_bias_s - now, 0.0))
        if left > 0:
            self._move_behind(request.request_id, left)

    def _move_behind(self, request_id: str, early: float) -> None:
        """The queue of each request admitted behind `request_id` (`ahead_id`), and of
        each behind those, ends `early` seconds sooner."""
        behind = [request_id]
        while behind:
            ahead_id = behind.pop()
            for r in self.inflight.values():
                # One predicted to wait in a D's line is due from when D reserved it,
                # not from the queue it was admitted behind: left as it is.
                if r.ahead_id == ahead_id and r.in_prefill and not r.line_wait_s:
                    r.early_s += early
                    behind.append(r.request_id)

    def tbt_at(self, decode_id: str, at_s: float, extra_kv_tokens: int) -> float:
        """Predicted decode step time on D `at_s` seconds from now, with one more
        request of `extra_kv_tokens` joining."""
        model = self.decode_model(decode_id)
        if not model.is_fitted:
            return 0.0
        now = self.clock()
        # The other replicas' decoding requests are taken to last past `at_s`.
        batch = 1 + self.peers.decoding.get(decode_id, 0)
        kv_tokens = extra_kv_tokens + self.peers.decoding_kv_tokens.get(decode_id, 0)
        # The step by which each request's end is reckoned: with D's KV (without it, 32 requests of 6,000
        # tokens, 47 ms a step, read as done in 0.33 s for 1.9 s, and the prediction as 5 ms a step).
        mine = [r for r in self.inflight.values() if r.decode_id == decode_id]
        kv_now = self.peers.decoding_kv_tokens.get(decode_id, 0) + sum(r.num_prompt_tokens + r.num_generated
                                                                       for r in mine)
        step_now = model.predict(decode_features(batch + len(mine), kv_now))
        for request in mine:
            remaining = request.max_new_tokens - request.num_generated
            if request.in_prefill:
                joins_at = max(request.predicted_ttft_s - (now - request.admitted_s), 0.0)
                if joins_at > at_s or joins_at + remaining * step_now < at_s:
                    continue  # still prefilling then, or done by then
            elif remaining * step_now < at_s:
                continue  # done by then
            batch += 1
            kv_tokens += request.num_prompt_tokens + request.num_generated
        return model.predict(decode_features(batch, kv_tokens))

    def predict(self, prefill_id: str | None, decode_id: str, num_prompt_tokens: int, cached_tokens: int,
                decode_cached_blocks: int = 0) -> Prediction:
        uncached = num_prompt_tokens - cached_tokens
        prefill = self.own_prefill_s(prefill_id or decode_id, uncached, cached_tokens)
        queued, ahead_id, peers_s = self._queue(prefill_id or decode_id)
        transfer = 0.0
        if prefill_id is not None:
            blocks = max(math.ceil(num_prompt_tokens / self.block_size) - decode_cached_blocks, 0)
            transfer = self.transfers.last_chunk_s(prefill_id, decode_id, uncached, blocks)
        bias = self.ttft_bias(prefill_id or decode_id)
        ttft = queued + prefill + transfer + bias
        tbt_bias = self.tbt_bias(decode_id)
        tbt = self.tbt_at(decode_id, ttft, num_prompt_tokens) + tbt_bias
        return Prediction(prefill_id, decode_id, ttft, tbt, uncached, bias, tbt_bias_s=tbt_bias, ahead_id=ahead_id,
                          own_s=prefill + transfer, peers_s=peers_s)
