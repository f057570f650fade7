"""Tiny configs of each causal-LM architecture the run spec names, and the spec section of one."""

from __future__ import annotations

from protocol.spec import CausalLMSection

CONFIGS = {
    "llama": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1},
    "qwen2": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gpt2": {"vocab_size": 300, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
}  # fmt: skip


def section(architecture: str) -> CausalLMSection:
    return CausalLMSection(architecture=architecture, config=CONFIGS[architecture], seq_len=16)  # type: ignore[arg-type]
