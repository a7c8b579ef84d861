"""The model families people fine-tune in 2026 (issue 52), at tiny size: gradient checkpointing
(docs/supported-models.md, "Gradient checkpointing") and PEFT adapters beyond LoRA on Linear. Tagged like issue 49's cases: the slow suite
runs all of their runs (tests/engine/test_hf_zoo.py)."""

from __future__ import annotations

import torch
import transformers as tf
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.engine.zoo import Case, seeded
from tests.engine.zoo.hf import EAGER, P, V, causal_loss, cls_batch, cls_loss, lm_batch
from tests.engine.zoo.outside import D, read_loss, register, seq

_SMALL = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=P)


def checkpointed(make, reentrant: bool = False):
    """A transformers model with activation checkpointing on (non-reentrant: its default), in
    training mode: transformers checkpoints only while training (its dropout is 0 here)."""
    def build():
        model = seeded(make)()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        return model.train()
    return build


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class CheckpointedBlocks(nn.Module):
    """Two blocks under torch.utils.checkpoint, one of them called twice (a tied block)."""

    reentrant = False

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(D, D), nn.ModuleList([Block(), Block()]), nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


class ReentrantBlocks(CheckpointedBlocks):
    reentrant = True


register(Case("checkpointed-blocks", "pattern", "torch.utils.checkpoint (non-reentrant) around blocks, one tied",
              seeded(CheckpointedBlocks), seq, read_loss))
register(Case("checkpoint-reentrant", "pattern", "torch.utils.checkpoint with use_reentrant=True",
              seeded(ReentrantBlocks), seq, read_loss))
register(Case("gpt2-checkpointed", "hf", "GPT-2 with activation_checkpointing_enable()", checkpointed(
    lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER))),
    lm_batch, causal_loss))
register(Case("llama-checkpointed", "hf", "Llama with activation_checkpointing_enable()", checkpointed(
    lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, num_key_value_heads=1, **EAGER))), lm_batch, causal_loss))
register(Case("gpt2-checkpointed-reentrant", "hf", "GPT-2 with reentrant activation checkpointing", checkpointed(
    lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER)), True),
    lm_batch, causal_loss))
# LSH attention draws its rotations in the model's dtype, so the judge's float64 reference would hash
# with other rotations: tests/engine/test_checkpointing.py checks it in float64 on both sides.
register(Case("reformer-reversible", "hf", "Reformer: reversible layers (their backward recomputes them)", lambda: seeded(lambda: tf.ReformerModelWithLMHead(tf.ReformerConfig(
                  vocab_size=V, hidden_size=16, num_attention_heads=2, attention_head_size=8, attn_layers=["local", "local"],
                  feed_forward_size=32, axial_pos_embds=False, max_position_embeddings=P, local_attn_chunk_length=1,
                  lsh_attn_chunk_length=1, num_buckets=2, num_hashes=1, hash_seed=0, is_decoder=True,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
                  local_attention_probs_dropout_prob=0.0, pad_token_id=0, eos_token_id=1)))().train(),
              lm_batch, causal_loss))
register(Case("llama-checkpointed-reentrant", "hf", "Llama with reentrant activation checkpointing", checkpointed(
    lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, num_key_value_heads=1, **EAGER)), True),
    lm_batch, causal_loss))
register(Case("bert-checkpointed", "hf", "BERT classifier with activation_checkpointing_enable()", checkpointed(
    lambda: tf.BertForSequenceClassification(tf.BertConfig(**_SMALL, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0, num_labels=3,
                                                           **EAGER))), cls_batch, cls_loss))


# ------------------------------------------------------------------ PEFT adapters


def _bert():
    return tf.BertForSequenceClassification(tf.BertConfig(**_SMALL, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0, num_labels=3, **EAGER))


def adapted(config, train: bool = False):
    """Tiny BERT with a peft adapter, its adapter weights moved off their identity start."""
    def make():
        import peft
        model = peft.get_peft_model(_bert(), config())
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.1 * torch.randn_like(p))
        return model
    build = seeded(make)
    return (lambda: build().train()) if train else build


def _peft(name: str):
    import peft
    return getattr(peft, name)


def peft_case(name, what, config, train=False):
    register(Case(name, "hf", what, adapted(config, train), cls_batch, cls_loss))


peft_case("peft-ia3", "IA3 on query, value and the MLP (ParameterDict scaling vectors)", lambda: _peft("IA3Config")(
    task_type="SEQ_CLS", target_modules=["query", "value", "intermediate.dense"],
    feedforward_modules=["intermediate.dense"]))
peft_case("peft-adalora", "AdaLoRA on query and value (lora_A, lora_E, lora_B in ParameterDicts)",
          lambda: _peft("AdaLoraConfig")(task_type="SEQ_CLS", target_modules=["query", "value"], init_r=2,
                                         total_step=10))
peft_case("peft-lora-embedding", "LoRA on the word embeddings (lora_embedding_A/B used by F.embedding)",
          lambda: _peft("LoraConfig")(task_type="SEQ_CLS", target_modules=["word_embeddings"], r=2))
peft_case("peft-loha-training", "LoHa on query and value, training mode (torch.rand for module dropout)",
          lambda: _peft("LoHaConfig")(task_type="SEQ_CLS", target_modules=["query", "value"], r=2), train=True)
peft_case("peft-dora", "DoRA on query and value (weight norm through lora_A of an identity)",
          lambda: _peft("LoraConfig")(task_type="SEQ_CLS", target_modules=["query", "value"], r=2, use_dora=True))
peft_case("peft-prompt-tuning", "prompt tuning, 3 virtual tokens (a shared prompt repeated over the batch)",
          lambda: _peft("PromptTuningConfig")(task_type="SEQ_CLS", num_virtual_tokens=3))
_QV = ["query", "value"]
peft_case("peft-lokr", "LoKr on query and value (Kronecker factors)",
          lambda: _peft("LoKrConfig")(task_type="SEQ_CLS", target_modules=_QV, r=2))
peft_case("peft-vera", "VeRA on query and value (frozen random A, B shared by the layers; trained scalings)",
          lambda: _peft("VeraConfig")(task_type="SEQ_CLS", target_modules=_QV, r=2))
peft_case("peft-oft", "OFT on query and value (block-diagonal orthogonal rotations)",
          lambda: _peft("OFTConfig")(task_type="SEQ_CLS", target_modules=_QV, r=0, oft_block_size=4))
peft_case("peft-boft", "BOFT on query and value (butterfly-factored orthogonal rotations)",
          lambda: _peft("BOFTConfig")(task_type="SEQ_CLS", target_modules=_QV, boft_block_size=4))
peft_case("peft-p-tuning", "P-tuning (a prompt encoder MLP over the shared virtual-token table: must be refused)",
          lambda: _peft("PromptEncoderConfig")(task_type="SEQ_CLS", num_virtual_tokens=3, encoder_hidden_size=8))
peft_case("peft-vblora", "VBLoRA (one vector bank read by every adapted layer: must be refused)",
          lambda: _peft("VBLoRAConfig")(task_type="SEQ_CLS", target_modules=_QV, r=2, num_vectors=8, vector_length=4))


def _llama_prefix():
    import peft
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, num_key_value_heads=1, pad_token_id=0, **EAGER))
    model = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return model


register(Case("peft-prefix-tuning", "hf", "prefix tuning on Llama, 3 virtual tokens (shared keys and values as a cache)",
              seeded(_llama_prefix), lm_batch, causal_loss))


# ------------------------------------------------------------------ two views on the batch


class TwoViews(nn.Module):
    """Two views of each sample concatenated on the batch ([2B, T, d]: every sample's first
    view, then every sample's second), one encoder over both, each sample's two embeddings read
    together (SimSiam / BYOL-style: the loss of a sample reads its own views only)."""

    def __init__(self):
        super().__init__()
        self.enc, self.proj = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        views = torch.cat([x, torch.tanh(x.flip(-1))], 0)
        z = self.proj(torch.relu(self.enc(views))).mean(1)          # [2B, d]
        first, second = z.unflatten(0, (2, -1))
        return torch.cat([first, second], -1)                       # [B, 2d]: each sample's two views


register(Case("two-views-on-batch", "pattern", "two views concatenated on the batch ([2B, ...]), one encoder",
              seeded(TwoViews), seq, read_loss))


# ------------------------------------------------------------------ state-space models


def training(make):
    """In training mode and without a generation cache, as `dpclip train` runs it."""
    build = seeded(make)

    def make_training():
        model = build().train()
        model.config.use_cache = False
        return model
    return make_training


def _mamba():
    return tf.MambaForCausalLM(tf.MambaConfig(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2,
                                              expand=2, conv_kernel=3, time_step_rank=4))


def _mamba2():
    return tf.Mamba2ForCausalLM(tf.Mamba2Config(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=2,
                                                expand=2, conv_kernel=3, num_heads=4, head_dim=8, n_groups=1,
                                                chunk_size=4))


register(Case("mamba", "hf", "Mamba (conv1d and dt_proj weights read by the mixer, selective scan)", training(_mamba), lm_batch, causal_loss))
register(Case("mamba2", "hf", "Mamba2 (conv1d weight read by the mixer, chunked SSD scan)", training(_mamba2), lm_batch, causal_loss))


# ------------------------------------------------------------------ mixture-of-experts

_MOE = dict(vocab_size=V, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=P, **EAGER)


def eager_experts(model):
    """The experts' loop over ``index_add_`` (``experts_implementation="eager"``): the zoo's
    reference runs in float64, which ``torch._grouped_mm`` (transformers' default) does not take."""
    model.set_experts_implementation("eager")
    return model


def _mixtral():
    return eager_experts(tf.MixtralForCausalLM(tf.MixtralConfig(**_MOE, num_local_experts=4, num_experts_per_tok=2)))


register(Case("mixtral", "hf", "Mixtral (4 experts, top-2: fused expert weights, tokens dispatched by a router)",
              training(_mixtral), lm_batch, causal_loss))


def _qwen2_moe():
    return eager_experts(tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **_MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=16)))


def _olmoe():
    return eager_experts(tf.OlmoeForCausalLM(tf.OlmoeConfig(**_MOE, num_experts=4, num_experts_per_tok=2)))


def _deepseek_v3():
    return eager_experts(tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **{**_MOE, "num_key_value_heads": 2}, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)))


def _gpt_oss():
    return eager_experts(tf.GptOssForCausalLM(tf.GptOssConfig(
        **{**_MOE, "intermediate_size": 8}, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4)))


def _jamba():
    return eager_experts(tf.JambaForCausalLM(tf.JambaConfig(
        **_MOE, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
        mamba_dt_rank=4, use_mamba_kernels=False)))


def _falcon_mamba():
    return tf.FalconMambaForCausalLM(tf.FalconMambaConfig(vocab_size=V, hidden_size=16, state_size=4,
                                                          num_hidden_layers=2, expand=2, conv_kernel=3,
                                                          time_step_rank=4))


def _bamba():
    return tf.BambaForCausalLM(tf.BambaConfig(
        **_MOE, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=4,
        mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4))


def _lfm2():
    return tf.Lfm2ForCausalLM(tf.Lfm2Config(**_MOE, layer_types=["conv", "full_attention"], conv_L_cache=3))


for _name, _what, _make in (
        ("qwen2-moe", "Qwen2-MoE (4 experts, top-2, with a gated shared expert)", _qwen2_moe),
        ("olmoe", "OLMoE (4 experts, top-2, QK norms)", _olmoe),
        ("deepseek-v3", "DeepSeek-V3 (multi-head latent attention, 4 routed experts and a shared one)",
         _deepseek_v3),
        ("gpt-oss", "gpt-oss (experts with biases, attention sinks, sliding and full attention)", _gpt_oss),
        ("jamba", "Jamba (Mamba and attention layers, experts on every other layer)", _jamba),
        ("falcon-mamba", "FalconMamba (Mamba with RMS-normalised B, C and Δ)", _falcon_mamba),
        ("bamba", "Bamba (Mamba2 and attention layers)", _bamba),
        ("lfm2", "LFM2 (short convolutions reading conv.weight, attention layers)", _lfm2)):
    register(Case(_name, "hf", _what, training(_make), lm_batch, causal_loss))


# ------------------------------------------------------------------ torch.compile


def compiled(make):
    """``torch.compile(model, backend="aot_eager")``: dynamo traces what it can and runs the
    engine's book-kept calls eagerly between its graphs (the compiled private step is issue 54)."""
    build = seeded(make)
    return lambda: torch.compile(build(), backend="aot_eager")


register(Case("compiled-blocks", "pattern", "torch.compile(backend=\"aot_eager\") of blocks under torch.utils.checkpoint",
              compiled(lambda: CheckpointedBlocks()), seq, read_loss))
register(Case("compiled-gpt2", "hf", "torch.compile(backend=\"aot_eager\") of GPT-2", compiled(
    lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **EAGER))),
    lm_batch, causal_loss))


# ------------------------------------------------------------------ learned tables shared by all samples

from tests.engine.zoo.outside import audio_batch, audio_loss, image_batch, image_loss  # noqa: E402


def _beit(shared: bool):
    return lambda: tf.BeitForImageClassification(tf.BeitConfig(
        image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        num_labels=3, use_relative_position_bias=not shared, use_shared_relative_position_bias=shared,
        use_absolute_position_embeddings=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, **EAGER))


register(Case("beit-relative", "hf", "BEiT with a relative position bias table per layer", seeded(_beit(False)),
              image_batch, image_loss))
register(Case("beit-shared-relative", "hf", "BEiT with one relative position bias table shared by the layers",
              seeded(_beit(True)), image_batch, image_loss))
register(Case("wavlm", "hf", "WavLM classifier (gated relative position bias)", seeded(
    lambda: tf.WavLMForSequenceClassification(tf.WavLMConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=3, classifier_proj_size=8, mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        feat_proj_dropout=0.0, num_buckets=8, max_bucket_distance=16, **EAGER))), audio_batch, audio_loss))
