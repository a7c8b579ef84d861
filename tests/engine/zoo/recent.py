"""Architectures released through 2025-2026 that transformers 5 ships (issue 52's "models of 2026",
widened): Gemma 3 and 3n, Qwen3-MoE and Qwen3-Next, GLM-4 (and its MoE), ERNIE 4.5 (and its MoE),
EXAONE 4, Apertus, SmolLM3, HunYuan, dots.llm1, DeepSeek-V2 (latent attention), OLMo 3, FlexOlmo,
Seed-OSS, MiniMax, LFM2-MoE, Falcon-H1, Cohere2, BitNet, Arcee, VaultGemma, NanoChat, the
ModernBERT decoder and Llama 4. Random configs at tiny size, in training mode without a
generation cache (as `dpclip train` runs them); mixture-of-experts layers run their eager loop
(the zoo's float64 reference cannot run ``torch._grouped_mm``). Tagged like issue 49's cases: the
slow suite runs all of their runs (tests/engine/test_hf_zoo.py)."""

from __future__ import annotations

import transformers as tf

from tests.engine.zoo import Case
from tests.engine.zoo.families import eager_experts, training
from tests.engine.zoo.hf import DROP, EAGER, P, V, causal_loss, lm_batch
from tests.engine.zoo.outside import register


def _small(**extra):
    """Two layers of width 16, two query heads and one key/value head, vocabulary V; special
    token ids inside the vocabulary (several configs default to ids above 100,000)."""
    config = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=P, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  **EAGER)
    config.update(extra)
    return config


def _training(make):
    """:func:`~tests.engine.zoo.families.training` (seeded, training mode, no generation cache), experts
    run by their eager loop where the model has experts."""
    def build():
        model = make()
        return eager_experts(model) if hasattr(model, "set_experts_implementation") else model
    return training(build)


def causal(name, what, make):
    register(Case(name, "hf", what, _training(make), lm_batch, causal_loss))


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
_MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)

causal("gemma3", "Gemma 3 (q/k norms, sliding and global layers)", lambda: tf.Gemma3ForCausalLM(
    tf.Gemma3TextConfig(**_small(head_dim=8, sliding_window=3))))
causal("gemma3n", "Gemma 3n (AltUp, LAuReL, per-layer embeddings)", lambda: tf.Gemma3nForCausalLM(tf.Gemma3nTextConfig(
    **_small(head_dim=8, sliding_window=3, laurel_rank=4, hidden_size_per_layer_input=4, vocab_size_per_layer_input=V,
             num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
             activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2))))
causal("qwen3-moe", "Qwen3-MoE (4 experts, top-2)", lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
    **_small(head_dim=8, **_MOE))))
causal("qwen3-next", "Qwen3-Next (gated DeltaNet and gated attention layers, shared expert)",
       lambda: tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**_small(
           head_dim=8, **_MOE, shared_expert_intermediate_size=8, linear_num_value_heads=2, linear_num_key_heads=1,
           linear_key_head_dim=4, linear_value_head_dim=4, layer_types=["linear_attention", "full_attention"]))))
causal("smollm3", "SmolLM3 (layers without rotary positions)", lambda: tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**_small())))
causal("glm4", "GLM-4 (post-attention and post-MLP norms)", lambda: tf.Glm4ForCausalLM(tf.Glm4Config(**_small(head_dim=8))))
causal("glm4-moe", "GLM-4-MoE (a dense first layer, grouped top-k router with bias)", lambda: tf.Glm4MoeForCausalLM(
    tf.Glm4MoeConfig(**_small(head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                              first_k_dense_replace=1, n_group=1, topk_group=1))))
causal("ernie4.5", "ERNIE 4.5", lambda: tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(**_small(head_dim=8))))
causal("ernie4.5-moe", "ERNIE 4.5 MoE", lambda: tf.Ernie4_5_MoeForCausalLM(tf.Ernie4_5_MoeConfig(
    **_small(head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_layer_start_index=0))))
causal("exaone4", "EXAONE 4 (hybrid sliding attention, q/k norms)", lambda: tf.Exaone4ForCausalLM(tf.Exaone4Config(
    **_small(head_dim=8, sliding_window=3))))
causal("apertus", "Apertus (xIELU activation with learned parameters)", lambda: tf.ApertusForCausalLM(
    tf.ApertusConfig(**_small(head_dim=8))))
causal("hunyuan", "HunYuan dense (q/k norms)", lambda: tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(
    **_small(head_dim=8))))
causal("dots1", "dots.llm1 (shared and routed experts)", lambda: tf.Dots1ForCausalLM(tf.Dots1Config(
    **_small(head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1,
             n_shared_experts=1, n_group=1, topk_group=1))))
causal("deepseek-v2", "DeepSeek-V2 (multi-head latent attention, shared experts)", lambda: tf.DeepseekV2ForCausalLM(
    tf.DeepseekV2Config(**_small(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=8, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                                 topk_group=1, **_MLA))))
causal("olmo3", "OLMo 3 (sliding-window layers, q/k norms)", lambda: tf.Olmo3ForCausalLM(tf.Olmo3Config(
    **_small(num_key_value_heads=2, sliding_window=3))))
# initializer_range 0.2: at FlexOlmo's 0.02 a width-16 model routes every token alike, and at B == 1 (one
# sample probed twice) the experts' rows cannot be told apart: refused, where trained routers differ by token
causal("flex-olmo", "FlexOlmo (4 experts, top-2)", lambda: tf.FlexOlmoForCausalLM(tf.FlexOlmoConfig(
    **_small(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2))))
causal("seed-oss", "Seed-OSS (biased q/k/v)", lambda: tf.SeedOssForCausalLM(tf.SeedOssConfig(
    **_small(head_dim=8, attention_dropout=DROP, residual_dropout=DROP))))
causal("minimax", "MiniMax (lightning linear attention and softmax layers, 4 experts)", lambda: tf.MiniMaxForCausalLM(
    tf.MiniMaxConfig(**_small(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["linear_attention", "full_attention"], block_size=4))))
causal("lfm2-moe", "LFM2-MoE (short convolutions, a dense first layer)", lambda: tf.Lfm2MoeForCausalLM(tf.Lfm2MoeConfig(
    **_small(**_MOE, num_dense_layers=1, layer_types=["conv", "full_attention"]))))
causal("falcon-h1", "Falcon-H1 (attention and Mamba-2 heads side by side)", lambda: tf.FalconH1ForCausalLM(
    tf.FalconH1Config(**_small(head_dim=8, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_d_state=4,
                               mamba_n_groups=1, mamba_chunk_size=4))))
causal("cohere2", "Cohere2 (sliding and global layers, parallel block)", lambda: tf.Cohere2ForCausalLM(
    tf.Cohere2Config(**_small(head_dim=8, sliding_window=3))))
causal("bitnet", "BitNet (sub-layer norms, ReLU²)", lambda: tf.BitNetForCausalLM(tf.BitNetConfig(**_small(head_dim=8))))
causal("arcee", "Arcee (ReLU² MLP without gate)", lambda: tf.ArceeForCausalLM(tf.ArceeConfig(**_small(head_dim=8))))
causal("vaultgemma", "VaultGemma (Gemma trained with DP)", lambda: tf.VaultGemmaForCausalLM(tf.VaultGemmaConfig(
    **_small(head_dim=8, sliding_window=3))))
causal("nanochat", "nanochat (q/k norms, ReLU² MLP)", lambda: tf.NanoChatForCausalLM(tf.NanoChatConfig(
    **_small(head_dim=8))))
causal("modernbert-decoder", "ModernBERT decoder", lambda: tf.ModernBertDecoderForCausalLM(tf.ModernBertDecoderConfig(
    **{k: v for k, v in _small().items() if k != "num_key_value_heads"})))
causal("llama4", "Llama 4 text (every token to every expert, masked by a sigmoid top-1 router)",
       lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(**_small(
           head_dim=8, intermediate_size_mlp=32, num_local_experts=2, num_experts_per_tok=1,
           interleave_moe_layer_step=1))))
