"""peft LoRA adapters (docs/export.md, "LoRA") against a per-example loop.

peft's LoRA layers call their ``lora_A`` / ``lora_B`` children (plain ``nn.Linear``) and
a frozen ``base_layer``, so the engine's Linear rule sees every trainable parameter: the
norms and clipped sums must equal the per-example reference with ``strict: true`` (no
torch.func fallback), on GPT-2 (transformers' Conv1D bases) and BERT (nn.Linear bases).
"""

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import trainable_params
from tests.engine.conftest import DTYPE, check_exact

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, T = 40, 6


def _gpt2_lora():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                           init_lora_weights=False)   # nonzero B: every adapter gets a gradient
    return peft.get_peft_model(base, lora).to(DTYPE).eval()


def _bert_lora():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=T, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = transformers.AutoModelForSequenceClassification.from_config(config)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["query", "value", "dense"], init_lora_weights=False)
    return peft.get_peft_model(base, lora).to(DTYPE).eval()


def _causal_loss(model, batch):
    logits = model(input_ids=batch["ids"]).logits[:, :-1]
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["ids"][:, 1:], reduction="none")
    return per_token.mean(1)


def _classify_loss(model, batch):
    return F.cross_entropy(model(input_ids=batch["ids"]).logits, batch["y"], reduction="none")


def _batch(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(1, VOCAB, (n, T), generator=g), "y": torch.randint(0, 3, (n,), generator=g)}


def test_only_adapter_parameters_are_seen_by_the_engine():
    names = [n for info in trainable_params(_gpt2_lora()) for n in info.names]
    assert names and all("lora_" in n for n in names)
    # the classifier head of a SEQ_CLS adapter is trained too (peft's modules_to_save)
    names = [n for info in trainable_params(_bert_lora()) for n in info.names]
    assert any("classifier" in n for n in names)
    assert all("lora_" in n or "modules_to_save" in n for n in names)


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_gpt2_lora_norms_and_clipped_sum_match_per_example_loop(grouping):
    check_exact(_gpt2_lora, _causal_loss, _batch(), grouping, strict=True)


@pytest.mark.parametrize("grouping", ["all-layer", "param"])
def test_bert_lora_classifier_matches_per_example_loop(grouping):
    check_exact(_bert_lora, _classify_loss, _batch(), grouping, strict=True)
