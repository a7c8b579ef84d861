"""Architectures released through 2025-2026 that transformers 5 ships (issue 52's "models of 2026",
widened): Gemma 3, 3n and 4, Qwen3-MoE, Qwen3-Next and Qwen3.5, GLM-4 (and its MoE), GLM-4.7-Flash and
GLM-5, ERNIE 4.5 (and its MoE), EXAONE 4 and K-EXAONE, Apertus, SmolLM3, HunYuan, dots.llm1, DeepSeek-V2,
V3.2 and V4, Mistral 4, OLMo 3 and OLMo Hybrid, FlexOlmo, Seed-OSS, MiniMax and MiniMax-M2, LFM2-MoE and
LFM3, Falcon-H1, Cohere2, BitNet, Arcee, VaultGemma, NanoChat, Inkling, AFMoE, Ling hybrid, Kimi Linear,
LongCat-Flash, Granite 4, Zamba2, the ModernBERT decoder and Llama 4; a third wave of the causal LMs
(and masked LMs) of transformers 5.24 the first two left out, built from their model type. Random configs at tiny size, in
training mode without a generation cache (as `dpclip train` runs them); mixture-of-experts layers run
their eager loop (the zoo's float64 reference cannot run ``torch._grouped_mm``). Tagged like issue 49's
cases: the slow suite runs all of their runs (tests/engine/test_hf_zoo.py)."""

from __future__ import annotations

import torch
import transformers as tf
from transformers.models.afmoe.modeling_afmoe import AfmoeTokenChoiceRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

from tests.engine.zoo import Case, seeded
from tests.engine.zoo.families import eager_experts, training
from tests.engine.zoo.hf import DROP, EAGER, P, V, causal_loss, lm_batch, mlm_batch, mlm_loss
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

# the second wave: the causal LMs transformers 5.24 added through 2026
_LIN_FULL = ["linear_attention", "full_attention"]
_SLIDE_FULL = ["sliding_attention", "full_attention"]


def _without(key, **config):
    """A config without ``key`` (where the config class maps it onto another field, e.g. DeepSeek-V4's
    intermediate_size -> moe_intermediate_size, and _small's value would win)."""
    config.pop(key)
    return config


causal("gemma4", "Gemma 4 (per-layer embeddings, a router's experts beside the MLP, keys as values on global layers)",
       lambda: tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**_small(
           head_dim=8, global_head_dim=8, sliding_window=3, layer_types=_SLIDE_FULL, hidden_size_per_layer_input=4,
           vocab_size_per_layer_input=V, attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
           top_k_experts=2, moe_intermediate_size=8))))
causal("gemma4-unified", "Gemma 4 unified text (sliding and global layers of different head sizes, q/k/v norms)",
       lambda: tf.Gemma4UnifiedForCausalLM(tf.Gemma4UnifiedTextConfig(**_small(
           head_dim=8, global_head_dim=4, sliding_window=3, layer_types=_SLIDE_FULL))))
causal("deepseek-v3.2", "DeepSeek-V3.2 (latent attention with a top-k indexer, shared experts)",
       lambda: tf.DeepseekV32ForCausalLM(tf.DeepseekV32Config(**_small(
           num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, index_topk=2, index_head_dim=8,
           index_n_heads=2, **_MLA))))


def _deepseek_v4():
    """Hash-routed layers pick experts from a frozen token -> experts table (all zeros in a fresh model, which
    would send every token twice to expert 0): a random table, distinct experts per token."""
    model = tf.DeepseekV4ForCausalLM(tf.DeepseekV4Config(**_without("intermediate_size", **_small(
        head_dim=8, q_lora_rank=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=1, sliding_window=3, o_groups=2, o_lora_rank=4, index_n_heads=2, index_head_dim=8,
        index_topk=1, hc_mult=2, hc_sinkhorn_iters=3,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"]))))
    for module in model.modules():
        if isinstance(module, DeepseekV4HashRouter):
            module.tid2eid.copy_(torch.rand(module.tid2eid.shape[0], module.num_experts).argsort(-1)[:, :module.top_k])
    return model


causal("deepseek-v4", "DeepSeek-V4 (compressed sparse attention, hyper-connections, hash-routed experts)", _deepseek_v4)
causal("mistral4", "Mistral 4 (latent attention, shared experts)", lambda: tf.Mistral4ForCausalLM(tf.Mistral4Config(
    **_small(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
             n_shared_experts=1, **_MLA))))
causal("lfm3", "LFM3 (short convolutions, gated attention, sandwich norms)", lambda: tf.Lfm3ForCausalLM(tf.Lfm3Config(
    **_small(head_dim=8, sliding_window=3, conv_L_cache=3, layer_types=["conv", "sliding_attention"]))))
causal("olmo-hybrid", "OLMo Hybrid (gated DeltaNet and attention layers)", lambda: tf.OlmoHybridForCausalLM(
    tf.OlmoHybridConfig(**_small(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
                                 linear_value_head_dim=8, layer_types=_LIN_FULL))))
causal("inkling", "Inkling (hybrid sliding attention with relative bias, convolutions, shared-expert sink)",
       lambda: tf.InklingForCausalLM(tf.InklingTextConfig(**_small(
           head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=3,
           d_rel=4, rel_extent=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           n_shared_experts=1, layer_types=["hybrid_sliding", "hybrid"]))))


causal("minimax-m2", "MiniMax-M2 (q/k norms over all heads, sigmoid router with bias)", lambda: tf.MiniMaxM2ForCausalLM(
    tf.MiniMaxM2Config(**_small(head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8))))
causal("qwen3.5", "Qwen3.5 (gated DeltaNet and gated attention layers)", lambda: tf.Qwen3_5ForCausalLM(
    tf.Qwen3_5TextConfig(**_small(head_dim=8, linear_num_value_heads=2, linear_num_key_heads=1,
                                  linear_key_head_dim=4, linear_value_head_dim=4, layer_types=_LIN_FULL))))
causal("qwen3.5-moe", "Qwen3.5-MoE (gated DeltaNet, gated attention, shared expert)", lambda: tf.Qwen3_5MoeForCausalLM(
    tf.Qwen3_5MoeTextConfig(**_small(head_dim=8, **_MOE, shared_expert_intermediate_size=8, linear_num_value_heads=2,
                                     linear_num_key_heads=1, linear_key_head_dim=4, linear_value_head_dim=4,
                                     layer_types=_LIN_FULL))))
causal("glm-moe-dsa", "GLM-5 (latent attention with a sparse indexer, shared experts)",
       lambda: tf.GlmMoeDsaForCausalLM(tf.GlmMoeDsaConfig(**_small(
           num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           first_k_dense_replace=1, n_shared_experts=1, index_topk=2, index_head_dim=8, index_n_heads=2, **_MLA))))
causal("glm4-moe-lite", "GLM-4.7-Flash (latent attention, shared experts)", lambda: tf.Glm4MoeLiteForCausalLM(
    tf.Glm4MoeLiteConfig(**_small(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=8, n_shared_experts=1, **_MLA))))


def _afmoe():
    """AFMoE initialises its router to zeros: every token then goes to the same two experts with weights 1/2, the
    experts' inputs have equal rows, and the engine's probe refuses at every shape (B == 1 included). A random
    router (std 0.2, as flex-olmo's initializer_range) routes tokens apart, as a trained one does."""
    model = tf.AfmoeForCausalLM(tf.AfmoeConfig(**_small(head_dim=8, **_MOE, num_shared_experts=1, sliding_window=3,
                                                        layer_types=_SLIDE_FULL)))
    for module in model.modules():
        if isinstance(module, AfmoeTokenChoiceRouter):
            torch.nn.init.normal_(module.gate.weight, std=0.2)
    return model


causal("afmoe", "AFMoE (gated attention, sliding layers, sigmoid router, shared experts)", _afmoe)
causal("bailing-hybrid", "Ling hybrid (KDA linear attention and latent attention, shared experts)",
       lambda: tf.BailingHybridForCausalLM(tf.BailingHybridConfig(**_small(
           num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, num_mtp_layers=0,
           layer_types=_LIN_FULL, **_MLA))))
causal("exaone-moe", "K-EXAONE (sliding layers, shared experts)", lambda: tf.ExaoneMoeForCausalLM(tf.ExaoneMoeConfig(
    **_small(head_dim=8, **_MOE, sliding_window=3, layer_types=_SLIDE_FULL))))
causal("kimi-linear", "Kimi Linear (KDA linear attention and latent attention, shared experts)",
       lambda: tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**_small(
           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
           n_shared_experts=1, linear_head_dim=8, linear_num_heads=2, layer_types=_LIN_FULL, **_MLA))))
causal("longcat-flash", "LongCat-Flash (two attentions per layer, zero-computation experts)",
       lambda: tf.LongcatFlashForCausalLM(tf.LongcatFlashConfig(**_small(
           num_layers=1, n_routed_experts=4, moe_topk=2, zero_expert_num=2,
           expert_ffn_hidden_size=8, num_key_value_heads=2, head_dim=4, **_MLA))))
causal("granitemoe-hybrid", "Granite 4 hybrid (Mamba-2 and attention layers, shared MLP)",
       lambda: tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**_small(
           num_local_experts=4, num_experts_per_tok=2, intermediate_size=8, shared_intermediate_size=16,
           mamba_n_heads=2, mamba_d_state=4, mamba_d_head=16, mamba_chunk_size=4, layer_types=["mamba", "attention"]))))
causal("zamba2", "Zamba2 (Mamba-2 layers calling one shared attention block, per-layer LoRA adapters)",
       lambda: tf.Zamba2ForCausalLM(tf.Zamba2Config(**_small(
           mamba_d_state=4, n_mamba_heads=2, chunk_size=4, adapter_rank=4,
           layers_block_type=["hybrid", "hybrid"]))))
causal("granitemoe-swa", "Granite MoE SWA (sliding layers, attention sinks, 4 experts)",
       lambda: tf.GraniteMoeSWAForCausalLM(tf.GraniteMoeSWAConfig(**_small(
           num_local_experts=4, num_experts_per_tok=2, intermediate_size=8, sliding_window=3,
           layer_types=["full_attention", "sliding_attention"]))))

# the third wave (rev40): the causal LMs of transformers 5.24 that the two waves above left out, built from
# their model type (AutoConfig.for_model) at the same tiny size, experts and linear-attention heads shrunk
_E = dict(num_experts=4, n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          shared_expert_intermediate_size=8)
_LIN = dict(linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=4, linear_value_head_dim=4)


def _auto(model_type, **extra):
    """The causal LM that transformers' auto mapping names for ``model_type``, from a tiny config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return lambda: cls(tf.AutoConfig.for_model(model_type, **_small(**extra)))


for _name, _what, _type, _extra in [
    ("apertus-1.5", "Apertus 1.5 text", "apertus1p5_text", dict(head_dim=8)),
    ("beam", "Beam", "beam", dict(head_dim=8)),
    ("cohere2-moe", "Cohere2-MoE (sliding and global layers, 4 experts)", "cohere2_moe", dict(head_dim=8, sliding_window=3, **_E)),
    ("cwm", "CWM (Code World Model)", "cwm", dict(head_dim=8)),
    ("dory", "Dory", "dory", dict(head_dim=8)),
    ("flint", "Flint", "flint", dict(head_dim=8)),
    ("granite-swa", "Granite SWA (sliding layers)", "granite_swa", dict(head_dim=8)),
    ("hrm-text", "HRM text", "hrm_text", dict(head_dim=8)),
    ("hyperclovax", "HyperCLOVA X", "hyperclovax", dict(head_dim=8)),
    ("jais2", "Jais 2", "jais2", dict(head_dim=8)),
    ("ministral3", "Ministral 3", "ministral3", dict(head_dim=8)),
    ("zaya", "ZAYA (top-1 experts)", "zaya", dict(head_dim=8)),
    ("hy-v3", "Hunyuan V3 (a dense layer, then shared and routed experts)", "hy_v3", dict(head_dim=8, **_E)),
    ("hy-v4", "Hunyuan V4 (indexed latent attention, shared and routed experts)", "hy_v4", dict(
        num_key_value_heads=2, index_n_heads=2, index_head_dim=8, index_topk=2, **_E, **_MLA)),
    ("kolibri1", "Kolibri 1 (sliding layers, shared and routed experts)", "kolibri1", dict(head_dim=8, sliding_window=3, **_E)),
    ("laguna", "Laguna (a dense layer, then shared and routed experts)", "laguna", dict(head_dim=8, sliding_window=3, **_E)),
    ("lara-mini", "Lara mini (linear attention and sliding layers, experts)", "lara_mini", dict(
        head_dim=8, sliding_window=3, **_E, **_LIN)),
    ("mellum", "Mellum (experts on every layer)", "mellum", dict(head_dim=8, sliding_window=3, **_E)),
    ("mimo-v2-flash", "MiMo-V2-Flash (sliding and full layers, routed experts)", "mimo_v2_flash", dict(
        head_dim=8, v_head_dim=8, sliding_window=3, **_E)),
    ("qwen4-exp", "Qwen4-Exp text (linear attention layers, experts)", "qwen4_exp_text", dict(head_dim=8, **_E, **_LIN)),
    ("minimax-m3", "MiniMax-M3 text (an indexer, experts on every layer)", "minimax_m3_vl_text", dict(
        head_dim=8, index_n_heads=2, index_head_dim=8, **_E)),
    ("sarvam-moe", "Sarvam MoE", "sarvam_moe", dict(head_dim=8, **_E, n_group=1, topk_group=1)),
    ("sarvam-mla", "Sarvam MLA (latent attention, experts)", "sarvam_mla", dict(
        num_key_value_heads=2, **_E, n_group=1, topk_group=1, **_MLA)),
    ("solar-open", "Solar Open (experts)", "solar_open", dict(head_dim=8, **_E)),
    ("axk2", "A.X K2 (latent attention, experts)", "axk2", dict(num_key_value_heads=2, **_E, **_MLA)),
    ("youtu", "Youtu (latent attention)", "youtu", dict(num_key_value_heads=2, **_E, **_MLA)),
]:
    causal(_name, _what, _auto(_type, **_extra))

# and the masked LMs of 2025-2026 (rev40), the same way
_ENCODER = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=P + 2, num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, **EAGER)


def _masked(model_type):
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
    cls = getattr(tf, MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type])
    return lambda: cls(tf.AutoConfig.for_model(model_type, **_ENCODER))


for _name, _what, _type in [("eurobert-mlm", "EuroBERT masked LM", "eurobert"),
                            ("ultrabert-mlm", "UltraBERT masked LM", "ultrabert"),
                            ("gte-mlm", "GTE masked LM", "gte"),
                            ("nomic-bert-mlm", "Nomic BERT masked LM", "nomic_bert"),
                            ("jina-v3-mlm", "Jina embeddings v3 masked LM", "jina_embeddings_v3"),
                            ("esmc-mlm", "ESM C protein masked LM (q/k layer norms)", "esmc")]:
    register(Case(_name, "hf", _what, seeded(_masked(_type)), mlm_batch, mlm_loss))
