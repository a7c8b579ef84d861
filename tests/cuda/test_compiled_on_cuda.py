"""The compiled micro-batch on a CUDA device (training.compile, docs/compiled.md; skipped without one).

Issue 54's count of host round trips: once compiled (a CUDA graph), one call of the graph runs
under ``torch.cuda.set_sync_debug_mode("error")`` without a synchronisation; the step's one read
of the device is the suspect flag, after the graph. And the graph's sums are the eager engine's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dpclip.engine import DPEngine
from dpclip.engine.compiled import CompiledMicroBatch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).cuda()


def _loss(model, batch):
    logits = model(input_ids=batch["ids"], use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["ids"][:, 1:], reduction="none").mean(1)


def _rows(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, 128, (8, 16), generator=g).cuda()}


def test_a_compiled_micro_batch_runs_without_a_host_synchronisation_and_as_the_engine():
    model = _gpt2()
    engine = DPEngine(model, {"grouping": "layer", "threshold": {"kind": "fixed", "value": 0.5}},
                      gradient_noise_multiplier=0.0, expected_batch_size=8)
    compiled = CompiledMicroBatch(engine, model, _loss)
    compiled(_rows(0), 8)            # through the engine, checked; the graph compiled and compared
    engine.debug_clipped()
    rows = _rows(1)
    seed = torch.ones(8, device="cuda")
    thresholds = engine.thresholds
    with compiled.probed():
        compiled.compiled(rows, seed, thresholds, None)   # warm: the CUDA graph recorded
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sums, norms, _, suspect, _ = compiled.compiled(rows, seed, thresholds, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not bool(suspect)
    sums = [None if s is None else s.clone() for s in sums]
    engine.backward(_loss(model, rows))
    eager = engine.debug_clipped()
    torch.testing.assert_close(norms, eager.norms, rtol=1e-4, atol=1e-7)
    for (name, want), got in zip(eager.sums.items(), sums):
        assert (got * 8 - want).norm() <= 1e-4 * want.norm() + 1e-7, name
    engine.detach()
