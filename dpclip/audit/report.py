"""`dpclip audit-mia`: attack a finished run and set the empirical leakage beside its ledger.

    report = audit(Path("runs/quickstart-..."), attacks=["loss", "logistic", "one-run"])

Members and non-members are rebuilt from the run directory alone: the recipe reloads the
data with the run's seed, and the split's fingerprint must match the one in meta.json.
The model is loaded from safetensors (never a pickle), the ε and δ to compare with come
from the checkpoint's own ledger state, and the audit writes only under ``RUN/audit/``:
``report.json``, ``roc.png``, ``one_run_audits.jsonl`` (the checkpoints one-run audits read) and, for
LiRA and RMIA, ``shadows/``. ledger.json is never written.

Length: one audit read top to bottom (the pool, each attack's call, the notes its reader needs).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dpclip import layout
from dpclip.accounting import Ledger, bound_text
from dpclip.accounting.statement import SEEDED_RANDOMNESS_WARNING, SHUFFLE_CAVEAT
from dpclip.audit.attacks import Outputs, check_pool, logistic_attack, loss_attack, model_outputs
from dpclip.audit.exposure import exposure_audit
from dpclip.audit.lira import lira_scores, realised_plan, shadow_confidences, target_plan, train_shadows
from dpclip.audit.metrics import attack_metrics, dp_tpr_bound
from dpclip.audit.one_run import check_confidence, one_run_audit, one_run_verdict
from dpclip.audit.plot import plot_roc
from dpclip.audit.rmia import DEFAULT_GAMMA, DEFAULT_OFFLINE_A, label_probability, rmia_scores
from dpclip.data import load_data
from dpclip.data.canaries import make_canaries, missing_answer_key, read_canary_secret
from dpclip.data.exposure import stored_exposure
from dpclip.errors import DpclipError
from dpclip.files import append_line, private_dir, read_jsonl, write_json_atomic
from dpclip.models import build_model
from dpclip.rundir.checkpoint import latest_checkpoint, load_checkpoint, missing_checkpoint_hint
from dpclip.train.parts import canary_records, stored_split_key
from dpclip.rundir.run import check_ledger, load_run_recipe, planned_step
from dpclip.rundir.searchdir import headline

ATTACKS = ("loss", "logistic", "lira", "rmia", "one-run", "exposure")
CANARY_HINT = ("add canaries to the recipe and train again, e.g. `audit: {canaries: {count: 200, kind: ood}}` "
               "(or the override audit.canaries.count=200); each canary goes in with probability 1/2")


@dataclass
class Pool:
    """Members (the run's training rows) followed by non-members (its held-out rows)."""

    data: Any                          # the run's PrivateData
    tensors: dict[str, torch.Tensor]   # train rows, then test rows
    is_member: np.ndarray              # int [n]: 1 for the first num_train rows
    attacked: np.ndarray               # bool [n]: rows the attacks score (mislabel-canary sources left out)

    @property
    def size(self) -> int:
        return len(self.is_member)

    @property
    def people(self) -> np.ndarray | None:
        """Person index 0..P-1 of each row (train rows' people, then the held-out ones), or
        None for data without users."""
        if self.data.train_users is None:
            return None
        ids = torch.cat([self.data.train_users, self.data.test_users]).numpy()
        return np.unique(ids, return_inverse=True)[1]


def resolve_target(path: Path) -> tuple[Path, Path]:
    """(run_dir, checkpoint_dir) from a run directory or one of its checkpoint directories."""
    path = Path(path)
    if (path / layout.MODEL_WEIGHTS).exists() and path.parent.name == layout.CHECKPOINTS:
        return path.parent.parent, path
    if (path / layout.RECIPE).exists():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise DpclipError(f"{path} has no checkpoint to attack", missing_checkpoint_hint(path))
        return path, checkpoint
    raise DpclipError(f"{path} is neither a run directory nor a checkpoint directory",
                      "pass the folder `dpclip train` created under runs/, or one of its checkpoints/step_NNNNNN")


def build_pool(run_dir: Path, recipe) -> Pool:
    try:
        meta = json.loads((run_dir / layout.META).read_text(encoding="utf-8"))
        fingerprint = meta["data"]["split_fingerprint"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise DpclipError(f"{run_dir / layout.META} is missing or damaged ({type(exc).__name__}): without it the "
                          "members and non-members cannot be rebuilt", "restore it from a backup of the run "
                          "directory (dpclip train writes it once, at the start)") from None
    key = stored_split_key(run_dir)   # the run's private split key (None: its recipe's seed drew the split)
    data = load_data(recipe.data, seed=recipe.seed, split_key=key)
    if data.fingerprint != fingerprint:
        shadow = run_dir.parent.name == layout.SHADOWS   # a shadow trained on the subset LiRA handed it
        raise DpclipError(f"the data of {run_dir} no longer splits as it did in training",
                          f"it is one of LiRA's shadow models: audit the run it imitates, {run_dir.parent.parent.parent}"
                          if shadow else "the data files changed since the run; the members cannot be rebuilt")
    tensors = {name: torch.cat([data.train[name], data.test[name]]) for name in data.train}
    is_member = np.r_[np.ones(data.num_train, dtype=int), np.zeros(data.num_test, dtype=int)]
    attacked = np.ones(len(is_member), dtype=bool)
    attacked[data.num_train + canary_sources(run_dir, recipe, data.num_test)] = False
    return Pool(data, tensors, is_member, attacked)


def canary_sources(run_dir: Path, recipe, num_test: int) -> np.ndarray:
    """The held-out rows the run trained on as mislabel canaries (its answer key's ``sources``):
    they are left out of the non-members. With the answer key deleted on a mislabel run they are
    unknown, and the audit is refused rather than score them as non-members."""
    secret = read_canary_secret(run_dir)   # checked: sources are None or ints ≥ 0
    canaries = recipe.audit.canaries
    if secret is None:
        if canaries is not None and canaries.kind == "mislabel":
            raise missing_answer_key(run_dir, "the held-out rows the run trained on as mislabel canaries are "
                                     "unknown and would be scored as non-members")
        return np.zeros(0, dtype=int)
    sources = np.asarray([s for s in secret["sources"] if s is not None], dtype=int)
    if (canaries is not None and secret["kind"] != canaries.kind) or (sources >= num_test).any():
        raise DpclipError(f"{layout.canaries_file(run_dir)} does not match the run's recipe and data (its kind or "
                          "its held-out rows)", "it belongs to another run or was damaged: restore it from a "
                          "backup of the run directory")
    return sources


def _ledger_at(run_dir: Path, recipe, checkpoint: Path, state: dict) -> tuple[float, float]:
    """(ε, δ) of the checkpoint's ledger, after checking it is this run's ledger at its step."""
    ledger = Ledger.from_dict(state["ledger"])
    solved, _ = planned_step(run_dir, recipe)
    check_ledger(ledger, solved, int(state["step"]), where=checkpoint / layout.STATE)
    return (ledger.epsilon() if ledger.steps else 0.0), ledger.delta


def _charge_search(run_dir: Path, report: dict[str, Any]) -> None:
    """A run selected by a tuning search costs what the whole search spent: set that (ε, δ) beside
    the measured leakage, not the run's own (smaller) ε. The δ is the search statement's too: an ε
    holds at its own δ only, and the one-run bound and the TPR bound are computed at it."""
    found = headline(run_dir)
    if found.search_dir is None:
        return
    ledger = report["ledger"]
    ledger["epsilon_this_run_alone"], ledger["delta_this_run_alone"] = ledger["epsilon"], ledger["delta"]
    ledger["epsilon"], ledger["delta"] = found.epsilon, found.delta
    ledger["search_dir"] = str(found.search_dir)
    report["notes"].append(f"this run was selected by the tuning search {found.search_dir}: its ε is the search's "
                           f"({bound_text(found.epsilon)} at δ = {found.delta:g}); the run's own ledger alone "
                           "understates it")


def _ledger_caveats(recipe) -> list[str]:
    """The run statement's caveats on the ledger's ε the audit sets beside its figures: a shuffled
    loader's ε is not a proven bound, a seeded run's none against the seed's holder."""
    notes = [f"the ledger's ε: {SHUFFLE_CAVEAT}"] if recipe.training.sampling == "shuffle" else []
    return notes + ([SEEDED_RANDOMNESS_WARNING] if recipe.privacy.unsafe_seeded_randomness else [])


def _one_run(run_dir: Path, recipe, pool: Pool, model, loss_fn, delta: float, confidence: float) -> dict:
    secret = read_canary_secret(run_dir)
    if recipe.audit.canaries is None:
        raise DpclipError(f"{run_dir} was trained without canaries, so the one-run audit has nothing to guess",
                          CANARY_HINT)
    if secret is None:
        raise missing_answer_key(run_dir, "the one-run audit cannot check its guesses")
    canaries = make_canaries(pool.data, recipe.audit.canaries, secret["seed"], records=canary_records(recipe))
    check_rebuilt_canaries(run_dir, canaries, secret)
    outputs = model_outputs(model, loss_fn, canaries.tensors, pool.data.task)
    # Score = −loss on the canary's own (wrong or random) label, a canary person's the mean over their records
    scores = -outputs.losses.reshape(canaries.count, canaries.records).mean(axis=1)
    result = one_run_audit(scores, np.asarray(secret["included"], dtype=bool), delta, confidence)  # checked bools
    result["kind"] = secret["kind"]
    return result


def check_rebuilt_canaries(run_dir: Path, canaries, secret: dict) -> None:
    """The canaries rebuilt from the answer key's seed are those the run trained with: the same
    tensors (their fingerprint) and the same inclusion bits, which the seed draws with them."""
    if canaries.fingerprint() != secret["fingerprint"]:
        raise DpclipError("the canaries rebuilt from the recipe differ from those the run trained with",
                          "the data or the recipe changed since training; the one-run audit cannot be done")
    if [bool(b) for b in canaries.included] != secret["included"]:
        raise DpclipError(f"{layout.canaries_file(run_dir)} holds inclusion bits that its seed did not draw: the "
                          "guesses would be checked against bits the run never trained with",
                          "it was edited or damaged: restore it from a backup of the run directory")


def _exposure(run_dir: Path, recipe, pool: Pool, model, loss_fn, seed: int) -> dict:
    if recipe.audit.exposure is None:
        raise DpclipError(f"{run_dir} was trained without planted secrets, so there is no exposure to measure",
                          "add audit: {exposure: {repetitions: [1, 4, 16]}} to a causal-LM recipe and train again")
    exposure = stored_exposure(run_dir, recipe.audit.exposure)
    return exposure_audit(model, loss_fn, exposure, pool.data.tokenizer, pool.data.input_shape[0],
                          recipe.audit.exposure.candidates, seed)


def audit(target: Path, attacks: list[str], *, shadows: int = 8, seed: int = 0, bootstrap: int = 200,
          confidence: float = 0.95, shadow_observer: Callable[[int, int], Any] | None = None,
          write: bool = True) -> dict:
    """Run ``attacks`` against the run or checkpoint ``target``; return (and write) the report."""
    check_confidence(confidence)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise DpclipError(f"unknown attack {unknown[0]!r}",
                          "use loss, logistic, lira, rmia, one-run, exposure or all")
    run_dir, checkpoint = resolve_target(target)
    recipe = load_run_recipe(run_dir)
    pool = build_pool(run_dir, recipe)
    model, loss_fn = build_model(recipe.model, pool.data, seed=recipe.seed)
    state = load_checkpoint(checkpoint, model)
    epsilon, delta = _ledger_at(run_dir, recipe, checkpoint, state)   # a search's replace them (_charge_search)

    report: dict[str, Any] = {
        "not_covered_by_epsilon": "every figure here is measured on private data (docs/accounting.md)",
        "run_dir": str(run_dir), "checkpoint": checkpoint.name, "step": int(state["step"]),
        "ledger": {"epsilon": epsilon, "delta": delta},
        "created": datetime.now().isoformat(timespec="seconds"), "attacks": {}, "notes": [],
    }
    _charge_search(run_dir, report)
    report["notes"] += _ledger_caveats(recipe)
    outputs = model_outputs(model, loss_fn, pool.tensors, pool.data.task)
    attacked = pool.attacked
    members = pool.is_member[attacked]

    scored = Outputs(outputs.losses[attacked], None if outputs.logits is None else outputs.logits[attacked],
                     outputs.confidence[attacked])
    if recipe.privacy.unit == "user":
        scored, members = per_person(scored, members, pool.people[attacked])
        report["unit"] = "user"
        report["notes"].append(f"user-level: a member is a person ({int(members.sum())} of the training set, "
                               f"{int((members == 0).sum())} held out); each person's score is the mean over their records")
    check_pool(members, attacks, "people" if recipe.privacy.unit == "user" else "rows")
    for name in attacks:
        if name == "loss":
            report["attacks"]["loss"] = loss_attack(scored, members, bootstrap=bootstrap, seed=seed)
        elif name == "logistic":
            report["attacks"]["logistic"] = logistic_attack(scored, members, bootstrap=bootstrap, seed=seed)
        elif name == "lira":
            attacks_lira, report["lira_shadows"] = _lira(run_dir, recipe, pool, outputs.confidence, shadows, seed,
                                                         bootstrap, shadow_observer)
            report["attacks"].update(attacks_lira)
            _note_shadow_steps(report, "LiRA")
        elif name == "rmia":
            attacks_rmia, report["lira_shadows"] = _rmia(run_dir, recipe, pool, outputs.confidence, shadows, seed,
                                                         bootstrap, shadow_observer)
            report["attacks"].update(attacks_rmia)
            _note_shadow_steps(report, "RMIA")
        elif name == "one-run":
            report["one_run"] = _one_run(run_dir, recipe, pool, model, loss_fn, report["ledger"]["delta"],
                                         confidence)
        elif name == "exposure":
            report["exposure"] = _exposure(run_dir, recipe, pool, model, loss_fn, seed)
    small = [r["non_members"] for r in report["attacks"].values() if r["non_members"] < 1000]
    if small:
        report["notes"].append(f"only {min(small)} non-members are scored: an FPR below 1/{min(small)} cannot be "
                               "measured, so 'TPR at 0.1% FPR' is the TPR at FPR = 0 (a conservative reading)")
    if "one_run" in report:
        _note_earlier_one_run(run_dir, report)
        report["flagged"], note = one_run_verdict(report["one_run"], report["ledger"]["epsilon"])
        report["notes"] += [note] if note else []
    # What the ledger's (ε, δ) allows any attack, for the tables of audit-mia and `dpclip report`.
    report["ledger"]["tpr_bound"] = {"fpr_0.1%": dp_bound_at(report, 0.001), "fpr_1%": dp_bound_at(report, 0.01)}
    if write:
        folder = layout.audit_dir(run_dir)
        private_dir(folder)
        write_json_atomic(folder / layout.AUDIT_REPORT, report)
        if "one_run" in report:   # the record the multiple-testing note reads, whatever later audits overwrite
            append_line(folder / layout.ONE_RUN_LOG, json.dumps({"checkpoint": report["checkpoint"],
                                                                  "confidence": report["one_run"]["confidence"]}))
        if report["attacks"]:
            plot_roc(report, folder / layout.ROC_PLOT)
        else:   # an earlier audit's curves do not belong beside this report
            (folder / layout.ROC_PLOT).unlink(missing_ok=True)
    return report


def _note_earlier_one_run(run_dir: Path, report: dict) -> None:
    """A note when one-run audits of other checkpoints of the run came before (audit/one_run_audits.jsonl,
    which every one-run audit appends to, and the last report.json for audits made before that log):
    several checkpoints audited and the worst read is multiple testing."""
    folder = layout.audit_dir(run_dir)
    earlier = {record.get("checkpoint") for record in read_jsonl(folder / layout.ONE_RUN_LOG)}
    try:
        last = json.loads((folder / layout.AUDIT_REPORT).read_text(encoding="utf-8"))
        if last.get("one_run"):
            earlier.add(last["checkpoint"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        pass   # no earlier report, or none readable: the log alone
    others = sorted(c for c in earlier if isinstance(c, str) and c != report["checkpoint"])
    if others:
        alpha = 1 - report["one_run"]["confidence"]
        report["notes"].append(f"the run's earlier one-run audits: {', '.join(others)}: auditing several "
                               f"checkpoints of one run is multiple testing (the {alpha:.2g} chance of a false "
                               f"flag is per audit); audit n checkpoints each with --confidence 1 − {alpha:.2g}/n "
                               f"(n = {len(others) + 1} so far)")


def per_person(scored: Outputs, members: np.ndarray, people: np.ndarray) -> tuple[Outputs, np.ndarray]:
    """The attack's view at the user level (docs/users.md): one score per person, the mean
    loss, confidence and logits over their scored records (``people``: the person index of
    each scored row); a member is a person of the training set."""
    ids, inverse = np.unique(people, return_inverse=True)
    logits = None if scored.logits is None else np.stack([person_mean(column, inverse) for column in scored.logits.T],
                                                         axis=1)
    person_members = np.zeros(len(ids), dtype=int)
    person_members[inverse[members == 1]] = 1
    return Outputs(person_mean(scored.losses, inverse), logits, person_mean(scored.confidence, inverse)), person_members


def person_mean(values: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    """Mean of ``values`` [..., rows] over each person's rows (``inverse``: person of each row)."""
    counts = np.bincount(inverse)
    if values.ndim == 1:
        return np.bincount(inverse, weights=values) / counts
    return np.stack([np.bincount(inverse, weights=row) / counts for row in values])


def _lira(run_dir, recipe, pool: Pool, target_confidence, shadows: int, seed: int, bootstrap: int,
          observer_for) -> tuple[dict, dict]:
    """(the two LiRA results, what the shadows imitated and what each one actually trained with).

    At the user level a shadow trains on a random half of the people with all their records,
    and each person is scored once: the Gaussians are fitted to, and the target scored on, the
    mean φ over the person's scored records (docs/users.md)."""
    if shadows < 2:   # each example is in ⌊M/2⌋ shadows: one shadow would train on nothing
        raise DpclipError(f"LiRA needs at least two shadow models, got {shadows}",
                          "pass --shadows N (16 or more for a strong attack)")
    keep, dirs = train_shadows(run_dir, recipe, pool, shadows, seed, observer_for)
    attacked = pool.attacked
    shadow_values = shadow_confidences(dirs, pool)
    if recipe.privacy.unit == "user":
        people = pool.people[attacked]
        inverse = np.unique(people, return_inverse=True)[1]
        target = person_mean(target_confidence[attacked], inverse)
        scores = lira_scores(target, person_mean(shadow_values[:, attacked], inverse),
                             keep[:, np.unique(people)])   # the people with a scored record, in that order
        members = (np.bincount(inverse, weights=pool.is_member[attacked], minlength=len(target)) > 0).astype(int)
    else:
        scores = {variant: values[attacked]
                  for variant, values in lira_scores(target_confidence, shadow_values, keep).items()}
        members = pool.is_member[attacked]
    out = {}
    for variant, values in scores.items():
        result = attack_metrics(members, values, bootstrap=bootstrap, seed=seed)
        result["shadows"] = shadows
        out[f"lira-{variant}"] = result
    imitation = {"target": target_plan(run_dir), "shadows": [realised_plan(d) for d in dirs]}
    return out, imitation


def _note_shadow_steps(report: dict, attack: str) -> None:
    trained_steps = report["lira_shadows"]["target"]["steps"]
    if report["step"] != trained_steps:
        report["notes"].append(f"the shadow models imitate the whole run ({trained_steps} steps), but the "
                               f"audited checkpoint is at step {report['step']}: {attack} compares it with "
                               "models trained longer than it was")


def _rmia(run_dir, recipe, pool: Pool, target_confidence, shadows: int, seed: int, bootstrap: int,
          observer_for) -> tuple[dict, dict]:
    """(the two RMIA results, the shadows' imitation record as for LiRA).

    The reference models are LiRA's shadows (trained here only if no LiRA audit left them);
    the population is the scored non-members. At the user level Pr(x|θ) of a person is the
    mean of their scored records' probabilities, and people are the unit of keep and of the
    population."""
    if shadows < 2:   # LiRA's shadows: each example is in ⌊M/2⌋ of them, so one shadow would train on nothing
        raise DpclipError(f"RMIA needs at least two reference (shadow) models, got {shadows}",
                          "pass --shadows N (2 or more)")
    keep, dirs = train_shadows(run_dir, recipe, pool, shadows, seed, observer_for)
    attacked = pool.attacked
    task = pool.data.task
    target = label_probability(target_confidence[attacked], task)
    references = label_probability(shadow_confidences(dirs, pool)[:, attacked], task)
    members = pool.is_member[attacked]
    if recipe.privacy.unit == "user":
        people = pool.people[attacked]
        inverse = np.unique(people, return_inverse=True)[1]
        target, references = person_mean(target, inverse), person_mean(references, inverse)
        keep = keep[:, np.unique(people)]   # the people with a scored record, in that order
        members = (np.bincount(inverse, weights=members, minlength=len(target)) > 0).astype(int)
    else:
        keep = keep[:, attacked]
    out = {}
    for variant, values in rmia_scores(target, references, keep, members == 0).items():
        result = attack_metrics(members, values, bootstrap=bootstrap, seed=seed)
        result.update(shadows=shadows, population=int((members == 0).sum()), gamma=DEFAULT_GAMMA,
                      offline_a=DEFAULT_OFFLINE_A)
        out[f"rmia-{variant}"] = result
    imitation = {"target": target_plan(run_dir), "shadows": [realised_plan(d) for d in dirs]}
    return out, imitation


def summary_rows(report: dict) -> list[dict]:
    """One row per attack for the table: name, AUC (CI), TPR@0.1%, TPR@1%, advantage."""
    return [{"attack": name, "auc": r["auc"], "auc_ci95": r["auc_ci95"], "null_std": r["auc_null_std"],
             "tpr_0.1": r["tpr_at_0.1%_fpr"], "tpr_1": r["tpr_at_1%_fpr"], "balanced_accuracy": r["balanced_accuracy"],
             "advantage": r["advantage"]} for name, r in report["attacks"].items()]


def dp_bound_at(report: dict, fpr: float) -> float:
    """The TPR the ledger's (ε, δ) allows at ``fpr``."""
    ledger = report["ledger"]
    if not math.isfinite(ledger["epsilon"]):
        return 1.0
    return float(dp_tpr_bound(np.array([fpr]), ledger["epsilon"], ledger["delta"])[0])
