"""Shared fixtures: the built-in tiny checkpoints and their Hugging Face twins."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_model_dir(request):
    """The tiny preset of each architecture, built once per machine."""
    from actors.model_builder import ensure_checkpoint

    return ensure_checkpoint("tiny", request.param)


@pytest.fixture(scope="session")
def tiny_qwen2_dir():
    from actors.model_builder import ensure_checkpoint

    return ensure_checkpoint("tiny", "qwen2")


_HF_CACHE: dict = {}


def hf_model(model_dir):
    """transformers' own model for a checkpoint, float32, cached per folder."""
    from transformers import AutoModelForCausalLM

    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
    return _HF_CACHE[key]


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, EOS disabled (compare with ignore_eos)."""
    model = hf_model(model_dir)
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.eos_token_id = None
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    config.min_new_tokens = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(model_dir, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF's log-softmax at each output position for the chosen token."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 :].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the whole session (logical CPUs; no dashboard)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
