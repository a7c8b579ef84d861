"""dpclip/torch_compat.py's compile_fullgraph: the compiled micro-batch's torch.compile settings."""

from __future__ import annotations

import torch

from dpclip.torch_compat import COMPILED_SHAPES_LIMIT, compile_fullgraph, own_code


class _Scaler:
    def __init__(self, factor: float):
        self.factor = factor

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.factor).sin()


def test_more_batch_shapes_than_torchs_default_recompile_limit_compile():
    """torch's default is 8 graphs per function; a Trainer padding to each batch's longest sequence
    meets more. 12 shapes (aot_eager: no code generated) all compile and compute."""
    assert COMPILED_SHAPES_LIMIT > 12 > torch._dynamo.config.recompile_limit
    run = compile_fullgraph(_Scaler(2.0).scaled, backend="aot_eager")
    for rows in range(1, 13):
        x = torch.linspace(0, 1, rows)
        torch.testing.assert_close(run(x), (2 * x).sin())


def test_each_compiled_function_counts_its_shapes_alone():
    """Two compiled micro-batches (two models in one process) share no code object, so neither
    spends the other's recompile limit, and each keeps its own bound state."""
    first, second = own_code(_Scaler(2.0).scaled), own_code(_Scaler(3.0).scaled)
    assert first.__func__.__code__ is not second.__func__.__code__
    assert first.__func__.__code__ is not _Scaler.scaled.__code__
    x = torch.ones(3)
    torch.testing.assert_close(first(x), (2 * x).sin())
    torch.testing.assert_close(second(x), (3 * x).sin())
