"""Model zoo: mlp, cnn, transformers (hf) and custom factories, with per-sample losses.

    from dpclip.models import build_model, evaluate
    model, loss_fn = build_model(recipe.model, data, seed=recipe.seed)
    losses = loss_fn(model, batch)                    # Tensor[b], one loss per example
    metrics = evaluate(model, loss_fn, data.test, data.task, batch_size=256)
"""

from dpclip.models.build import BATCHNORM_HINT, build_model, refuse_batchnorm
from dpclip.models.evaluate import evaluate
from dpclip.models.losses import PerSampleLoss

__all__ = ["BATCHNORM_HINT", "PerSampleLoss", "build_model", "evaluate", "refuse_batchnorm"]
