"""A tiny DPTrainer run, as a script: `python trainer_ranks_case.py OUT` in one process, or
under `torchrun --nproc-per-node 2` (tests/integrations/test_transformers_ranks.py).

Seeded (`unsafe_seed`, tests only): the ranks' Poisson parts together are the one-process
draw and rank 0 draws the one-process noise, so both runs reach the same weights."""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from dpclip.integrations.transformers import DPTrainer, PrivacyArguments

BATCH = 64        # B: (32 per device on one process, 16 on each of two) × 2 accumulation steps
EXAMPLES = 256
STEPS = 4


def main(out: str) -> None:
    generator = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(1, 40, (8,), generator=generator),
                 "labels": torch.randint(0, 3, (), generator=generator)} for _ in range(EXAMPLES)]
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    processes = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH // 2 // processes,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=0.05, report_to=[],
                             save_strategy="no", use_cpu=True, max_grad_norm=0, logging_steps=1)
    trainer = DPTrainer(model=model, args=args, train_dataset=examples,
                        data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
                        privacy=PrivacyArguments(noise_multiplier=1.0, delta=1e-5, max_grad_norm=0.5, unsafe_seed=0))
    trainer.train()
    trainer.save_model()
    if torch.distributed.is_initialized():   # the group's gloo threads end here, not while Python exits
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
