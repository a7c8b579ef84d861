"""A Hugging Face Trainer script made private with dpclip's DPTrainer (docs/python-api.md).

    python examples/hf_trainer.py [OUTPUT_DIR]

A tiny BERT with random weights learns which cuisine a generated restaurant sentence names,
with DP-AdamW at ε = 8 (δ = 1e-5); the only changes to a plain Trainer script are the three
marked lines. Writes the model, ledger.json and privacy.json to OUTPUT_DIR (default:
hf_trainer_out). Runs on a CPU and prints its held-out accuracy (chance is 14%; it varies from run to run: the noise is fresh).
"""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from dpclip.data.builtin import FOODS, synthetic_cuisine_sentences
from dpclip.integrations.transformers import DPTrainer, PrivacyArguments  # dpclip (1/3)

LENGTH = 48


def encode(sentence: str) -> dict:
    """Bytes as token ids (0 is padding), so that no tokenizer is downloaded."""
    ids = [byte + 1 for byte in sentence.encode()[:LENGTH]]
    return {"input_ids": torch.tensor(ids + [0] * (LENGTH - len(ids))),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * (LENGTH - len(ids)))}


def collate(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


sentences, labels = synthetic_cuisine_sentences(4400, seed=0)
examples = [{**encode(s), "labels": torch.tensor(int(y))} for s, y in zip(sentences, labels)]
train, test = examples[:4000], examples[4000:]

torch.manual_seed(0)
config = BertConfig(vocab_size=257, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=LENGTH, num_labels=len(FOODS))
model = BertForSequenceClassification(config)
output_dir = sys.argv[1] if len(sys.argv) > 1 else "hf_trainer_out"
args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=128, gradient_accumulation_steps=2,
                         num_train_epochs=8, learning_rate=0.04, optim="adamw_torch", report_to=[],
                         logging_steps=10, save_strategy="no", use_cpu=True,
                         max_grad_norm=0)                                     # dpclip (2/3): no second clip
trainer = DPTrainer(model=model, args=args, train_dataset=train, data_collator=collate,
                    privacy=PrivacyArguments(target_epsilon=8.0, delta=1e-5,  # dpclip (3/3)
                                             clipping={"grouping": "layer", "threshold": {"kind": "fixed",
                                                                                          "value": 1.0}}))
trainer.train()
trainer.save_model()

model.eval()
batch = collate(test)
with torch.no_grad():
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
accuracy = (logits.argmax(1) == batch["labels"]).float().mean().item()
print(f"held-out accuracy {accuracy:.3f} (not covered by ε), ε = {trainer.account.epsilon():.3f}, δ = 1e-05")
