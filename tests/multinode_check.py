"""Run as a script by tests/test_multinode.py: a fake multi-node Ray cluster on one
machine (ray.cluster_utils.Cluster), nodes labelled prefill and decode with logical
GPUs. Checks placement by label, a request served across nodes, a prompt prefix
computed by the prefill worker on one node reused (through the KV store's shared
path) by the prefill worker on the other, and that the pool replaces a killed worker
on a node of the right role. Prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from actors.config import ModelLocation  # noqa: E402
from actors.llm import LLM  # noqa: E402
from actors.messages import GenerateRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402
from cluster.config import AppSettings  # noqa: E402
from cluster.pd_request import DisaggregatedCall  # noqa: E402
from cluster.pool_manager import get_or_create_pool  # noqa: E402


def main() -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "labels": {"tandem/role": "head"}})
    prefill_nodes = [cluster.add_node(num_cpus=2, num_gpus=1, labels={"tandem/role": "prefill"}) for _ in range(2)]
    decode_node = cluster.add_node(num_cpus=2, num_gpus=1, labels={"tandem/role": "decode"})
    ray.init(address=cluster.address, log_to_driver=False)
    settings = AppSettings.model_validate({
        "model": {"preset": "tiny"},
        "engine": {"block_size": 16, "num_kv_blocks": 256, "prefill_chunk_size": 32},
        "prefill": {"replicas": 2, "num_cpus": 1, "num_gpus": 1, "label_selector": {"tandem/role": "prefill"}},
        "decode": {"replicas": 1, "num_cpus": 1, "num_gpus": 1, "label_selector": {"tandem/role": "decode"}},
        "pool_name": "multinode-pool",
        # Host memory per node, and a shared path both nodes see (a temp dir here).
        "kv_store": {"host_gib": 0.05, "shared_path": tempfile.mkdtemp(prefix="tandem-shared-"), "ttl_s": 3600},
    })
    pool = get_or_create_pool(settings)
    members = ray.get(pool.wait_ready.remote(180))
    role_of_node = {n.node_id: "prefill" for n in prefill_nodes} | {decode_node.node_id: "decode"}
    placement = {m.worker_id: (m.role, role_of_node.get(ray.get(m.handle.node_id.remote()), "head")) for m in members}

    prefill, other_prefill = [m for m in members if m.role == "prefill"]
    decode = next(m for m in members if m.role == "decode")
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    request = GenerateRequest("across-nodes", list(range(1, 90)), greedy)

    def run(p, r):
        async def events():
            call = DisaggregatedCall(p.handle, decode.handle, r, "gloo")
            return call, [e async for e in call.events()]

        return asyncio.run(events())

    call, events = run(prefill, request)
    tokens = [t for e in events for t in e.token_ids]

    # The same conversation, one turn on, to the prefill worker on the other node.
    ray.get(prefill.handle.kv_store_stats.remote())  # its write-through is done
    turn_2 = GenerateRequest("next-turn", request.prompt_token_ids + tokens + list(range(200, 230)), greedy)
    call_2, events_2 = run(other_prefill, turn_2)
    reference = LLM(ModelLocation(preset="tiny").resolve(), enable_prefix_cache=False).generate(
        [turn_2.prompt_token_ids], greedy)[0].token_ids
    reuse = {
        "nodes": [placement[prefill.worker_id][1], placement[other_prefill.worker_id][1]],
        "same_node": ray.get(prefill.handle.node_id.remote()) == ray.get(other_prefill.handle.node_id.remote()),
        "prompt_tokens": len(turn_2.prompt_token_ids),
        "computed_tokens": call_2.prefill_result.num_computed_tokens,
        "store_loaded_blocks": ray.get(other_prefill.handle.stats.remote()).num_store_loaded_blocks,
        "identical": [t for e in events_2 for t in e.token_ids] == reference,
    }

    ray.kill(prefill.handle)
    deadline = time.monotonic() + 90
    replaced = None
    while time.monotonic() < deadline and replaced is None:
        time.sleep(1)
        current = ray.get(pool.list_members.remote())
        fresh = [m for m in current if m.role == "prefill" and m.worker_id not in placement]
        if fresh:
            ray.get(fresh[0].handle.ping.remote())
            replaced = (fresh[0].worker_id, role_of_node.get(ray.get(fresh[0].handle.node_id.remote()), "head"))
    ray.get(pool.shutdown.remote())
    ray.shutdown()
    cluster.shutdown()
    return {"placement": placement, "tokens": tokens, "error": events[-1].error, "replaced": replaced,
            "reuse": reuse}


if __name__ == "__main__":
    print(json.dumps(main()))
