"""Responses: a conversation continued by `previous_response_id` or on a conversation object, against it sent whole.

OpenAI's Responses API lets a client send only a turn's new message and name the
response it continues (cluster/response_store.py keeps them), or the
conversation it is on (cluster/stored_conversations.py); the server then builds
the prompt the whole conversation would give. This runs `--conversations`
conversations of `--turns` turns through one disaggregated deployment (tiny
preset), three ways, turn by turn, in rotating order:
- `client-kept`: each turn's `input` is the whole conversation so far (the user
  messages and the earlier answers' output items, as an agent loop sends them),
  `store: false`;
- `stored`: each turn's `input` is its new user message, with the previous
  response's id (stored, the API's default);
- `conversation`: each turn's `input` is its new user message, with the id of a
  conversation object made before the first turn (not timed); its responses are
  stored too, the API's default.
The ways have conversations of their own (same lengths, other words), so none
finds another's prefix in the cache.

Then `--streams` pairs of streamed answers of `--stream-tokens` tokens, alternating
which goes first: one in the foreground (`stream`), one in the background
(`background` and `stream`: its task writes the events the POST reads, and
keeps them in the store every 100 ms). Reported: the time to the first text
delta, the median gap between deltas, the whole stream's time (medians), and
the background's whole time over the foreground's. One request at a time, greedy,
unstreamed. Reported, by turn and over all turns: the request's body bytes, the
latency at the client (median), input and cached tokens. The prompts are the
same length for both (the store hands the same items back): what differs is what
crosses the network and the store's calls (stored: a lookup, a put; on a
conversation: its turn begun, ended, and the put).

    tandem bench responses         # about a minute
"""

from __future__ import annotations

import argparse
import json
import random
import time

from benchmarks import report
from benchmarks.arguments import positive_int

WORDS = ("river stone market lantern orchard copper signal harbour meadow ledger violet window canyon "
         "thistle beacon saddle quarry summit willow engine parcel garnet tundra fable").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=positive_int, default=4)
    parser.add_argument("--turns", type=positive_int, default=8)
    parser.add_argument("--first-words", type=positive_int, default=150, help="words of each first user message")
    parser.add_argument("--user-words", type=positive_int, default=20, help="words of each later user message")
    parser.add_argument("--output-tokens", type=positive_int, default=16, help="max_output_tokens a turn")
    parser.add_argument("--streams", type=positive_int, default=6, help="pairs of streamed answers")
    parser.add_argument("--stream-tokens", type=positive_int, default=200, help="max_output_tokens a streamed answer")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "?"


class Conversation:
    """One conversation, sent one of the two ways."""

    def __init__(self, way: str, seed: int, args) -> None:
        self.way, self.args = way, args
        self.rng = random.Random(seed)
        self.items: list[dict] = []  # the whole conversation, as the client keeps it
        self.previous: str | None = None
        self.conversation_id: str | None = None

    def turn(self, client, turn: int) -> dict:
        message = {"role": "user", "content": _text(self.rng, self.args.first_words if turn == 0 else
                                                    self.args.user_words)}
        self.items.append(message)
        body = {"max_output_tokens": self.args.output_tokens, "temperature": 0}
        if self.way == "stored":
            body |= {"input": [message], **({"previous_response_id": self.previous} if self.previous else {})}
        elif self.way == "conversation":
            if turn == 0:
                made = client.post("/v1/conversations", json={})
                made.raise_for_status()
                self.conversation_id = made.json()["id"]
            body |= {"input": [message], "conversation": self.conversation_id}
        else:
            body |= {"input": self.items, "store": False}
        payload = json.dumps(body).encode()
        started = time.perf_counter()
        response = client.post("/v1/responses", content=payload, headers={"content-type": "application/json"})
        latency = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{self.way} turn {turn}: {response.status_code} {response.text[:300]}")
        answer = response.json()
        self.previous = answer["id"]
        self.items += answer["output"]
        usage = answer["usage"]
        return {"bytes": len(payload), "latency_s": latency, "input_tokens": usage["input_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"]}


def streamed(client, background: bool, tokens: int) -> dict:
    """One streamed answer's timing at the client: first text delta, gaps, whole."""
    body = {"input": "keep going", "max_output_tokens": tokens, "temperature": 0, "stream": True,
            **({"background": True} if background else {})}
    started = time.perf_counter()
    arrivals = []
    with client.stream("POST", "/v1/responses", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"streamed (background {background}): {response.status_code} {response.read()[:300]}")
        for line in response.iter_lines():
            if line == "event: response.output_text.delta":
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"first_s": arrivals[0] - started, "gap_s": report.median(gaps), "total_s": time.perf_counter() - started,
            "num_deltas": len(arrivals)}


def main(args: argparse.Namespace) -> None:
    import httpx

    from benchmarks.serve_cluster import ServeCluster
    from benchmarks.serve_scenarios import app_settings

    settings = app_settings(argparse.Namespace(preset="tiny", arch="qwen2", kv_cache_mib=256), mode="disaggregated")
    ways = ("client-kept", "stored", "conversation")
    runs: dict[str, list[list[dict]]] = {way: [[] for _ in range(args.turns)] for way in ways}
    with ServeCluster(num_cpus=8) as cluster:
        url = cluster.deploy({"responses": settings})["responses"]
        with httpx.Client(base_url=url, timeout=120) as client:
            for way in ways:  # warm-up: a short conversation each way
                warm = Conversation(way, -1, argparse.Namespace(**{**vars(args), "first_words": 8, "user_words": 4}))
                for turn in range(2):
                    warm.turn(client, turn)
            conversations = {way: [Conversation(way, 1000 * k + w, args) for k in range(args.conversations)]
                             for w, way in enumerate(ways)}
            for turn in range(args.turns):
                for k in range(args.conversations):
                    shift = (turn + k) % len(ways)
                    for way in ways[shift:] + ways[:shift]:
                        runs[way][turn].append(conversations[way][k].turn(client, turn))
            streams: dict[str, list[dict]] = {"foreground": [], "background": []}
            for k in range(args.streams + 1):  # (the first pair a warm-up)
                for background in ((False, True) if k % 2 == 0 else (True, False)):
                    timing = streamed(client, background, args.stream_tokens)
                    if k:
                        streams["background" if background else "foreground"].append(timing)
    fields = ("bytes", "input_tokens", "cached_tokens", "latency_s")
    medians = {way: [{f: report.median([run[f] for run in turn]) for f in fields} for turn in runs[way]]
               for way in ways}
    kept_ways = ways[1:]  # (each against client-kept)

    def ms_ratio(way: str, turn: int) -> str:
        return report.fmt_ratio(report.ratio(medians[way][turn]["latency_s"],
                                             medians["client-kept"][turn]["latency_s"]))

    rows = [[turn + 1, *(medians[way][turn][f] * (1000 if f == "latency_s" else 1) for way in ways for f in fields),
             *(ms_ratio(way, turn) for way in kept_ways)] for turn in range(args.turns)]
    report.print_table(
        f"{args.conversations} conversations of {args.turns} turns, one request at a time (medians over the "
        "conversations)",
        ["turn", *(f"{way} {label}" for way in ways for label in ("bytes", "input tokens", "cached", "ms")),
         *(f"{way} / client-kept ms" for way in kept_ways)], rows)
    overall = {way: {f: report.median([run[f] for turn in runs[way] for run in turn]) for f in fields}
               for way in ways}
    latency_ratios = {way: report.ratio(overall[way]["latency_s"], overall["client-kept"]["latency_s"])
                      for way in kept_ways}
    bytes_ratio = report.ratio(medians["stored"][-1]["bytes"], medians["client-kept"][-1]["bytes"])
    figure = (f"a stored conversation's turn takes {report.fmt_ratio(latency_ratios['stored'])} the client-kept "
              f"one's time, one on a conversation object {report.fmt_ratio(latency_ratios['conversation'])} (medians "
              f"of all turns); the stored last turn sends {report.fmt_ratio(bytes_ratio)} the bytes")
    stream_medians = {way: {f: report.median([run[f] for run in runs_]) for f in ("first_s", "gap_s", "total_s")}
                      for way, runs_ in streams.items()}
    report.print_table(
        f"{args.streams} pairs of streamed answers of {args.stream_tokens} tokens (medians)",
        ["way", "first delta ms", "gap between deltas ms", "whole stream ms"],
        [[way, *(m[f] * 1000 for f in ("first_s", "gap_s", "total_s"))] for way, m in stream_medians.items()])
    stream_ratio = report.ratio(stream_medians["background"]["total_s"], stream_medians["foreground"]["total_s"])
    figure += f"; a background stream takes {report.fmt_ratio(stream_ratio)} the foreground one's time"
    report.finish("responses", args.out, {"args": vars(args) | {"func": None}, "runs": runs, "medians": medians,
                                          "overall": overall, "streams": streams, "stream_medians": stream_medians,
                                          "machine": report.machine_info()},
                  figure, "at most 1x the time")
