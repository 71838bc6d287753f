"""The systems the engine benchmark compares, each loaded once and run on a whole
workload: Tandem's `LLM`, transformers' static-batch `generate`, and transformers'
continuous-batching manager (see `benchmarks/engine.py` for how they are driven).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.engine_workloads import Workload


@dataclass
class RunResult:
    elapsed_s: float
    token_ids: list[list[int]]
    extra: dict = field(default_factory=dict)


class TandemSystem:
    name = "tandem"

    def __init__(self, model_dir: Path, engine_args: dict) -> None:
        from actors.llm import LLM

        self.llm = LLM(model_dir, **engine_args)

    def run(self, workload: Workload) -> RunResult:
        from actors.sampling_params import SamplingParams

        params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in workload.max_new_tokens]
        steps_before = self.llm.engine.num_steps
        started = time.perf_counter()
        outputs = self.llm.generate(workload.prompts, params)
        elapsed = time.perf_counter() - started
        return RunResult(elapsed, [o.token_ids for o in outputs], {
            "num_steps": self.llm.engine.num_steps - steps_before,
            "num_cached_tokens": sum(o.num_cached_tokens for o in outputs),
        })


def load_hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos, as for Tandem
    return model


class HFStaticSystem:
    name = "hf_static"

    def __init__(self, model, batch_size: int, pad_token_id: int) -> None:
        self.model, self.batch_size, self.pad_token_id = model, batch_size, pad_token_id

    def run(self, workload: Workload) -> RunResult:
        import torch

        token_ids: list[list[int]] = []
        num_generated = 0
        started = time.perf_counter()
        for first in range(0, workload.num_requests, self.batch_size):
            prompts = workload.prompts[first : first + self.batch_size]
            wants = workload.max_new_tokens[first : first + self.batch_size]
            width, longest = max(len(p) for p in prompts), max(wants)
            input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                    do_sample=False, pad_token_id=self.pad_token_id,
                )
            assert out.shape[1] == width + longest, (out.shape, width, longest)
            token_ids += [row[width : width + n].tolist() for row, n in zip(out, wants)]
            num_generated += len(prompts) * longest
        elapsed = time.perf_counter() - started
        return RunResult(elapsed, token_ids, {"num_generated_tokens_incl_waste": num_generated})


class HFContinuousSystem:
    """transformers' continuous batching manager (what `generate_batch` wraps)."""

    name = "hf_cb"

    def __init__(self, model, max_batch_tokens: int, max_num_seqs: int, kv_cache_bytes: int) -> None:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        page_size = 256
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bytes_per_page = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4 * page_size
        self.model = model
        self.cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=max(8, kv_cache_bytes // bytes_per_page),
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
        )

    def run(self, workload: Workload) -> RunResult:
        import torch
        from transformers import GenerationConfig

        generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        with torch.inference_mode():
            manager = self.model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=self.cb_config
            )
            manager.warmup()
            started = time.perf_counter()
            manager.start()
            try:
                ids = [
                    manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                    for i, (p, n) in enumerate(zip(workload.prompts, workload.max_new_tokens))
                ]
                results = {}
                while len(results) < len(ids):
                    result = manager.get_result(timeout=1)
                    if result is None and not manager.is_running():
                        raise RuntimeError("transformers continuous batching thread stopped early")
                    if result is not None and result.is_finished():
                        if result.error is not None:
                            raise RuntimeError(f"transformers continuous batching: {result.error}")
                        results[result.request_id] = result
                elapsed = time.perf_counter() - started
            finally:
                manager.stop(block=True, timeout=30)
                manager.destroy()
        return RunResult(elapsed, [list(results[i].generated_tokens) for i in ids])
