"""The kept model configs' published parameter counts, and the count computed from config.json alone: what the
recipe tests and the memory plan's tests check the meta-device build and the plan's dimensions against."""

from __future__ import annotations

# Published parameter counts: the model cards' "Number of Parameters" where they state one (Qwen2.5-7B 7.61B,
# Qwen2.5-32B 32.5B, Llama-3.2-3B 3.21B, Qwen3-32B 32.8B, Qwen3-30B-A3B 30.5B in total and 3.3B activated);
# otherwise the Hugging Face hub's safetensors total (7.62B).
KNOWN_SIZES = {
    "Qwen2.5-Math-7B": 7.62e9,
    "Qwen2.5-7B": 7.61e9,
    "Qwen2.5-32B": 32.5e9,
    "Llama-3.2-3B-Instruct": 3.21e9,
    "DeepSeek-R1-Distill-Qwen-7B": 7.62e9,
    "Qwen3-32B": 32.8e9,
    "Qwen3-30B-A3B": 30.5e9,
}
ACTIVE_SIZES = {"Qwen3-30B-A3B": 3.3e9}  # parameters one token passes through (top-8 of 128 experts)


def analytic_parameter_count(hf: dict) -> int:
    """Embedding (+ untied output layer) + per layer (attention with Qwen2's q/k/v biases or Qwen3's q/k norms,
    SwiGLU MLP or a Qwen3-MoE layer's router and experts, 2 norms) + final norm: the cross-check of the meta-device
    build, computed from config.json alone."""
    h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or h // heads
    q, kv_width = heads * head_dim, kv * head_dim
    attention = h * q + 2 * h * kv_width + q * h
    if hf["architectures"] == ["Qwen2ForCausalLM"]:
        attention += q + 2 * kv_width  # Qwen2 has biases on q, k, v
    if hf["architectures"][0].startswith("Qwen3"):
        attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * h * hf["intermediate_size"]
    if hf["architectures"] == ["Qwen3MoeForCausalLM"]:
        assert hf["decoder_sparse_step"] == 1 and not hf["mlp_only_layers"], "every layer MoE in the kept configs"
        mlp = hf["num_experts"] * (h + 3 * h * hf["moe_intermediate_size"])  # router row + SwiGLU per expert
    embeddings = vocab * h * (1 if hf["tie_word_embeddings"] else 2)
    return embeddings + layers * (attention + mlp + 2 * h) + h
