import math

import pytest
import torch

from dpclip.data import select
from dpclip.errors import DpclipError
from dpclip.models import build_model, evaluate
from dpclip.recipe.schema import HFModel

TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64}
TINY_BERT = {"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 64}


def gpt2(**overrides):
    return HFModel(kind="hf", task="causal-lm", config={**TINY_GPT2, **overrides})


def test_tiny_gpt2_takes_its_vocabulary_and_special_tokens_from_the_tokenizer(synthetic_text):
    model, loss_fn = build_model(gpt2(), synthetic_text)
    assert model.config.model_type == "gpt2"
    assert model.get_input_embeddings().num_embeddings == synthetic_text.vocab_size == 259
    assert model.config.pad_token_id == synthetic_text.pad_token_id
    assert model.config.eos_token_id == synthetic_text.tokenizer.eos_token_id
    losses = loss_fn(model, select(synthetic_text.train, torch.arange(6)))
    assert losses.shape == (6,) and torch.isfinite(losses).all()
    assert math.isclose(losses.mean().item(), math.log(259), rel_tol=0.1), "random init: near-uniform predictions"


def test_causal_lm_per_sample_loss_equals_the_models_own_loss_on_each_unpadded_example(synthetic_text):
    model, loss_fn = build_model(gpt2(), synthetic_text, seed=1)
    model.eval()  # no dropout, so the two computations see the same network
    batch = select(synthetic_text.train, torch.arange(5))
    lengths = batch["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) > 1, "examples of different lengths exercise the padding mask"
    with torch.no_grad():
        per_sample = loss_fn(model, batch)
        one_by_one = torch.stack([
            model(input_ids=ids[:length][None], labels=ids[:length][None]).loss
            for ids, length in zip(batch["input_ids"], lengths)])
    assert torch.allclose(per_sample, one_by_one, atol=1e-5)


def test_evaluate_gives_the_token_weighted_loss_and_its_perplexity_for_a_language_model(synthetic_text):
    model, loss_fn = build_model(gpt2(), synthetic_text)
    metrics = evaluate(model, loss_fn, synthetic_text.test, "causal-lm", batch_size=3)
    assert set(metrics) == {"loss", "perplexity"}
    assert math.isclose(metrics["perplexity"], math.exp(metrics["loss"]))
    model.eval()
    with torch.no_grad():
        test = synthetic_text.test
        logits = model(input_ids=test["input_ids"], attention_mask=test["attention_mask"]).logits
        token_mean = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), test["labels"][:, 1:])
    assert math.isclose(metrics["loss"], token_mean.item(), rel_tol=1e-5)


def test_tiny_bert_classifies_text_from_a_csv_with_one_cross_entropy_per_sample(text_classification):
    config = HFModel(kind="hf", task="sequence-classification", config=TINY_BERT)
    model, loss_fn = build_model(config, text_classification)
    assert model.config.num_labels == text_classification.num_classes == 2
    batch = select(text_classification.train, torch.arange(4))
    losses = loss_fn(model, batch)
    assert losses.shape == (4,) and torch.isfinite(losses).all()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.allclose(loss_fn.criterion(logits, batch),
                          torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none"))
    metrics = evaluate(model, loss_fn, text_classification.test, "classification")
    assert set(metrics) == {"loss", "accuracy"} and 0 <= metrics["accuracy"] <= 1


def test_a_local_pretrained_directory_loads_offline_with_its_saved_weights(synthetic_text, tmp_path):
    original, _ = build_model(gpt2(), synthetic_text, seed=5)
    original.save_pretrained(tmp_path / "tiny-gpt2")
    loaded, loss_fn = build_model(HFModel(kind="hf", task="causal-lm", pretrained=str(tmp_path / "tiny-gpt2")),
                                  synthetic_text, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), loaded.state_dict().values()))
    assert loss_fn(loaded, select(synthetic_text.train, torch.arange(2))).shape == (2,)


def test_a_missing_pretrained_directory_is_a_clear_error(synthetic_text, tmp_path):
    with pytest.raises(DpclipError) as info:
        build_model(HFModel(kind="hf", task="causal-lm", pretrained=str(tmp_path / "absent")), synthetic_text)
    assert "absent" in info.value.message and "local directory" in info.value.hint


def test_hf_models_refuse_data_that_does_not_fit_them(synthetic_text, text_classification, digits_data):
    with pytest.raises(DpclipError, match="text"):
        build_model(gpt2(), digits_data)
    with pytest.raises(DpclipError, match="unlabelled"):
        build_model(HFModel(kind="hf", task="sequence-classification", config=TINY_BERT), synthetic_text)
    with pytest.raises(DpclipError, match="causal-lm"):
        build_model(gpt2(), text_classification)
    with pytest.raises(DpclipError) as info:
        build_model(gpt2(n_positions=16), synthetic_text)  # examples are 64 tokens
    assert "max_length" in info.value.hint
    with pytest.raises(DpclipError, match="model_type"):
        build_model(HFModel(kind="hf", task="causal-lm", config={"n_layer": 1}), synthetic_text)
