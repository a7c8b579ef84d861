"""Two steps of a 5-module MLP, whole in one process or cut into 2 pipeline stages (tests/distributed)."""

from __future__ import annotations

import math

import torch
from torch import nn

from dpclip.data import micro_batches
from dpclip.engine import DPEngine
from dpclip.models.losses import cross_entropy

STAGES = ["^0$", "^2$"]   # stage 0: Linear, Tanh; stage 1: Linear, Tanh, Linear
CASES = {
    "fixed": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": 0.6}}, 0.0),
    "fixed-list": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": [0.2, 0.5]},
                    "noise_allocation": "weighted"}, 0.0),
    # the thresholds of step 2 come from step 1's per-stage counts (noise std 1e-9: the counts themselves)
    "quantile": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "quantile", "initial": 0.3, "sigma": 1e-9,
                                                                "lr": 0.5}}, 0.0),
    # with noise: only the noise stds and σ_eff are compared
    "noise-global": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "quantile", "initial": 0.3, "sigma": 2.0}},
                     1.3),
    "noise-equal-budget": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": [0.2, 0.5]},
                            "noise_allocation": "equal-budget"}, 1.3),
    "flat": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": 0.6}}, 0.0),
    # GPipe rounds of 2 chunks: (10, 10), then (4, 0): a chunk of padding only
    "fixed-rounds": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": 0.6}}, 0.0),
    "flat-rounds": ({"grouping": {"stages": STAGES}, "threshold": {"kind": "fixed", "value": 0.6}}, 0.0),
}
MICRO = 10  # 24 rows: micro-batches of 10, 10 and 4 (padded to 10 on the pipeline)


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(24, 6, dtype=torch.float64) * 2
    y = torch.randint(0, 3, (24,))
    return model, {"features": x, "labels": y}


def _record(model, report) -> dict:
    return {"grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "thresholds": report.thresholds.clone(), "noise_std_sum": report.noise_std_sum.clone(),
            "noise_multiplier": report.noise_multiplier, "samples": report.samples_seen, "groups": list(report.group_names),
            "clip_fraction": None if report.clip_fraction is None else report.clip_fraction.clone()}


def one_process(name: str, steps: int = 2) -> list[dict]:
    clipping, sigma = CASES[name]
    if name.startswith("flat"):
        clipping = dict(clipping, grouping="all-layer")
    model, train = _model_and_data()
    engine = DPEngine(model, clipping, gradient_noise_multiplier=sigma, expected_batch_size=24, seed=0, sample_rate=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(steps):
        for rows in micro_batches(torch.arange(24), MICRO):
            engine.backward(cross_entropy(model(train["features"][rows]), {"labels": train["labels"][rows]}))
        report = engine.privatize()
        out.append(_record(model, report))
        opt.step()
        opt.zero_grad(set_to_none=True)
    engine.detach()
    return out


def pipeline(world, name: str, steps: int = 2) -> list[dict]:
    from dpclip.distributed.pipeline import PipelineStep, pipeline_engine
    clipping, sigma = CASES[name]
    model, train = _model_and_data()
    engine = pipeline_engine(model, clipping, world, flat=name.startswith("flat"), gradient_noise_multiplier=sigma,
                             run_losses=lambda: cross_entropy(model(train["features"][:8]), {"labels": train["labels"][:8]}),
                             expected_batch_size=24, seed=0, sample_rate=0.5)
    opt = torch.optim.SGD(engine.module.parameters(), lr=0.5)
    step = PipelineStep(engine, opt, train, cross_entropy, "features", MICRO,
                        chunks=2 if name.endswith("rounds") else None)
    out = []
    for _ in range(steps):
        step(torch.arange(24), before_update=lambda report: out.append(_record(model, report)))
    engine.detach()
    out.append({"sent_bytes": engine.link.sent_bytes, "stash_peak": engine.engine.stash_bytes_peak})
    return out


def pipeline_recipe(out, *extra: str):
    """Quickstart's MLP (Flatten, Linear, ReLU, Linear, ReLU, Linear) cut before each of its first two
    Linears, 6 seeded steps, micro-batches of 16 (the last one of a batch padded), noise 1e-6: the
    trained weights are the clipped gradients' (the stages draw other noise than one process)."""
    from tests.distributed.workers import REPO
    from dpclip.recipe import load_recipe
    return load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"output_dir={out}", "training.epochs=null", "training.steps=6", "checkpoint.every_steps=3",
        "eval.every_steps=null", "privacy.unsafe_seeded_randomness=true", "privacy.epsilon=null",
        "privacy.noise_multiplier=1e-6", "privacy.accountant=rdp", "training.micro_batch_size=16",
        "clipping.grouping={stages: ['^1$', '^3$']}", "clipping.threshold={kind: quantile, initial: 1.0, sigma: 1e-6}",
        *extra])


def pipeline_worker(world, out_dir: str, names: list[str]) -> None:
    from pathlib import Path
    from dpclip.train.workflow import train
    results = {name: pipeline(world, name) for name in names}
    torch.save(results, f"{out_dir}/pipeline-{world.rank}.pt")
    train(pipeline_recipe(Path(out_dir) / "runs", "training.parallel=pipeline"), world=world,
          run_dir=Path(out_dir) / "run")


# Correlated noise on the stages: a fixed threshold (the mechanism's rule), each stage streams
# its own parameters' noise.
CORRELATED = {"banded": "privacy.mechanism={kind: banded-mf, bands: 3}",
              "blt": "privacy.mechanism={kind: blt, buffers: 2}"}


def correlated_recipe(out, mechanism: str, *extra: str):
    return pipeline_recipe(out, "clipping.threshold={kind: fixed, value: 1.0}", CORRELATED[mechanism],
                           "training.steps=30", "checkpoint.every_steps=10", *extra)


def correlated_pipeline_worker(world, out_dir: str, mechanism: str) -> None:
    from pathlib import Path
    from dpclip.train.workflow import train
    train(correlated_recipe(Path(out_dir) / "runs", mechanism, "training.parallel=pipeline"), world=world,
          run_dir=Path(out_dir) / "run")


class CountingReLU(nn.ReLU):
    """A ReLU with a persistent buffer counting its training forwards (their number follows the
    realised batch sizes: tests/privacy/test_forward_counters.py)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.calls += 1
        return super().forward(x)


def counting_mlp(input_shape, num_classes):
    """Quickstart's MLP shape, cut by ``pipeline_recipe``'s stages before children 1 and 3: the
    counter (child 4) is in the second stage, which rank 1 holds."""
    width = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 16), CountingReLU(),
                         nn.Linear(16, num_classes))


def counting_pipeline_worker(world, out_dir: str) -> None:
    from pathlib import Path
    from dpclip.train.workflow import train
    train(pipeline_recipe(Path(out_dir) / "runs", "training.parallel=pipeline",
                          "model={kind: custom, target: 'tests.distributed.pipeline_case:counting_mlp'}"),
          world=world, run_dir=Path(out_dir) / "run")
