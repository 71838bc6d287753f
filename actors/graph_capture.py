"""Capturing a step's forward as CUDA graphs, one per bucket of sizes (the decode
steps' batch sizes, the prefill steps' token counts): shared by
`actors/decode_graphs.py` and `actors/prefill_graphs.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


@torch.inference_mode()
def capture_buckets(buckets: list[int], forward: Callable[[int], torch.Tensor],
                    what: str) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """`forward(size)` captured for every bucket, largest first, into one memory pool
    (vLLM and SGLang do the same: the graphs share their intermediate activations),
    each after a warm-up run on a side stream (Triton compiles, cuBLAS and cuDNN
    pick their kernels). Returns {size: (graph, output)}; empty if any capture fails
    (a kernel that synchronises with the host, an old driver): the caller then runs
    `what` eagerly, as it logs."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    pool = torch.cuda.graph_pool_handle()
    try:
        for size in sorted(buckets, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = forward(size)
            graphs[size] = (graph, output)
    except Exception as exc:  # any kernel that cannot be captured: run eagerly
        logger.warning("CUDA graph capture failed (%s: %s); %s run eagerly", type(exc).__name__, exc, what)
        graphs.clear()
    torch.cuda.synchronize()
    return graphs
