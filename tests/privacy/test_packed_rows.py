"""The privacy unit when a collate could make rows that are not examples: packing several examples
into one row (Hugging Face's DataCollatorWithFlattening, padding-free collators) or cutting one
example into several rows (concatenate-and-chunk). The engine clips each row as one example and
the statement says "example-level", so such a batch is refused at the draw, before anything is
released or charged (docs/python-api.md, "What the loop must do")."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import dpclip
from dpclip.errors import DpclipError
from dpclip.integrations.collate import EmptyDrawCollate
from tests.privacy.conftest import counted_releases

VOCAB, BLOCK = 12, 4


def _documents(n: int = 60) -> list[torch.Tensor]:
    """Token documents of 2 to 9 tokens (seeded)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g) for _ in range(n)]


def _packed(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw as one row (as DataCollatorWithFlattening does): tokens and restarting positions."""
    return torch.cat(rows)[None], torch.cat([torch.arange(len(r)) for r in rows])[None]


def _chunked(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw concatenated and cut into blocks (the group_texts recipe, in the collate)."""
    tokens = torch.cat(rows)
    tokens = tokens[:len(tokens) // BLOCK * BLOCK].view(-1, BLOCK)
    return tokens, torch.arange(BLOCK).repeat(len(tokens), 1)


def _split(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example cut into blocks of its own (padded with 0): an example spans several rows."""
    blocks = [b for r in rows for b in torch.nn.functional.pad(r, (0, -len(r) % BLOCK)).view(-1, BLOCK)]
    tokens = torch.stack(blocks)
    return tokens, torch.arange(BLOCK).repeat(len(tokens), 1)


COLLATES = {"packed into one row": _packed, "concatenated and chunked": _chunked, "each cut into blocks": _split}


class _Tokens(nn.Module):
    """Embeddings of tokens plus positions, then a linear head: [b, T] -> [b, T, VOCAB]."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions, self.head = nn.Embedding(VOCAB, 6), nn.Embedding(64, 6), nn.Linear(6, VOCAB)

    def forward(self, ids, positions):
        return self.head(self.tokens(ids) + self.positions(positions))


def _next_token_loss(logits, ids):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                       reduction="none").view(len(ids), -1).mean(1)


@pytest.mark.parametrize("collate", COLLATES.values(), ids=list(COLLATES))
def test_a_collate_fn_whose_rows_are_not_the_draw_s_examples_is_refused_before_anything_is_released(collate):
    """Before: a packed draw passed every check (no tensor had one row per example, so none was
    compared), and the whole draw was clipped as one example at the example-level ε."""
    torch.manual_seed(0)
    model = _Tokens()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, optimizer, DataLoader(_documents(), batch_size=20, collate_fn=collate),
                                      criterion=_next_token_loss, delta=1e-5, noise_multiplier=1.0, steps=5,
                                      max_grad_norm=1.0, unsafe_seed=3)
    released = counted_releases(private)
    with pytest.raises(DpclipError, match="not have one row per example drawn") as caught:
        for ids, positions in private.data_loader:
            private.criterion(private.model(ids, positions), ids).backward()
            private.optimizer.step()
    assert "one row per example" in caught.value.hint and "ε then protects a block, not a document" in caught.value.hint
    assert released == [] and private.ledger.steps == 0


def test_a_collate_fn_with_position_ids_expanded_over_the_rows_trains():
    """One row per example, with positions ``arange(T).expand(n, T)`` beside them (one row shared by
    all). Before: the loop's positions, the collated tensor itself, were compared with that same
    tensor, taken for an example's row and refused as "not the rows the data loader drew"."""
    def padded(rows):
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return ids, torch.arange(ids.shape[1]).expand_as(ids)
    torch.manual_seed(0)
    model = _Tokens()
    with pytest.warns(UserWarning, match="unsafe_seed"):
        private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(_documents(), batch_size=20, collate_fn=padded),
                                      criterion=_next_token_loss, delta=1e-5, noise_multiplier=1.0, steps=2,
                                      max_grad_norm=1.0, unsafe_seed=3)
    for ids, positions in private.data_loader:
        private.criterion(private.model(ids, positions), ids).backward()
        private.optimizer.step()
    assert private.ledger.steps == 2


def test_a_padding_collate_with_one_row_per_example_still_passes():
    def padded(rows):
        ids = nn.utils.rnn.pad_sequence(rows, batch_first=True)
        return ids, torch.arange(ids.shape[1]).repeat(len(ids), 1)
    documents = _documents(10)
    ids, _ = EmptyDrawCollate(documents, padded)(documents)
    assert ids.shape[0] == 10


def test_hugging_face_s_flattening_collator_is_refused_at_every_draw_size():
    """DataCollatorWithFlattening packs a draw into one row with restarting position_ids: through
    DPTrainer or make_private, every Poisson draw trained as one example (one draw of one example
    was already refused, its count check moving the one row)."""
    transformers = pytest.importorskip("transformers")
    flatten = transformers.DataCollatorWithFlattening(return_tensors="pt")
    documents = [{"input_ids": d.tolist()} for d in _documents(8)]
    collate = EmptyDrawCollate(documents, flatten)
    for n in (1, 2, 8):
        with pytest.raises(DpclipError, match="(not have one row per example|depend on the number of examples)"):
            collate(documents[:n])


def test_dptrainer_with_a_flattening_collator_is_refused_before_its_first_step_is_charged(tmp_path):
    """Before: each Poisson part trained as one packed row under "privacy unit: example-level"."""
    transformers = pytest.importorskip("transformers")
    from dpclip.integrations.transformers import DPTrainer, PrivacyArguments
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2,
                                                                 n_positions=128))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=10, max_steps=2,
                                          report_to=[], save_strategy="no", use_cpu=True, max_grad_norm=0,
                                          disable_tqdm=True, remove_unused_columns=False)
    trainer = DPTrainer(model=model, args=args, train_dataset=[{"input_ids": d.tolist()} for d in _documents(40)],
                        data_collator=transformers.DataCollatorWithFlattening(return_tensors="pt"),
                        privacy=PrivacyArguments(delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0))
    with pytest.raises(DpclipError, match="not have one row per example drawn"):
        trainer.train()
    assert trainer.account.ledger.steps == 0


class _Shifted(nn.Module):
    """A linear model plus ``w`` times a value per row read from a shared [1, n] tensor."""

    def __init__(self):
        super().__init__()
        self.lin, self.w = nn.Linear(5, 1), nn.Parameter(torch.ones(()))

    def forward(self, x, packed):
        return self.lin(x).squeeze(-1) + self.w * packed[0, :x.shape[0]]


def _labels_normalised_and_packed(items):
    """x one row per example (counted, so the row-count check passes); y as it is; each example's
    label normalised over the draw, packed into ONE row [1, n] (the replacement check skips it)."""
    x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
    z = (y - y.mean()) / (y.std() + 1e-6) if len(y) > 1 else y
    return x, y, z.reshape(1, -1)


LATER_PACKED = {   # the loop's use of the packed tensor, and the check that refuses it
    "unpacked as the target": (nn.MSELoss(), lambda m, x, y, z: (m(x, 0 * z), z.reshape(-1)),
                               "the criterion's target is not the rows the data loader drew"),
    "read by the criterion": (lambda out, z: nn.functional.mse_loss(out, z[0], reduction="none"),
                              lambda m, x, y, z: (m(x, 0 * z), z), "the criterion fails on one sample alone"),
    "read by the model": (nn.MSELoss(), lambda m, x, y, z: (m(x, z), y), "mixes samples"),
}


@pytest.mark.filterwarnings("ignore:Using a target size")   # the criterion's one-sample run broadcasts
@pytest.mark.parametrize("criterion, use, refusal", LATER_PACKED.values(), ids=list(LATER_PACKED))
def test_a_later_per_example_tensor_packed_into_one_row_is_refused_before_anything_is_released(criterion, use,
                                                                                              refusal):
    """The collate's row-count check reads the first tensor only; a later per-example tensor
    packed into one row (here labels normalised over the draw: one example moves every row) is
    not named there, but every way the loop can use it is refused before the first release."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, generator=g), torch.randn(64, generator=g))
    torch.manual_seed(0)
    model = _Shifted()
    private = dpclip.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  DataLoader(data, batch_size=16, collate_fn=_labels_normalised_and_packed),
                                  criterion=criterion, delta=1e-5, noise_multiplier=1.0, steps=3, max_grad_norm=1.0)
    released = counted_releases(private)
    model, optimizer, loss_of, loader = private
    with pytest.raises(DpclipError, match=refusal):
        for x, y, z in loader:
            loss_of(*use(model, x, y, z)).backward()
            optimizer.step()
    assert released == [] and private.ledger.steps == 0
