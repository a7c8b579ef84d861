"""PEFT adapters beyond LoRA on Linear (issue 52): their parameters live in ParameterDicts that the
adapter layer's own forward reads (IA3's ``ia3_l``, AdaLoRA's ``lora_E``, LoRA on an embedding's
``lora_embedding_A``): the torch.func fallback of that layer owns them, and the clipping is the
per-example reference's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import DPEngine
from dpclip.errors import EngineError
from tests.engine.conftest import DTYPE, bert_batch, bert_loss, check_exact, tiny_bert

peft = pytest.importorskip("peft")

CONFIGS = {
    "ia3": lambda: peft.IA3Config(task_type="SEQ_CLS", target_modules=["query", "value", "intermediate.dense"],
                                  feedforward_modules=["intermediate.dense"]),
    "adalora": lambda: peft.AdaLoraConfig(task_type="SEQ_CLS", target_modules=["query", "value"], init_r=2,
                                          total_step=10),
    "lora-embedding": lambda: peft.LoraConfig(task_type="SEQ_CLS", target_modules=["word_embeddings"], r=2),
}

QV = ["query", "value"]
#: the other adapters of peft 0.21 that wrap a Linear: kind -> (config, a name their parameters carry)
MORE = {
    "lokr": (lambda: peft.LoKrConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "lokr_w1"),
    "vera": (lambda: peft.VeraConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "vera_lambda_b"),
    "oft": (lambda: peft.OFTConfig(task_type="SEQ_CLS", target_modules=QV, r=0, oft_block_size=4), "oft_R"),
    "boft": (lambda: peft.BOFTConfig(task_type="SEQ_CLS", target_modules=QV, boft_block_size=4), "boft_R"),
    "hra": (lambda: peft.HRAConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "hra_u"),
    "fourierft": (lambda: peft.FourierFTConfig(task_type="SEQ_CLS", target_modules=QV, n_frequency=8),
                  "fourierft_spectrum"),
    "c3a": (lambda: peft.C3AConfig(task_type="SEQ_CLS", target_modules=QV, block_size=4), "c3a_kernel"),
    "miss": (lambda: peft.MissConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "miss_block"),
    "randlora": (lambda: peft.RandLoraConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "randlora_lambda"),
    "shira": (lambda: peft.ShiraConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "shira_weight"),
    "waveft": (lambda: peft.WaveFTConfig(task_type="SEQ_CLS", target_modules=QV, n_frequency=8), "waveft_spectrum"),
    "delora": (lambda: peft.DeloraConfig(task_type="SEQ_CLS", target_modules=QV, r=2), "delora_lambda"),
    "gralora": (lambda: peft.GraloraConfig(task_type="SEQ_CLS", target_modules=QV, r=4, gralora_k=2), "gralora_A"),
    "trainable-tokens": (lambda: peft.TrainableTokensConfig(task_type="SEQ_CLS", token_indices=[3, 5, 7]),
                         "trainable_tokens_delta"),
}


def _adapted(kind: str, train: bool = False):
    def make():
        torch.manual_seed(0)
        config = CONFIGS[kind]() if isinstance(kind, str) else kind
        model = peft.get_peft_model(tiny_bert().float(), config).to(DTYPE)
        for p in model.parameters():   # adapters start at the identity (IA3: ones, LoRA B: zeros)
            if p.requires_grad:
                with torch.no_grad():
                    p.add_(0.1 * torch.randn_like(p))
        return model.train(train)
    return make


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_adapters_in_parameter_dicts_clip_as_the_per_example_reference(kind, grouping):
    engine, _, _ = check_exact(_adapted(kind), bert_loss, bert_batch(), grouping=grouping, micro=[2, 3])
    names = [info.name for info in engine.groups.params]
    assert any(marker in name for name in names for marker in ("ia3_l", "lora_E", "lora_embedding_A")), names


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_prompt_tuning_clips_as_the_per_example_reference(grouping):
    """The shared prompt (``prompt_encoder(ids[:1]).repeat(B, 1, 1)``) gets each sample's own gradient."""
    config = peft.PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=3)
    engine, _, _ = check_exact(_adapted(config), bert_loss, bert_batch(), grouping=grouping, micro=[2, 3])
    assert any("prompt_encoder" in info.name for info in engine.groups.params)


@pytest.mark.parametrize("grouping", ["all-layer", "layer"])
def test_dora_clips_as_the_per_example_reference(grouping):
    """DoRA's weight norm calls lora_A and lora_B on an identity shared by all samples and only
    ever uses the result detached: those calls run as plain PyTorch, the per-sample calls and the
    magnitude vector are clipped as the reference."""
    config = peft.LoraConfig(task_type="SEQ_CLS", target_modules=["query", "value"], r=2, use_dora=True)
    engine, _, _ = check_exact(_adapted(config), bert_loss, bert_batch(), grouping=grouping, micro=[2, 3])
    assert any("lora_magnitude_vector" in info.name for info in engine.groups.params)


def test_a_loha_adapter_in_training_mode_replays_its_module_dropout_draw():
    """LoHa draws torch.rand(1) for its module dropout at every training forward (one number for
    the batch): each sample's recomputation replays it from the same generator state."""
    config = peft.LoHaConfig(task_type="SEQ_CLS", target_modules=["query", "value"], r=2, module_dropout=0.5)

    def seeded_loss(model, batch):   # the same draws in every forward: the reference's per example too
        torch.manual_seed(0)         # (seed 0: some adapters dropped, some kept)
        return bert_loss(model, batch)
    engine, _, _ = check_exact(_adapted(config, train=True), seeded_loss, bert_batch(), micro=[2, 3])
    grads = {info.name: info.param.grad for info in engine.groups.params if "hada_w1_a" in info.name}
    dropped = [name for name, g in grads.items() if not g.any()]
    assert 0 < len(dropped) < len(grads), dropped     # the draws dropped some adapters, not all


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(MORE))
def test_other_linear_adapters_clip_as_the_per_example_reference(kind):
    """LoKr, VeRA (A and B shared by every layer, frozen), OFT, BOFT, HRA, FourierFT, C3A, MiSS, RandLoRA,
    SHiRA, WaveFT, DeLoRA, GraLoRA and trainable tokens: exact, their parameters book-kept."""
    config, marker = MORE[kind]
    engine, _, _ = check_exact(_adapted(config()), bert_loss, bert_batch(), micro=[2, 3])
    names = [info.name for info in engine.groups.params]
    assert any(marker in name for name in names), names


def test_a_lokr_adapter_in_training_mode_replays_its_module_dropout_draw():
    """LoKr draws torch.rand(1) for its module dropout as LoHa does: replayed, exact."""
    config = peft.LoKrConfig(task_type="SEQ_CLS", target_modules=["query", "value"], r=2, module_dropout=0.5)

    def seeded_loss(model, batch):
        torch.manual_seed(0)
        return bert_loss(model, batch)
    engine, _, _ = check_exact(_adapted(config, train=True), seeded_loss, bert_batch(), micro=[2, 3])
    grads = {info.name: info.param.grad for info in engine.groups.params if "lokr_w1" in info.name}
    dropped = [name for name, g in grads.items() if not g.any()]
    assert 0 < len(dropped) < len(grads), dropped


def test_a_vblora_vector_bank_shared_by_every_layer_is_refused():
    """VBLoRA's layers read one vector bank (a parameter of no module of theirs) inside their forward:
    refused by name with a hint, before any noise."""
    config = peft.VBLoRAConfig(task_type="SEQ_CLS", target_modules=["query", "value"], r=2, num_vectors=8,
                               vector_length=4)
    model = _adapted(config)()
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=4)
    with pytest.raises(EngineError, match="(?s)attention.self.query.*hint:"):
        engine.backward(bert_loss(model, bert_batch()))


class DropoutMixer(torch.nn.Module):
    """A module of its own parameter with a dropout mask over [B, ...]: no sample can draw its
    row of the mask alone."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(F.dropout(x * self.scale, 0.5, training=True))


def test_a_dropout_mask_over_the_batch_in_a_fallback_module_is_refused():
    torch.manual_seed(0)
    model = DropoutMixer().to(DTYPE)
    x, y = torch.randn(4, 4, dtype=DTYPE), torch.tensor([0, 1, 2, 0])
    engine = DPEngine(model, {"grouping": "all-layer"}, gradient_noise_multiplier=0.0, expected_batch_size=4)
    with pytest.raises(EngineError, match="random operations"):
        engine.backward(F.cross_entropy(model(x), y, reduction="none"))

def _tied_gpt2_tokens():
    from tests.engine.conftest import tiny_gpt2
    torch.manual_seed(0)
    return peft.get_peft_model(tiny_gpt2().float(), peft.LoraConfig(target_modules=["c_attn"], r=2,
                                                                    trainable_token_indices=[3, 5, 7])).to(DTYPE)


def test_trainable_tokens_on_tied_gpt2_embeddings_match_the_per_example_loop():
    """LoRA with trainable_token_indices on GPT-2 (lm_head tied to wte: both adapters hold one
    ParameterDict). torch.func.functional_call in the certificate's replays put the swapped-in
    tensor back in the delta's place, so the model went on with a copy the optimizer never stepped
    (rev45): the replay now restores every module's parameters, and the clip is exact."""
    from tests.engine.conftest import gpt2_batch, gpt2_loss
    check_exact(_tied_gpt2_tokens, gpt2_loss, gpt2_batch())


def test_a_privatised_parameter_replaced_in_the_model_is_refused_before_noise():
    """A parameter the engine privatises that the model no longer holds (a plain tensor in its
    place) would be stepped where nothing reads it: refused at the backward, naming the fix."""
    from tests.engine.conftest import gpt2_batch, gpt2_loss
    model = _tied_gpt2_tokens()
    engine = DPEngine(model, {}, expected_batch_size=4, gradient_noise_multiplier=1.0)
    delta = model.base_model.model.transformer.wte.token_adapter.trainable_tokens_delta
    delta["default"] = torch.nn.Parameter(delta["default"].detach().clone(), requires_grad=False)   # in its place
    with pytest.raises(EngineError, match="no longer in the model") as err:
        engine.backward(gpt2_loss(model, gpt2_batch()))
    assert "after the model's last change" in err.value.hint
    engine.detach()
