"""Public and private phases of a continual run (docs/continual.md; Bu et al., "Pre-training
Differentially Private Models with Limited Public Data", section 4 and Algorithm 1).

The mixed gradient of the paper's section 4, with B₀ public and B₁ (expected) private rows:

    g_α = α/B₀ · Σ_public g_j + (1 − α)/B₁ · (Σ_private clip(g_i) + σ·C·N(0, I))

and the schedules of its Table 2: ``switch`` α_t = 1[t < sT] (public steps, then private
ones), ``dpmd`` α_t = 1 − cos(πt/2K), ``sample`` α = n_pub/(n_pub + n_priv), ``only-public``
α = 1 and ``only-private`` α = 0.

Privacy: a public step (α = 1) touches no private row, draws no private batch and is not
charged. Every step with α < 1 is a whole private step (:class:`~dpclip.train.step.PrivateStep`:
Poisson batch, clipping, noise σ) and is charged exactly like one: the mixing only rescales
the released gradient and adds a public one, which is post-processing. σ is calibrated for
the private steps of ``training`` (plus DP linear probing), fixed before the public phase,
so no public outcome moves it. The switch rules read public data only.

:class:`Continual` holds the public data, the public batches (plain shuffled batches from a
private-path generator, :mod:`dpclip.rng`), the public phase's optimizer and the switch
state. The loop (:mod:`dpclip.train.trainer`) asks it for the public phase, for each private
step's step function and its record fields; the checkpointer for its state. It holds no
reference to the loop: what it needs (the private step, where records go, how to save) is
handed to it.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
import time
from typing import Any

import torch
from torch import nn

from dpclip.data import select
from dpclip.data.public import describe_public, load_public
from dpclip.diagnose import measure, typical_clip_factor
from dpclip.errors import DpclipError
from dpclip.files import write_text_atomic
from dpclip.models import evaluate
from dpclip.recipe.continual import MIXING
from dpclip.rng import derived_seed, private_generator
from dpclip.train.optim import build_optimizer
from dpclip.train.mixing import (PublicSampler, check_class_names, dpmd_alpha, find_head, mix_gradients,  # noqa: F401
                                 modules_sharing, reset_states, sample_alpha)
from dpclip.planning.plan import probe_steps

class Continual:
    """The continual schedule of one run (module doc); assembled after the engine, the
    optimizer and the private step (:func:`dpclip.train.parts.assemble`)."""

    def __init__(self, recipe, *, model, loss_fn, engine, optimizer, private_step, private_data, plan,
                 gradient_noise_multiplier: float, seed: int | None):
        self.recipe = recipe
        self.config = recipe.continual
        self.schedule = self.config.schedule
        self.model, self.loss_fn, self.engine = model, loss_fn, engine
        self.optimizer, self.private_step, self.private_data = optimizer, private_step, private_data
        self.gradient_noise_multiplier, self.seed = gradient_noise_multiplier, seed
        self.public = load_public(recipe, private_data) if recipe.public is not None else None
        self.planned_private = plan.steps
        # n_priv of the sample schedule's α: the privacy units, people at the user level (whose count the
        # plan treats as public), never the records, whose count moves with one person's (docs/continual.md)
        self.private_units = plan.users if plan.users is not None else private_data.num_train
        self.probe_steps = probe_steps(recipe, plan.sample_rate)
        self.at_step = 0  # the private steps done while the public phase runs (it does not move them)
        self.phase = "public" if self.schedule in ("switch", "only-public") else \
            ("mixed" if self.schedule in MIXING else "private")
        self.public_step = 0
        self.switched = self.phase != "public"
        self.reason: str | None = None
        self.best: float | None = None
        self.bad = 0
        self.alpha = 0.0
        self.public_head: nn.Linear | None = None
        self.head = None
        if self.public is not None and self.schedule != "only-private":
            self.head, self.public_head = public_heads(recipe, model, self.public, private_data)
            batch = min(self.config.public_batch_size, self.public.num_train)
            # Unbounded: the rules draw batches too, and the phase ends by its own rule or cap.
            self.public_sampler = PublicSampler(self.public.num_train, batch, 2 ** 62, seed=seed)
            self.public_batches = iter(self.public_sampler)
        self.public_optimizer = self._public_optimizer(recipe) if not self.switched else None

    def _public_optimizer(self, recipe) -> torch.optim.Optimizer:
        """The public phase's optimizer (its state carries over at the switch, :meth:`_switch`)."""
        skip = set() if self.public_head is None else {id(p) for p in self.head[2].parameters()}
        params = [p for p in self.model.parameters() if p.requires_grad and id(p) not in skip]
        if self.public_head is not None:
            params += list(self.public_head.parameters())
        config = recipe.training.optimizer
        if self.config.public_lr is not None:
            config = config.model_copy(update={"lr": self.config.public_lr})
        return build_optimizer(config, params)

    # ----------------------------------------------------------------- what the loop asks

    def private_steps(self) -> int:
        """Private steps the run takes: the plan's, or none for only-public (ε = 0)."""
        return 0 if self.schedule == "only-public" else self.planned_private

    def info(self) -> dict[str, Any]:
        """For the start of the run (progress display, meta.json)."""
        public = self.public
        return {"schedule": self.schedule, "public_source": describe_public(self.recipe) if public else None,
                "public_train": public.num_train if public else 0, "public_validation": public.num_test if public else 0,
                "rule": self.config.switch.rule, "max_public_steps": self.config.switch.max_public_steps,
                "probe_steps": self.probe_steps, "phase": self.phase, "public_step": self.public_step}

    def record_fields(self, step: int) -> dict[str, Any]:
        """The phase fields of private step ``step``'s metrics record (the step just taken)."""
        fields = {"phase": self.phase, "alpha": self.alpha}
        if self.phase == "private" and step <= self.probe_steps and self.probe_steps:
            fields["probe"] = True
        return fields

    def step_fn(self, step: int, indices: torch.Tensor, before_update=None):
        """Private step number ``step`` (counted from 0): mixed (dpmd, sample), linear probing, or plain."""
        if self.phase == "mixed":
            self.alpha = dpmd_alpha(step, self.planned_private) if self.schedule == "dpmd" else \
                sample_alpha(self.public.num_train, self.private_units)
            public = self._public_gradient(next(self.public_batches))

            def mixed(report):
                if before_update is not None:
                    before_update(report)  # the release is checked before anything is mixed in
                mix_gradients(self.engine_params(), public, self.alpha)

            return self.private_step(indices, before_update=mixed)
        self.alpha = 0.0
        if step < self.probe_steps:
            head = {id(p) for p in self.head[2].parameters()}

            def probe(report):
                if before_update is not None:
                    before_update(report)
                for p in self.engine_params():
                    if id(p) not in head:  # the body stays as it is: only the head is probed
                        p.grad = None

            return self.private_step(indices, before_update=probe)
        return self.private_step(indices, before_update=before_update)

    def engine_params(self) -> list[torch.Tensor]:
        """The parameters the engine clips, in its order."""
        return [info.param for info in self.engine.groups.params]

    # ----------------------------------------------------------------- public steps

    @contextmanager
    def _public_model(self):
        """The model with the public head in place (when the public task has its own), and
        the engine paused: plain autograd, for public rows only."""
        if self.public_head is not None:
            parent, attribute, head = self.head
            setattr(parent, attribute, self.public_head)
        try:
            with self.engine.paused():
                yield
        finally:
            if self.public_head is not None:
                setattr(parent, attribute, head)

    def _public_backward(self, rows: torch.Tensor) -> torch.Tensor:
        """Backward of the mean loss of public ``rows`` into ``p.grad``; their losses."""
        with self._public_model():
            losses = self.loss_fn(self.model, select(self.public.train, rows))
            losses.mean().backward()
        return losses.detach()

    def _public_gradient(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """Mean plain (unclipped, un-noised) gradient of a public batch, keyed by id(param)."""
        losses = self._public_backward(rows)
        grads = {}
        for p in self.model.parameters():
            if p.grad is not None:
                grads[id(p)] = p.grad.detach().clone()
                p.grad = None
        self.last_public_loss = float(losses.mean())
        return grads

    def _public_train_step(self) -> dict[str, Any]:
        started = time.perf_counter()
        losses = self._public_backward(next(self.public_batches))
        self.public_optimizer.step()
        self.public_optimizer.zero_grad(set_to_none=True)
        self.public_step += 1
        return {"step": self.at_step, "phase": "public", "public_step": self.public_step, "alpha": 1.0,
                "lr": self.public_optimizer.param_groups[0]["lr"], "seconds": round(time.perf_counter() - started, 4),
                "public_loss": float(losses.mean())}

    def _public_metrics(self) -> dict[str, float]:
        with self._public_model():
            return evaluate(self.model, self.loss_fn, self.public.test, self.public.task,
                            batch_size=self.recipe.eval.batch_size)

    # ----------------------------------------------------------------- the switch rules

    def _rule(self) -> tuple[str | None, dict[str, Any]]:
        """(why the public phase ends now, or None; what the rule saw, for the record)."""
        rule = self.config.switch
        if rule.rule == "step":
            return (f"rule step: {rule.at_step} public steps done" if self.public_step >= rule.at_step else None), {}
        if self.public_step % rule.every_steps:
            return None, {}
        if rule.rule == "b-star":
            estimate = self._b_star()
            limit = rule.b_star_multiple * self.recipe.training.batch_size
            if estimate < limit:
                return (f"B*_DP estimate {estimate:.4g} fell below {rule.b_star_multiple:g} x batch size "
                        f"{self.recipe.training.batch_size}"), {"b_star": estimate}
            return None, {"b_star": estimate}
        metrics = self._public_metrics()
        if rule.metric not in metrics:
            raise DpclipError(f"the public validation metrics are {sorted(metrics)}: no {rule.metric!r}",
                              "set continual.switch.metric: loss")
        value = metrics[rule.metric]
        better = self.best is None or (value < self.best if rule.metric == "loss" else value > self.best)
        if better:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        seen = {"public_eval": metrics}
        if self.bad >= rule.patience:
            return (f"public validation {rule.metric} did not improve for {self.bad} evaluations (patience "
                    f"{rule.patience}; best {self.best:.4g})"), seen
        return None, seen

    def _b_star(self) -> float:
        """The public estimate of B*_DP ≈ sqrt(σ²·tr(H) / (c²·GᵀHG)) (appendix A.4), with the
        run's σ and the plug-in clipping factor c of ``typical_clip_factor`` (docs/hessian-diagnostics.md,
        "Hessian diagnostics")."""
        if not hasattr(self, "rule_generator"):
            self.rule_generator = private_generator(self.seed, "b-star-probes")
        rows = select(self.public.train, next(self.public_batches))
        try:
            with self._public_model():
                diagnostics = measure(self.model, self.loss_fn, rows, probes=self.config.switch.probes,
                                      per_sample=16, generator=self.rule_generator)
        finally:
            self.model.zero_grad(set_to_none=True)
        clipping = self.recipe.clipping
        threshold = float(self.engine.policy.sensitivity_thresholds().double().norm())
        clip = typical_clip_factor(diagnostics, clipping.fn, threshold, clipping.gamma)
        return float(diagnostics.b_star_dp(gradient_noise_multiplier=self.gradient_noise_multiplier, clip_factor=clip))

    # ----------------------------------------------------------------- the public phase

    def run_public_phase(self, interrupt, at_step: int, checkpointer, write) -> str | None:
        """Public steps until the rule fires or the cap; returns "interrupted" or None.
        ``at_step``: the private steps done (a resumed run's); ``checkpointer``: saves the run
        (:class:`dpclip.train.state.Checkpointer`); ``write``: takes each public record."""
        if self.switched:
            return None
        self.at_step = at_step
        cap = self.config.switch.max_public_steps
        self.model.train()
        while True:
            if interrupt.requested:
                return "interrupted"
            record = self._public_train_step()
            reason, seen = self._rule()
            write(record)
            if seen:
                write({"step": at_step, "phase": "public", "public_step": self.public_step, **seen})
            if reason is None and self.public_step >= cap:
                reason = f"cap of {cap} public steps reached: the {self.config.switch.rule} rule never fired"
            if reason is not None:
                write(self._switch(reason))
                checkpointer.save()
                return None
            if checkpointer.due(self.public_step):
                checkpointer.save()

    def _switch(self, reason: str) -> dict[str, Any]:
        """End the public phase: carry the optimizer state over (reset per at_switch.reset),
        re-initialise the head if asked; returns the ``switch`` record that says why."""
        at_switch = self.config.at_switch
        head = {id(p) for p in self.head[2].parameters()} if at_switch.reinit_head else set()
        private = self.optimizer
        for group in private.param_groups:
            for p in group["params"]:
                state = self.public_optimizer.state.get(p)
                if state and id(p) not in head:
                    private.state[p] = reset_states(state, at_switch.reset)
        if at_switch.reinit_head:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derived_seed(self.recipe.seed, "head-reinit"))
                self.head[2].reset_parameters()
        self.public_optimizer = None
        self.public_head = None
        self.switched, self.reason = True, reason
        self.phase = "private"
        if self.schedule == "only-public":
            reason = f"{reason}; only-public: no private step follows (ε = 0)"
        return {"kind": "switch", "step": self.at_step, "public_step": self.public_step,
                "reason": reason, "reset": list(at_switch.reset), "reinit_head": at_switch.reinit_head,
                "probe_steps": self.probe_steps}

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        state = {"phase": self.phase, "public_step": self.public_step, "switched": self.switched,
                 "reason": self.reason, "best": self.best, "bad": self.bad}
        if getattr(self, "public_sampler", None) is not None:
            state["public_sampler"] = self.public_sampler.state_dict()
        if self.public_optimizer is not None:
            state["public_optimizer"] = self.public_optimizer.state_dict()
        if self.public_head is not None:
            state["public_head"] = dict(self.public_head.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any] | None, metrics_file) -> None:
        """Continue the phase the checkpoint was in; drop public records written after it."""
        if state is None:
            raise DpclipError("the checkpoint has no continual state", "the run directory was modified: restore it")
        self.phase, self.public_step, self.switched = state["phase"], int(state["public_step"]), bool(state["switched"])
        self.reason, self.best, self.bad = state["reason"], state["best"], int(state["bad"])
        if "public_sampler" in state:
            self.public_sampler.load_state_dict(state["public_sampler"])
            self.public_batches = iter(self.public_sampler)
        if self.switched:
            self.public_optimizer, self.public_head = None, None
        else:
            self.public_optimizer.load_state_dict(state["public_optimizer"])
            if self.public_head is not None:
                self.public_head.load_state_dict(state["public_head"])
        _trim_public_records(metrics_file, self.public_step, self.switched)



def public_heads(recipe, model: nn.Module, public, private) -> tuple[Any, nn.Linear | None]:
    """(the model's head as ``find_head`` gives it, or None; the public task's own head, or None)
    once the public data is checked to fit the private data: same task and example shape, and
    classes that match or a head re-initialised at the switch (docs/continual.md). The public
    head's initial weights come from the recipe's seed (not private: they see no private row)."""
    config = recipe.continual
    at_switch, schedule = config.at_switch, config.schedule
    if public.task != private.task or tuple(public.input_shape) != tuple(private.input_shape):
        raise DpclipError(f"the public data ({public.source}: {public.task}, examples of shape "
                          f"{tuple(public.input_shape)}) does not fit the private data ({private.task}, "
                          f"{tuple(private.input_shape)})",
                          "public and private examples must have the same task and shape (images as_images, "
                          "text max_length)")
    if public.task == "causal-lm" and at_switch.reinit_head:
        raise DpclipError("a causal language model's output layer is its vocabulary: there is no head to "
                          "re-initialise", "set continual.at_switch.reinit_head: false")
    head = None
    if at_switch.reinit_head or at_switch.linear_probe_epochs:
        head = find_head(model, private.num_classes if private.task == "classification" else None)
        if at_switch.linear_probe_epochs and (tied := modules_sharing(model, head[2])):
            raise DpclipError(f"the output layer's weights are tied to module {', '.join(tied)} (as a language "
                              "model's to its input embedding): DP linear probing would train those too",
                              "set continual.at_switch.linear_probe_epochs: 0, or untie the weights")
    if public.num_classes == private.num_classes:
        check_class_names(public, private, schedule, at_switch.reinit_head)
        return head, None
    if schedule in MIXING:
        raise DpclipError(f"the public data has {public.num_classes} classes and the private data "
                          f"{private.num_classes}: a {schedule} step mixes gradients of one head",
                          "use schedule: switch with at_switch.reinit_head: true")
    if not at_switch.reinit_head:
        raise DpclipError(f"the public data has {public.num_classes} classes and the private data "
                          f"{private.num_classes}: the output layer cannot carry over",
                          "set continual.at_switch.reinit_head: true (the head is re-initialised at the "
                          "switch)")
    _, _, old = head
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derived_seed(recipe.seed, "public-head"))
        public_head = nn.Linear(old.in_features, public.num_classes, bias=old.bias is not None)
    public_head.to(old.weight.device, old.weight.dtype)
    return head, public_head

def _trim_public_records(path, public_step: int, switched: bool) -> None:
    """Public-phase records after the checkpoint are redone on resume: drop the old ones
    (they are public, so nothing is released twice; this keeps the file one run's story)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        later = record.get("public_step", 0) > public_step and record.get("phase") == "public"
        if later or (record.get("kind") == "switch" and not switched):
            continue
        kept.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def continual_run(recipe, **parts) -> Continual | None:
    """The run's continual schedule (``parts``: :class:`Continual`'s keywords), or None for a
    recipe without a continual section."""
    return Continual(recipe, **parts) if recipe.continual is not None else None
