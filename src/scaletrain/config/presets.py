"""The built-in models' shapes by preset name: plain data, read by the config (which names
it accepts, which are mixtures of experts) and by models/presets.py (the shapes, checked).
The big presets copy the published Llama, Mixtral and DeepSeekMoE configurations."""

from __future__ import annotations

# vocab_size None: the CPU presets take the vocabulary of the tokenizer trained for the run.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=None,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    "small": dict(
        vocab_size=None,
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=704,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.2-1B: 1.24B parameters.
    "1b": dict(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        tie_embeddings=True,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-2-7B: 6.74B parameters (multi-head attention, no GQA).
    "7b": dict(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-5,
    ),
    # Llama-3-8B: 8.03B parameters.
    "8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3-70B: 70.6B parameters.
    "70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # Llama-3.1-405B: 405.9B parameters.
    "405b": dict(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        tie_embeddings=False,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
    # CPU-sized: the tiny shape with 8 experts of the tiny feed-forward's width, top-2.
    "tiny-moe": dict(
        vocab_size=None,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=384,
        tie_embeddings=True,
        rope_theta=10000.0,
        norm_eps=1e-5,
        experts=8,
        top_k=2,
        expert_ffn_dim=384,
    ),
    # Mixtral-8x7B: 46.7B parameters, 12.9B active per token (8 experts, top-2).
    "mixtral-8x7b": dict(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-5,
        experts=8,
        top_k=2,
        expert_ffn_dim=14336,
    ),
    # DeepSeekMoE-16B (fine-grained experts): 16.4B parameters, 2.8B active; 64 routed
    # experts of width 1408, top-6, 2 shared ones, the first block dense (width 10944),
    # multi-head attention, top-k weights not renormalized.
    "deepseek-moe-16b": dict(
        vocab_size=102400,
        dim=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        ffn_dim=10944,
        tie_embeddings=False,
        rope_theta=10000.0,
        norm_eps=1e-6,
        experts=64,
        top_k=6,
        shared_experts=2,
        expert_ffn_dim=1408,
        dense_layers=1,
        normalize_top_k=False,
    ),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active; 128 experts of width 768, top-8, no
    # shared expert, every block a mixture; heads of 128 channels (32 x 128 = 4096 wide
    # queries on a 2048 residual), 4 kv heads, RMSNorm on each head's queries and keys.
    "qwen3-moe-30b-a3b": dict(
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        tie_embeddings=False,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        attention_head_dim=128,
        qk_norm=True,
        experts=128,
        top_k=8,
        expert_ffn_dim=768,
    ),
}
