"""Qwen2, Qwen3, Qwen3-MoE and Llama decoder-only models over a paged KV cache.

The families differ only by flags on `ModelConfig` (QKV bias, tied embeddings,
RoPE parameters, Qwen3's RMSNorm of each query and key head before RoPE, and
Qwen3-MoE's mixture of experts in place of a layer's MLP: `SparseMoE`). Module
names follow Hugging Face's so checkpoints load by name; q/k/v and gate/up
projections are stored fused (`qkv_proj`, `gate_up_proj`), one GEMM each, and
`weights.py` maps the HF names onto their slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from actors.attention_metadata import AttentionMetadata
from actors.config import ModelConfig
from kernels.activation import silu_and_mul
from kernels.attention import decode_attention, prefill_attention
from kernels.norm import add_rms_norm, rms_norm
from kernels.rope import rope_cos_sin, rope_inv_freq
from kernels.rope_cache import rope_and_write_kv


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a model calls where more than one implementation exists;
    `ModelRunner` picks them for its device and dtype (the `select_*` functions of
    `kernels`). The defaults are the torch references."""

    prefill_attention: Callable = prefill_attention
    decode_attention: Callable = decode_attention
    linear: Callable = nn.functional.linear
    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope_and_write_kv: Callable = rope_and_write_kv
    silu_and_mul: Callable = silu_and_mul


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same names) computed by a chosen kernel."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernel: Callable) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm of `x`, or, given the residual stream, of `x + residual` (one fused
    kernel where there is one): then returns (normalised, x + residual)."""

    def __init__(self, size: int, eps: float, kernel: Callable, add_kernel: Callable = add_rms_norm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = kernel
        self.add_kernel = add_kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernel(x, self.weight, self.eps)
        return self.add_kernel(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: ModelKernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, kernels.linear)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_bias, kernels.linear)
        if config.qk_norm:  # one weight over head_dim, shared by the heads
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, kernels.rms_norm)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, kernels.rms_norm)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, layer_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q's and k's heads are adjacent in each row: one call rotates them all, and
        # writes k's and v's heads to the cache.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = self._norm_heads(qk)
        rotated = self.kernels.rope_and_write_kv(qk, v, cos, sin, layer_cache, meta.slot_mapping)
        q, k = rotated.split([self.num_heads, self.num_kv_heads], dim=1)

        outputs = []
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            outputs.append(
                self.kernels.prefill_attention(
                    q[rows], k[rows], v[rows], layer_cache, span.block_table, span.ctx_len, self.scale
                )
            )
        if meta.num_decodes:
            outputs.append(
                self.kernels.decode_attention(
                    q[meta.num_prefill_tokens :],
                    layer_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                )
            )
        attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
        return self.o_proj(attn.reshape(num_tokens, self.q_size))

    def _norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """q's heads and k's, each RMS-normalised over head_dim by its own weight:
        two RMSNorm calls and a concatenation before the fused RoPE and cache write
        (a kernel doing all three, as SGLang's fused qk-norm RoPE does, is not
        written; its gain on a GPU is not measured)."""
        num_tokens = qk.shape[0]
        q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
        k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
        return torch.cat([q.view(num_tokens, self.num_heads, self.head_dim),
                          k.view(num_tokens, self.num_kv_heads, self.head_dim)], dim=1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: ModelKernels) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, kernels.linear)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, kernels.linear)
        self.silu_and_mul = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """A sparse layer's experts, each a SiLU-gated MLP, stored as HF's 3D tensors:
    `gate_up_proj` [experts, 2 * moe_intermediate, hidden] (gate rows first),
    `down_proj` [experts, hidden, moe_intermediate]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size, hidden = config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, hidden, size))


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP: the router (`gate`) scores every expert for each token, a
    softmax in float32 picks its `num_experts_per_tok` best (their weights
    renormalised with `norm_topk_prob`), and the token's output is their outputs
    so weighted. Tokens are grouped by expert (a stable sort), each expert runs
    once on its tokens, and the outputs are added back in expert order, as
    transformers does. The groups' sizes are read on the host, so a step holding
    one is not a CUDA graph (`ModelRunner` captures none for these models); a
    fused MoE kernel for GPUs (vLLM's, SGLang's) is not written."""

    def __init__(self, config: ModelConfig, kernels: ModelKernels) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, False, kernels.linear)
        self.experts = Experts(config)
        self.silu_and_mul = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights, chosen = weights.to(x.dtype).flatten(), chosen.flatten()
        order = chosen.argsort(stable=True)  # (token, choice) pairs grouped by expert
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            hidden = self.silu_and_mul(nn.functional.linear(x[tokens], self.experts.gate_up_proj[expert]))
            hidden = nn.functional.linear(hidden, self.experts.down_proj[expert]) * weights[pairs, None]
            out.index_add_(0, tokens, hidden)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, kernels: ModelKernels, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, kernels)
        self.mlp = SparseMoE(config, kernels) if config.is_sparse(index) else MLP(config, kernels)
        norm = dict(kernel=kernels.rms_norm, add_kernel=kernels.add_rms_norm)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)

    def forward(self, x, residual, cos, sin, layer_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings, with residual None, for
        the first layer). Returns this layer's MLP output and the residual stream
        before it: each residual add is fused into the RMSNorm after it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, layer_cache, meta), residual)
        return self.mlp(h), residual


class Model(nn.Module):
    def __init__(self, config: ModelConfig, kernels: ModelKernels) -> None:
        super().__init__()
        # Uninitialised (the checkpoint fills it): on the meta device, `Embedding`'s own normal_
        # init imports torch._dynamo, about a second of each worker's start on 2 CPUs
        # (docs/benchmarks.md, "Session 56").
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(config, kernels, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.rms_norm, kernels.add_rms_norm)
        with torch.device("cpu"):  # (a table to compute, whichever device the model is built on)
            self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        device = torch.get_default_device()
        if device.type == "meta":  # shapes only: torch.arange there would import torch._dynamo too
            cos = sin = torch.empty(config.max_position_embeddings, config.head_dim)
        else:
            cos, sin = rope_cos_sin(self.inv_freq.to(device), config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def make_rope(self, max_positions: int, device) -> None:
        """The RoPE tables, float32, for the positions below `max_positions`, on
        `device` (the engine's: as long as it serves, not the model's whole
        context; a model built on the meta device has none yet)."""
        cos, sin = rope_cos_sin(self.inv_freq, max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids, positions, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for index, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, kv_cache[:, index], meta)
        return self.norm(x, residual)[0]


class ForCausalLM(nn.Module):
    """The whole model. `forward` returns hidden states of every token of the step;
    `compute_logits` projects only the rows that will be sampled."""

    def __init__(self, config: ModelConfig, kernels: ModelKernels = ModelKernels()) -> None:
        super().__init__()
        self.config = config
        self.linear = kernels.linear
        self.model = Model(config, kernels)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of `hidden`'s rows, in float32 unless `float32=False` (then the
        model's dtype: enough for an argmax, which picks the same token from both)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.linear(hidden, weight)
        return logits.float() if float32 else logits
