"""Which errors of a call to a worker say it died (cluster/actor_errors.py): Ray's
`ActorUnavailableError`, for an actor unreachable for now, is a `RayActorError`
too, and the scheduler read it as a death: it reported a live decode worker dead,
and the pool manager killed it with every request it ran."""

from __future__ import annotations

import asyncio

import pytest
import ray

from actors.messages import GenerateRequest, ReservationRefused
from actors.sampling_params import SamplingParams
from cluster.actor_errors import actor_died, actor_unavailable
from cluster.pd_request import DisaggregatedCall
from cluster.token_feeds import TokenFeeds


def test_an_unreachable_actor_is_not_dead():
    unreachable = ray.exceptions.ActorUnavailableError("the actor is unreachable for now", None)
    assert actor_unavailable(unreachable) and not actor_died(unreachable)
    assert actor_died(ray.exceptions.ActorDiedError()) and not actor_unavailable(ray.exceptions.ActorDiedError())
    assert not actor_died(None) and not actor_died(RuntimeError("a step failed"))


@ray.remote(num_cpus=0)
class Unreachable:
    """A worker's calls as they fail while it cannot be reached (its feed waits)."""

    async def reserve(self, *args):
        raise ray.exceptions.ActorUnavailableError("the actor is unreachable for now: RPC failed", None)

    async def feed(self, subscription, owner=None):  # (the call's feed to D, opened before its handshake)
        await asyncio.sleep(3600)
        yield []

    async def abort(self, request_id, reason="aborted"):
        return False


def test_a_handshake_with_an_unreachable_decode_worker_is_refused_not_a_death(ray_local):
    prefill, decode = Unreachable.remote(), Unreachable.remote()
    request = GenerateRequest("r1", list(range(1, 40)), SamplingParams(max_new_tokens=2))

    async def scenario():
        feeds = TokenFeeds()
        try:
            async for _ in DisaggregatedCall(prefill, decode, request, "gloo", feeds=feeds).events():
                pass
        finally:
            await feeds.close()

    with pytest.raises(ReservationRefused, match="unreachable"):  # another D is tried; this one is not reported
        asyncio.run(scenario())
    ray.kill(prefill)
    ray.kill(decode)
