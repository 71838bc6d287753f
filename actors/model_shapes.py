"""The built-in models' shapes: each preset's sizes and each architecture's flags,
the catalogue `tandem make-model` offers. Data only, no torch: the command line
reads it to list its choices, and `actors.model_builder` builds from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.tokenizer_builder import ENDOFTEXT

MOE_DENSE_LAYERS = (0,)  # qwen3_moe: the layers that keep one MLP (config.json's mlp_only_layers)
BUILD_STAMP = "tandem_build.json"  # in a folder the builder wrote; names the preset, arch and builder once complete


@dataclass(frozen=True)
class Preset:
    """Shape of one built-in model; the same for every arch except `rope_theta`
    (qwen3 takes qwen2's)."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta_qwen2: float
    rope_theta_llama: float
    # The tokenizer's own size where it is smaller than the model's vocab (as in
    # Qwen2.5, whose embedding has 151936 rows for 151665 tokens): a BPE trained on
    # the shipped text cannot reach 150k entries; ids past it decode to nothing.
    tokenizer_vocab_size: int | None = None
    # qwen3_moe: experts of intermediate_size / 4, two of them a token (Qwen3-30B-A3B:
    # 128 of 768 with hidden 2048, eight a token); every layer sparse but
    # MOE_DENSE_LAYERS, so that both kinds of MLP are built.
    num_experts: int = 8
    num_experts_per_tok: int = 2

    @property
    def moe_intermediate_size(self) -> int:
        return self.intermediate_size // 4

    def rope_theta(self, arch: str) -> float:
        return self.rope_theta_llama if arch in ("llama", "mistral") else self.rope_theta_qwen2


PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", vocab_size=2048, hidden_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   intermediate_size=352, max_position_embeddings=2048,
                   rope_theta_qwen2=10_000.0, rope_theta_llama=10_000.0),
    "bench": Preset("bench", vocab_size=8192, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                    intermediate_size=2304, max_position_embeddings=8192,
                    rope_theta_qwen2=1_000_000.0, rope_theta_llama=500_000.0),
    # Qwen2.5-0.5B's shape (about 494M parameters with qwen2's tied embeddings), for
    # GPU benchmarks; random weights like the others, an 8192-token tokenizer.
    "qwen2.5-0.5b": Preset("qwen2.5-0.5b", vocab_size=151_936, hidden_size=896, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                           intermediate_size=4864, max_position_embeddings=32_768,
                           rope_theta_qwen2=1_000_000.0, rope_theta_llama=1_000_000.0,
                           tokenizer_vocab_size=8192),
}


@dataclass(frozen=True)
class ArchSpec:
    """What separates the families in the checkpoint: explicit flags, no copies."""

    architecture: str
    tie_word_embeddings: bool
    qkv_bias: bool
    rms_norm_eps: float
    bos_token: str | None
    nfc: bool  # transformers v5 forces Qwen2Tokenizer's NFC normalizer on model_type qwen2 (and qwen3)
    qk_norm: bool = False  # an RMSNorm of each query and key head (Qwen3)
    moe: bool = False  # experts in place of the MLP of every layer but MOE_DENSE_LAYERS (Qwen3-MoE)


ARCH_SPECS: dict[str, ArchSpec] = {
    "qwen2": ArchSpec("Qwen2ForCausalLM", tie_word_embeddings=True, qkv_bias=True,
                      rms_norm_eps=1e-6, bos_token=None, nfc=True),
    # Qwen3's dense models: no q/k/v biases, q_norm and k_norm; tied embeddings as in
    # Qwen3-0.6B to 4B (8B and up untie them).
    "qwen3": ArchSpec("Qwen3ForCausalLM", tie_word_embeddings=True, qkv_bias=False,
                      rms_norm_eps=1e-6, bos_token=None, nfc=True, qk_norm=True),
    # Qwen3-MoE (Qwen3-30B-A3B's family): Qwen3's attention, untied embeddings.
    "qwen3_moe": ArchSpec("Qwen3MoeForCausalLM", tie_word_embeddings=False, qkv_bias=False,
                          rms_norm_eps=1e-6, bos_token=None, nfc=True, qk_norm=True, moe=True),
    "llama": ArchSpec("LlamaForCausalLM", tie_word_embeddings=False, qkv_bias=False,
                      rms_norm_eps=1e-5, bos_token=ENDOFTEXT, nfc=False),
    # Mistral (7B v0.2 and v0.3, Nemo, Small): Llama's layers under another name, and
    # a sliding window that these checkpoints leave null, as the built one does.
    "mistral": ArchSpec("MistralForCausalLM", tie_word_embeddings=False, qkv_bias=False,
                        rms_norm_eps=1e-5, bos_token=ENDOFTEXT, nfc=False),
}


class UnknownModel(ValueError):
    """A preset, arch or dtype the builder does not have: a user's mistake (the CLI
    prints it as one line)."""
