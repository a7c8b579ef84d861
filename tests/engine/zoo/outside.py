"""Cases an outside reviewer would choose (issue 49): architectures the first zoo lacked, and
patterns that are hard for a per-sample engine: samples mixed inside the forward, rows gathered
or permuted across the batch, parametrizations, data written into buffers, shapes or ints
derived from the batch size, state kept on a module during its forward, several forwards per
loss, upstream tensors returned beside the logits. Each is exact, or refused with its reason
(known_faults.EXPECTED_REFUSALS); the certificate (docs/certificate.md) is what turns the formerly
silent ones into refusals."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from tests.engine.zoo import Case, floats, readout, seeded, upcast
from tests.engine.zoo import register as _register
from tests.engine.zoo.hf import (DROP, EAGER, P, V, causal_loss, cls_loss, lm_batch, mlm_batch, mlm_loss,
                                 padded_lm_batch, seq2seq_batch, seq2seq_loss)

#: the tag of this file's cases: their runs are all in the slow suite (tests/engine/test_hf_zoo.py)
OUTSIDE = "outside"


def register(case: Case) -> Case:
    return _register(Case(case.name, case.family, case.what, case.build, case.batch, case.loss,
                          case.tags + (OUTSIDE,)))


def causal(name, what, make, batch=lm_batch):
    register(Case(name, "hf", what, seeded(make), batch, causal_loss))

D = 6


def _small(**extra):
    return dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=P, **extra)


# ------------------------------------------------------------------ causal language models

causal("gptj", "GPT-J (rotary, parallel attention/MLP)", lambda: tf.GPTJForCausalLM(tf.GPTJConfig(
    vocab_size=V, n_embd=16, n_layer=2, n_head=2, rotary_dim=4, n_positions=P, resid_pdrop=DROP,
    embd_pdrop=DROP, attn_pdrop=DROP, **EAGER)))
causal("gpt-bigcode", "GPT-BigCode (multi-query attention)", lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
    vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P, multi_query=True, resid_pdrop=DROP,
    embd_pdrop=DROP, attn_pdrop=DROP, **EAGER)))
causal("codegen", "CodeGen (fused qkv with mp_num interleaving)", lambda: tf.CodeGenForCausalLM(tf.CodeGenConfig(
    vocab_size=V, n_embd=16, n_layer=2, n_head=4, rotary_dim=4, n_positions=P, n_ctx=P, resid_pdrop=DROP,
    embd_pdrop=DROP, attn_pdrop=DROP, **EAGER)))
causal("stablelm", "StableLM (partial rotary, LayerNorm)", lambda: tf.StableLmForCausalLM(tf.StableLmConfig(
    **_small(num_key_value_heads=1), partial_rotary_factor=0.5, **EAGER)))
causal("qwen3", "Qwen3 (q/k RMSNorm per head)", lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
    **_small(num_key_value_heads=1), head_dim=8, **EAGER)))
causal("gemma2", "Gemma2 (logit soft-capping, sandwich norms, sliding window)", lambda: tf.Gemma2ForCausalLM(
    tf.Gemma2Config(**_small(num_key_value_heads=1), head_dim=8, sliding_window=3, **EAGER)))
causal("olmo2", "OLMo2 (post-norm, q/k norms over all heads)", lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(
    **_small(num_key_value_heads=2), **EAGER)))
causal("biogpt", "BioGPT (scaled embeddings, learned positions)", lambda: tf.BioGptForCausalLM(tf.BioGptConfig(
    **_small(), hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, **EAGER)))
causal("starcoder2", "Starcoder2 (biased GQA, LayerNorm)", lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(
    **_small(num_key_value_heads=1), **EAGER)))
causal("phi3", "Phi-3 (fused qkv and gate_up projections)", lambda: tf.Phi3ForCausalLM(tf.Phi3Config(
    **_small(num_key_value_heads=2), pad_token_id=0, **EAGER)))
causal("cohere", "Cohere (parallel block, LayerNorm without bias, logit scale)", lambda: tf.CohereForCausalLM(
    tf.CohereConfig(**_small(num_key_value_heads=1), **EAGER)))
causal("gpt-neo", "GPT-Neo (local and global attention layers)", lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
    vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
    window_size=3, max_position_embeddings=P, embed_dropout=DROP, attention_dropout=DROP, resid_dropout=DROP,
    **EAGER)))
causal("gpt2-padded-left", "GPT-2, left-padded batch", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
    vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=P, resid_pdrop=DROP, embd_pdrop=DROP,
    attn_pdrop=DROP, **EAGER)), padded_lm_batch("left"))


# ------------------------------------------------------------------ encoders, seq2seq

def _mlm(name, what, make):
    register(Case(name, "hf", what, seeded(make), mlm_batch, mlm_loss))


_mlm("xlm-roberta-mlm", "XLM-RoBERTa masked LM", lambda: tf.XLMRobertaForMaskedLM(tf.XLMRobertaConfig(
    **{**_small(), "max_position_embeddings": P + 2}, pad_token_id=0, **EAGER)))
_mlm("mobilebert-mlm", "MobileBERT masked LM (bottlenecks, NoNorm, embedding 3-gram convolution)",
     lambda: tf.MobileBertForMaskedLM(tf.MobileBertConfig(
         vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16,
         embedding_size=8, intra_bottleneck_size=8, true_hidden_size=8, num_feedforward_networks=2,
         max_position_embeddings=P)))
_mlm("squeezebert-mlm", "SqueezeBERT masked LM (grouped 1-D convolutions)",
     lambda: tf.SqueezeBertForMaskedLM(tf.SqueezeBertConfig(
         **_small(), embedding_size=16, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
         intermediate_groups=2, output_groups=2)))
_mlm("convbert-mlm", "ConvBERT masked LM (span-based dynamic convolution)",
     lambda: tf.ConvBertForMaskedLM(tf.ConvBertConfig(**_small(), embedding_size=16, head_ratio=2, conv_kernel_size=3)))
_mlm("funnel-mlm", "Funnel Transformer masked LM (pooled blocks, upsampling)",
     lambda: tf.FunnelForMaskedLM(tf.FunnelConfig(vocab_size=V, block_sizes=[1, 1], d_model=16, n_head=2, d_head=8,
                                                  d_inner=32, num_decoder_layers=1)))
_mlm("modernbert-mlm", "ModernBERT masked LM (sparse prediction of the masked tokens only)",
     lambda: tf.ModernBertForMaskedLM(tf.ModernBertConfig(
         vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
         max_position_embeddings=P, pad_token_id=0, sparse_prediction=True, local_attention=4, **EAGER)))
register(Case("roberta-cls", "hf", "RoBERTa sequence classification (padded)", seeded(
    lambda: tf.RobertaForSequenceClassification(tf.RobertaConfig(
        **{**_small(), "max_position_embeddings": P + 2}, pad_token_id=0, num_labels=3, **EAGER))),
    lambda B, T, g: {**padded_lm_batch("right")(B, T, g), "labels": torch.randint(0, 3, (B,), generator=g)},
    cls_loss))


def _seq2seq(name, what, make):
    register(Case(name, "hf", what, seeded(make), seq2seq_batch, seq2seq_loss))


_S2S = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=P,
            dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, pad_token_id=0, decoder_start_token_id=2,
            forced_eos_token_id=None, **EAGER)
_seq2seq("marian", "Marian MT (sinusoidal positions, shared embeddings)",
         lambda: tf.MarianMTModel(tf.MarianConfig(**_S2S)))
_seq2seq("mbart", "mBART (pre-norm encoder-decoder, layernorm_embedding)",
         lambda: tf.MBartForConditionalGeneration(tf.MBartConfig(**_S2S)))
_seq2seq("pegasus", "Pegasus (sinusoidal positions)", lambda: tf.PegasusForConditionalGeneration(tf.PegasusConfig(**_S2S)))
_seq2seq("m2m100", "M2M100 (sinusoidal positions offset by padding)",
         lambda: tf.M2M100ForConditionalGeneration(tf.M2M100Config(**_S2S)))


# ------------------------------------------------------------------ vision, audio

def image_batch(B, T, g):
    return {"pixel_values": floats(g, B, 3, 8, 8), "labels": torch.randint(0, 3, (B,), generator=g)}


def image_loss(model, batch):
    return F.cross_entropy(upcast(model(pixel_values=batch["pixel_values"]).logits), batch["labels"],
                           reduction="none")


def _image(name, what, make):
    register(Case(name, "hf", what, seeded(make), image_batch, image_loss))


_image("deit", "DeiT (class and distillation tokens)", lambda: tf.DeiTForImageClassification(tf.DeiTConfig(
    image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
    num_labels=3, **EAGER)))
_image("convnext", "ConvNeXt (depthwise 7x7 convolutions, channels-last LayerNorm, layer scale)",
       lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
           num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
           image_size=8)))
_image("dinov2", "DINOv2 (layer scale, interpolated position embeddings)",
       lambda: tf.Dinov2ForImageClassification(tf.Dinov2Config(
           image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
           num_labels=3, **EAGER)))
_image("swin", "Swin (shifted windows, relative position bias table shared by all samples)",
       lambda: tf.SwinForImageClassification(tf.SwinConfig(
           image_size=8, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=3)))
_image("resnet", "ResNet (BatchNorm: must be refused)", lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
    num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)))


def audio_batch(B, T, g):
    return {"input_values": floats(g, B, 400), "labels": torch.randint(0, 3, (B,), generator=g)}


def audio_loss(model, batch):
    return F.cross_entropy(upcast(model(input_values=batch["input_values"]).logits), batch["labels"],
                           reduction="none")


register(Case("wav2vec2", "hf", "wav2vec2 classifier (GroupNorm feature extractor, weight-normed positional "
              "convolution)", seeded(lambda: tf.Wav2Vec2ForSequenceClassification(tf.Wav2Vec2Config(
                  hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=4,
                  num_conv_pos_embedding_groups=2, num_labels=3, classifier_proj_size=8, mask_time_prob=0.0,
                  hidden_dropout=DROP, attention_dropout=DROP, feat_proj_dropout=DROP, **EAGER))),
              audio_batch, audio_loss))


# ------------------------------------------------------------------ patterns

def seq(B, T, g):
    return {"x": floats(g, B, T, D)}


def read_loss(model, batch):
    return readout(model(**batch))


def pattern(name, what, cls, batch=seq, loss=read_loss):
    register(Case(name, "pattern", what, seeded(cls), batch, loss))


class WeightNormLinear(nn.Module):
    """torch.nn.utils.parametrizations.weight_norm on a Linear (wav2vec2's, HuBERT's)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


class WeightNormGroupedConv(nn.Module):
    """weight_norm on a grouped Conv1d over [B, d, T] (wav2vec2's positional convolution)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(D, D, 3, padding=1, groups=2), dim=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class GatherAcrossBatch(nn.Module):
    """ModernBERT's sparse prediction in its minimal form: h.flatten(0, 1)[mask] -> Linear."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(h.flatten(0, 1)[(x[..., 0] > 0).flatten()])


def gather_loss(model, batch):
    x = batch["x"]
    keep = (x[..., 0] > 0)
    sample = torch.arange(x.shape[0]).repeat_interleave(x.shape[1])[keep.flatten()]
    per_token = readout(model(**batch))
    return torch.zeros(x.shape[0], dtype=per_token.dtype).index_add(0, sample, per_token)


class ReversedBatch(nn.Module):
    """The batch permuted inside the forward (reversed), processed, and put back in order."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, 4)

    def forward(self, x):
        order = torch.arange(x.shape[0] - 1, -1, -1)
        return self.b(torch.tanh(self.a(x[order])))[torch.argsort(order)]


class Center(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


class CenteredBatch(nn.Module):
    """A parameter-free x - x.mean(0) between two Linears: samples mix."""

    def __init__(self):
        super().__init__()
        self.a, self.center, self.b = nn.Linear(D, D), Center(), nn.Linear(D, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.center(self.a(x))))


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(D))
        self.register_buffer("running_var", torch.ones(D))

    def forward(self, x):
        return F.batch_norm(x.transpose(1, 2), self.running_mean, self.running_var, training=True).transpose(1, 2)


class FunctionalBatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(D, D), FunctionalBatchNorm(), nn.Linear(D, 4)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


class CopyRow(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("row", torch.zeros(D))

    def forward(self, x):
        self.row.copy_(x[0, 0].detach())
        return x


class RowInBuffer(nn.Module):
    """A buffer that copies a training row into itself (released verbatim in state_dict)."""

    def __init__(self):
        super().__init__()
        self.copy, self.lin = CopyRow(), nn.Linear(D, 4)

    def forward(self, x):
        return self.lin(self.copy(x))


class ScaleByCount(nn.Module):
    """A module called with an int derived from the batch size."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x, n):
        return x * self.w / (1.0 + 0.0 * n)


class IntFromBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.head = ScaleByCount(), nn.Linear(D, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.scale(x, x.shape[0])))


class ReshapeTo(nn.Module):
    """A module called with a torch.Size taken from its input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x, shape):
        return (x.reshape(-1, D) @ self.w).reshape(shape)


class SizeFromBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix, self.head = ReshapeTo(), nn.Linear(D, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(x, x.shape)))


class KeepsState(nn.Module):
    """A fallback module that keeps its last activation on ``self`` during its forward."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D) * 0.5)
        self.last = None

    def forward(self, x):
        self.last = x * self.w
        return torch.tanh(self.last)


class StateOnSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.keep, self.head = KeepsState(), nn.Linear(D, 4)

    def forward(self, x):
        return self.head(self.keep(x))


class Siamese(nn.Module):
    """One encoder called twice per sample (two views), the loss from both outputs."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.enc(x), self.enc(x.flip(1))


def siamese_loss(model, batch):
    a, b = model(**batch)
    return (a - b).pow(2).mean((1, 2)) + 0.1 * readout(a)


class ReturnsHidden(nn.Module):
    """Returns (logits, hidden): the hidden states are upstream of the logits, and the loss
    uses both (a regulariser on the hidden states)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h), h


def hidden_loss(model, batch):
    logits, h = model(**batch)
    return readout(logits) + 0.05 * h.pow(2).mean((1, 2))


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 4)

    def forward(self, x):
        return {"logits": self.a(x), "aux": torch.zeros(())}


def dict_loss(model, batch):
    return readout(model(**batch)["logits"])


class LearnedQueryExpand(nn.Module):
    """Attention pooling with a learned query expanded over the batch: q.expand(B, -1, -1)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(1, 1, D))
        self.k = nn.Linear(D, D)
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        q = self.q.expand(x.shape[0], -1, -1)
        att = torch.softmax(q @ self.k(x).transpose(1, 2), -1)
        return self.head(att @ x)


class EinsumWeight(nn.Module):
    """A parameter used by einsum inside a custom module (torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, D, D) * 0.3)

    def forward(self, x):
        return torch.einsum("btd,hde->bthe", x, self.w).flatten(2)


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(D, D, 4)

    def forward(self, x):
        return self.bil(x, torch.tanh(x))


class PReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D, 8), nn.PReLU(), nn.Linear(8, 4))

    def forward(self, x):
        return self.net(x)


class ConvTranspose(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose1d(D, 4, 3, stride=2)

    def forward(self, x):
        return self.up(x.transpose(1, 2))


class DepthwiseConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv1d(D, D, 3, padding=1, groups=D)
        self.pw = nn.Conv1d(D, 4, 1)

    def forward(self, x):
        return self.pw(torch.relu(self.dw(x.transpose(1, 2))))


class FullTransformer(nn.Module):
    """nn.Transformer (encoder-decoder) with batch_first, source and target from one sample."""

    def __init__(self):
        super().__init__()
        self.tr = nn.Transformer(d_model=D, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8,
                                 dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.tr(x, x.flip(1))


class BiGRU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(D, 4, num_layers=2, bidirectional=True, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0]


class PackedLSTM(nn.Module):
    """nn.LSTM on a PackedSequence (a sample has T - 1 steps where its first feature is positive,
    T otherwise: the length is the sample's own, as padding marks it in real data)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, 4, batch_first=True)

    def forward(self, x):
        lengths = (x.shape[1] - (x[:, 0, 0] > 0).long()).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


class PackedBiLSTM(nn.Module):
    """A 2-layer bidirectional LSTM on a PackedSequence from a learned initial state (Opacus'
    DPLSTM setting), then a GRU on its packed output."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(D, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.h0 = nn.Linear(D, 4 * 4)
        self.gru = nn.GRU(8, 4)

    def forward(self, x):
        lengths = (x.shape[1] - (x[:, 0, 0] > 0).long() - (x[:, 0, 1] > 0).long()).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        h0 = torch.tanh(self.h0(x[:, 0])).view(x.shape[0], 4, 4).transpose(0, 1).contiguous()
        out, _ = self.lstm(packed, (h0, torch.zeros_like(h0)))
        out, h = self.gru(out)
        padded = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]
        return padded + h[-1][:, None]


class SpectralNormLinear(nn.Module):
    """spectral_norm parametrization: its power-iteration buffers are updated from the weight alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)))


class MeanNormalisedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 4)

    def forward(self, x):
        return self.a(x)


def centred_loss(model, batch):
    per = readout(model(**batch))
    return per - per.mean()


pattern("weight-norm-linear", "weight_norm parametrization on nn.Linear", WeightNormLinear)
pattern("weight-norm-grouped-conv", "weight_norm on a grouped nn.Conv1d (wav2vec2's positional conv)",
        WeightNormGroupedConv)
pattern("spectral-norm-linear", "spectral_norm parametrization on nn.Linear (power iteration in buffers)",
        SpectralNormLinear)
pattern("gather-across-batch", "h.flatten(0, 1)[mask] -> Linear (tokens gathered across the batch)",
        GatherAcrossBatch, loss=gather_loss)
pattern("permuted-batch", "the batch permuted inside the forward and put back", ReversedBatch)
pattern("centered-batch", "x - x.mean(0) between two Linears (samples mix)", CenteredBatch)
pattern("functional-batchnorm", "F.batch_norm called functionally with running buffers", FunctionalBatchNormNet)
pattern("row-in-buffer", "a buffer that copies a training row into itself", RowInBuffer)
pattern("int-from-batch", "a module called with x.shape[0]", IntFromBatch)
pattern("size-from-batch", "a module called with x.shape (a torch.Size)", SizeFromBatch)
pattern("state-on-self", "a fallback module that keeps its activation on self", StateOnSelf)
pattern("siamese-two-views", "one encoder called twice per sample, loss from both", Siamese, loss=siamese_loss)
pattern("returns-hidden", "returns (logits, hidden), loss regularises hidden", ReturnsHidden, loss=hidden_loss)
pattern("dict-output", "returns a dict with a shared scalar beside the logits", DictOutput, loss=dict_loss)
pattern("learned-query-expand", "attention pooling with q.expand(B, -1, -1) of a learned query", LearnedQueryExpand)
pattern("einsum-weight", "a parameter used in einsum inside a custom module", EinsumWeight)
pattern("bilinear", "nn.Bilinear", Bilinear)
pattern("prelu", "nn.PReLU between Linears", PReLUNet)
pattern("conv-transpose", "nn.ConvTranspose1d with stride 2", ConvTranspose)
pattern("depthwise-conv", "depthwise nn.Conv1d (groups = channels) and a pointwise one", DepthwiseConv)
pattern("nn-transformer", "nn.Transformer encoder-decoder, batch_first", FullTransformer)
pattern("bigru", "nn.GRU, 2 layers, bidirectional", BiGRU)
pattern("packed-lstm", "nn.LSTM on a PackedSequence", PackedLSTM)
pattern("packed-bilstm-gru", "2-layer bidirectional nn.LSTM from a learned state, then nn.GRU, on PackedSequences",
        PackedBiLSTM)
pattern("mean-normalised-loss", "per-sample losses minus their batch mean", MeanNormalisedLoss, loss=centred_loss)
