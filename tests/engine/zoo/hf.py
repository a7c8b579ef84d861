"""Tiny transformers architectures from random configs (hidden 16-32, 2 layers, 2 heads,
vocab 64, dropout 0, eager attention), and variants: LoRA, frozen parts, padding, a long
sequence. Models are never downloaded."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf

from tests.engine.zoo import Case, floats, ids, register, seeded, token_mean, upcast

V = 64          # vocabulary
P = 16          # max positions (T ≤ 5 in every shape family)
DROP = 0.0
EAGER = {"attn_implementation": "eager"}


# ------------------------------------------------------------------ losses and batches


def lm_batch(B, T, g):
    return {"input_ids": ids(B, T, g, V)}


def padded_lm_batch(side: str):
    """Samples of different lengths: sample i keeps T - (i mod 3) tokens (at least 2),
    padding on the right or the left; the attention mask marks the real tokens."""

    def make(B, T, g):
        x = ids(B, T, g, V)
        mask = torch.ones(B, T, dtype=torch.long)
        for i in range(B):
            pad = min(i % 3, T - 2)
            if pad:
                if side == "right":
                    mask[i, T - pad:] = 0
                else:
                    mask[i, :pad] = 0
        return {"input_ids": x * mask, "attention_mask": mask}

    return make


def causal_loss(model, batch):
    """Next-token cross-entropy, averaged over each sample's real target tokens."""
    x, mask = batch["input_ids"], batch.get("attention_mask")
    logits = model(**batch).logits[:, :-1]
    tok = F.cross_entropy(upcast(logits.transpose(1, 2)), x[:, 1:], reduction="none")
    return token_mean(tok, None if mask is None else mask[:, 1:])


def mlm_batch(B, T, g):
    """Token ids with about a third of the positions to predict (at least one per sample);
    labels are -100 elsewhere, and the last two tokens of odd samples are padding."""
    x = ids(B, T, g, V, low=2)
    labels = torch.full_like(x, -100)
    pick = torch.rand(B, T, generator=g) < 0.35
    pick[:, 0] = True
    labels[pick] = x[pick]
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1::2, T - 2:] = 0
    labels[mask == 0] = -100
    x = torch.where(pick, torch.ones_like(x), x) * mask       # 1 is [MASK], 0 is padding
    return {"input_ids": x, "attention_mask": mask, "labels": labels}


def mlm_loss(model, batch):
    labels = batch["labels"]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    tok = F.cross_entropy(upcast(logits.transpose(1, 2)), labels.clamp_min(0), reduction="none")
    return token_mean(tok, labels >= 0)


def cls_batch(B, T, g):
    """Right-padded sequences (sample i has i mod 3 padding tokens) and a label of 3 classes."""
    b = padded_lm_batch("right")(B, T, g)
    b["labels"] = torch.randint(0, 3, (B,), generator=g)
    return b


def cls_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(upcast(logits), batch["labels"], reduction="none")


def seq2seq_batch(B, T, g):
    return {"input_ids": ids(B, T, g, V, low=2), "labels": ids(B, T, g, V, low=2)}


def seq2seq_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], labels=batch["labels"]).logits
    tok = F.cross_entropy(upcast(logits.transpose(1, 2)), batch["labels"], reduction="none")
    return token_mean(tok)


# ------------------------------------------------------------------ architectures


def causal(name, what, make, batch=lm_batch, tags=()):
    register(Case(name, "hf", what, seeded(make), batch, causal_loss, tags))


def _llama(tie):
    return lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=P, tie_word_embeddings=tie, **EAGER))


def _gpt2(positions=P):
    return tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=V, n_positions=positions, n_embd=16, n_layer=2, n_head=2, resid_pdrop=DROP,
        embd_pdrop=DROP, attn_pdrop=DROP, bos_token_id=0, eos_token_id=0, **EAGER))


causal("gpt2", "GPT-2 (Conv1D, tied wte/lm_head, learned positions)", _gpt2)
causal("gpt-neox", "GPT-NeoX (rotary, parallel residual)", lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=P, hidden_dropout=DROP, attention_dropout=DROP, **EAGER)))
causal("llama-untied", "Llama (RMSNorm, rotary, GQA, untied head)", _llama(False))
causal("llama-tied", "Llama with tied embedding/head", _llama(True))
causal("mistral", "Mistral (sliding-window attention config)", lambda: tf.MistralForCausalLM(tf.MistralConfig(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=P, sliding_window=P, **EAGER)))
causal("qwen2", "Qwen2 (q/k/v biases)", lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=P, **EAGER)))
causal("phi", "Phi (partial rotary, parallel attention/MLP)", lambda: tf.PhiForCausalLM(tf.PhiConfig(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=P, resid_pdrop=DROP, embd_pdrop=DROP, attention_dropout=DROP, **EAGER)))
causal("bloom", "BLOOM (ALiBi, embedding LayerNorm)", lambda: tf.BloomForCausalLM(tf.BloomConfig(
    vocab_size=V, hidden_size=16, n_layer=2, n_head=2, hidden_dropout=DROP, attention_dropout=DROP,
    **EAGER)))
causal("gemma", "Gemma (scaled embeddings, (1+w) RMSNorm, tied head)", lambda: tf.GemmaForCausalLM(tf.GemmaConfig(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, max_position_embeddings=P, **EAGER)))
causal("opt", "OPT (learned offset positions, MLP on [B·T, d])", lambda: tf.OPTForCausalLM(tf.OPTConfig(
    vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
    max_position_embeddings=P, word_embed_proj_dim=16, dropout=DROP, attention_dropout=DROP,
    **EAGER)))
causal("falcon", "Falcon (parallel attention, rotary)", lambda: tf.FalconForCausalLM(tf.FalconConfig(
    vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, hidden_dropout=DROP,
    attention_dropout=DROP, **EAGER)))

register(Case("t5", "hf", "T5 encoder-decoder (relative position bias)", seeded(
    lambda: tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=DROP,
        decoder_start_token_id=0, pad_token_id=0, **EAGER))), seq2seq_batch, seq2seq_loss))
register(Case("bart", "hf", "BART encoder-decoder (learned positions)", seeded(
    lambda: tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=P,
        dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, pad_token_id=0,
        decoder_start_token_id=2, forced_eos_token_id=None, **EAGER))), seq2seq_batch, seq2seq_loss))


def _mlm(name, what, make):
    register(Case(name, "hf", what, seeded(make), mlm_batch, mlm_loss))


_BERT = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
             max_position_embeddings=P, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, **EAGER)
_mlm("bert-mlm", "BERT masked LM (decoder bias shared by head and decoder)",
     lambda: tf.BertForMaskedLM(tf.BertConfig(**_BERT)))
_mlm("roberta-mlm", "RoBERTa masked LM", lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(
    **{**_BERT, "max_position_embeddings": P + 2}, pad_token_id=0)))
_mlm("albert-mlm", "ALBERT masked LM (shared layers, factorised embeddings)",
     lambda: tf.AlbertForMaskedLM(tf.AlbertConfig(**{**_BERT, "embedding_size": 8})))
_mlm("distilbert-mlm", "DistilBERT masked LM", lambda: tf.DistilBertForMaskedLM(tf.DistilBertConfig(
    vocab_size=V, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=P, dropout=DROP,
    attention_dropout=DROP, **EAGER)))
_mlm("deberta-v2-mlm", "DeBERTa-v2 masked LM (disentangled relative attention)",
     lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
         **_BERT, relative_attention=True, position_buckets=4, max_relative_positions=P,
         pos_att_type=["p2c", "c2p"], position_biased_input=False)))
_mlm("deberta-v3-mlm", "DeBERTa-v3 masked LM (shared attention keys, LayerNorm on the relative table)",
     lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(
         **_BERT, relative_attention=True, position_buckets=4, max_relative_positions=P,
         pos_att_type=["p2c", "c2p"], position_biased_input=False, share_att_key=True, norm_rel_ebd="layer_norm")))

register(Case("bert-cls-padded", "hf", "BERT sequence classification, right-padded batch",
              seeded(lambda: tf.BertForSequenceClassification(tf.BertConfig(**_BERT, num_labels=3))),
              cls_batch, cls_loss))


def electra_loss(model, batch):
    """Replaced-token detection: per-token binary cross-entropy, padding masked out."""
    mask = batch["attention_mask"]
    logits = upcast(model(input_ids=batch["input_ids"], attention_mask=mask).logits)
    tok = F.binary_cross_entropy_with_logits(logits, batch["replaced"].float(), reduction="none")
    return token_mean(tok, mask)


def electra_batch(B, T, g):
    b = padded_lm_batch("right")(B, T, g)
    b["replaced"] = (torch.rand(B, T, generator=g) < 0.3).long()
    return b


register(Case("electra", "hf", "ELECTRA discriminator (replaced-token detection, padded)", seeded(
    lambda: tf.ElectraForPreTraining(tf.ElectraConfig(**{**_BERT, "embedding_size": 8}))),
    electra_batch, electra_loss))


def vit_batch(B, T, g):
    return {"pixel_values": floats(g, B, 3, 8, 8), "labels": torch.randint(0, 3, (B,), generator=g)}


def vit_loss(model, batch):
    return F.cross_entropy(upcast(model(pixel_values=batch["pixel_values"]).logits), batch["labels"],
                           reduction="none")


register(Case("vit", "hf", "ViT image classification (8x8 image, 4x4 patches; T unused)", seeded(
    lambda: tf.ViTForImageClassification(tf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, num_labels=3,
        **EAGER))), vit_batch, vit_loss))


def clip_loss(model, batch):
    out = upcast(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).text_embeds)
    g = torch.Generator().manual_seed(7)
    target = torch.randn(out.shape[1], generator=g).to(out.dtype)
    return (out - target).pow(2).mean(1)


register(Case("clip-text", "hf", "CLIP text model with projection (causal mask, padded)", seeded(
    lambda: tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, projection_dim=8, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=P, dropout=DROP, attention_dropout=DROP,
        bos_token_id=0, pad_token_id=0, eos_token_id=V - 1, **EAGER))), padded_lm_batch("right"), clip_loss))


def whisper_batch(B, T, g):
    return {"input_features": floats(g, B, 8, 16), "labels": torch.randint(0, 3, (B,), generator=g)}


def whisper_loss(model, batch):
    return F.cross_entropy(upcast(model(input_features=batch["input_features"]).logits), batch["labels"],
                           reduction="none")


register(Case("whisper-encoder", "hf", "Whisper encoder + classifier (8 mel bins, 16 frames; T unused)", seeded(
    lambda: tf.WhisperForAudioClassification(tf.WhisperConfig(
        vocab_size=V, num_mel_bins=8, d_model=16, encoder_layers=2, encoder_attention_heads=2,
        decoder_layers=1, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_source_positions=8, max_target_positions=P, classifier_proj_size=8, num_labels=3, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, decoder_start_token_id=0,
        dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, **EAGER))),
    whisper_batch, whisper_loss))


# ------------------------------------------------------------------ variants


def _llama_lora():
    import peft
    base = _llama(False)()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    return peft.get_peft_model(base, lora)


def _gpt2_frozen():
    model = _gpt2()
    for p in [*model.transformer.wpe.parameters(), *model.transformer.h[0].parameters()]:
        p.requires_grad_(False)
    return model


causal("llama-lora", "Llama with peft LoRA adapters on q/v/down projections", _llama_lora, tags=("variant",))
causal("gpt2-frozen", "GPT-2 with positions and block 0 frozen", _gpt2_frozen, tags=("variant",))
causal("gpt2-padded", "GPT-2, right-padded batch with attention mask", _gpt2, padded_lm_batch("right"),
       tags=("variant",))
causal("llama-padded", "Llama, right-padded batch with attention mask", _llama(False),
       padded_lm_batch("right"), tags=("variant",))

LONG = 64       # added to T: long enough that the ghost norm's Gram blocks recurse (32-row blocks)
causal("gpt2-long", f"GPT-2 at sequence length T + {LONG}", lambda: _gpt2(positions=128),
       lambda B, T, g: lm_batch(B, T + LONG, g), tags=("variant",))
