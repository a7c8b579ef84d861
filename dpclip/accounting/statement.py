"""The privacy statement: every ε dpclip prints comes with what it means (docs/accounting-api.md).

A bare "ε = 3" is not a claim anyone can check. The statement says the unit
(example-level), the neighbouring relation (add/remove one example), how batches were
sampled and at which rate, how many steps, δ, the accountant and its conversion, the
noise multipliers, which releases share the budget, and every caveat — in particular
that fixed-size shuffled batches are *not* covered by the Poisson analysis.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import dp_accounting

from dpclip.accounting.blt import charged_sensitivity
from dpclip.accounting.split import with_current_names
from dpclip.errors import AccountingError

if TYPE_CHECKING:  # only for annotations; avoids an import cycle with ledger
    from dpclip.accounting.ledger import Ledger

__all__ = [
    "SAMPLINGS",
    "bound_text",
    "ARITHMETIC_ASSUMPTION",
    "SHUFFLE_ASSUMPTION",
    "SHUFFLE_CAVEAT",
    "SEEDED_RANDOMNESS_WARNING",
    "GRADIENT_RELEASE",
    "PrivacyStatement",
    "distribution_line",
    "sampling_name",
    "statement_from_ledger",
]

SAMPLINGS = ("poisson", "shuffle")

#: The loud caveat for loaders that do not sample Poisson batches (a pitfall seen in peer libraries).
SHUFFLE_CAVEAT = (
    "accounting assumes Poisson sampling; the loader uses fixed-size shuffled batches, "
    "for which this ε is not a proven bound"
)

#: The caveat when the batches are the caller's own loader's (make_private(poisson_sampling=False)).
OWN_BATCHES_CAVEAT = ("accounting assumes Poisson sampling; the batches are your loader's own (their size, order and "
                      "randomness are its sampler's, not dpclip's), for which this ε is not a proven bound")

#: How a shuffled loader's batches are accounted (privacy.json's ``sampling_assumption``, tune-cost's).
SHUFFLE_ASSUMPTION = ("fixed-size shuffled batches, accounted as if Poisson-subsampled (see the caveat): the "
                      "guarantee assumes Poisson sampling")

#: The statement's first line when noise and batches were derived from a seed the user gave
#: (a recipe's, or make_private's unsafe_seed).
SEEDED_RANDOMNESS_WARNING = (
    "WARNING: this guarantee does NOT hold against anyone who holds the seed: noise and batches "
    "were derived from a seed given by the user (a recipe's seed with privacy.unsafe_seeded_randomness, "
    "or unsafe_seed= in Python), so the noise can be regenerated and subtracted and every batch is known"
)

#: What ε assumes of the arithmetic (docs/accounting.md, "Threat model"; docs/formulas.md, "Rounding of the sums").
ARITHMETIC_ASSUMPTION = ("ε assumes exact arithmetic (real-valued Gaussian noise and clipped sums); the "
                         "floating-point sampler and sums are not hardened against precision-based attacks")

#: How the gradient release is described (clipping makes its sensitivity 1 in units of σ).


def dataset_size_line(member: str) -> str:
    """The not-covered line for the number of privacy units N (docs/accounting.md, "What ε covers"):
    q = B/N is released, so N is, and add/remove neighbours differ in it by one."""
    members = "people" if member == "person" else f"{member}s"
    return (f"the number of {members} N in the private data: the sample rate q = B/N gives it exactly; treated as "
            f"public, as DP-SGD's accounting does (neighbouring data sets differ in it by one {member})")


GRADIENT_RELEASE = "gradient (sensitivity 1 after clipping)"


def sampling_name(sampling: str, bands: int = 1, blt: bool = False) -> str:
    """The written ``sampling`` field: how the batches were drawn, not the loader's setting alone.
    A correlated-noise run takes its groups in turn: "cyclic-poisson" (banded MF), "cyclic" (BLT)."""
    return "cyclic" if blt else "cyclic-poisson" if bands > 1 else sampling


def distribution_line(world_size: int, sampling: str, parallel: str = "data") -> str | None:
    """How the steps were computed across processes (docs/distributed.md), None for one process.

    Nothing here moves ε: the sharded sampler's batches are Poisson at rate q over all N
    examples, a shuffled permutation is drawn once (by rank 0) as in one process, and the
    noise is added once to the sum over ranks. Pipeline stages clip and noise their own
    parameters as the one-process ``stages`` grouping's groups (per-device clipping). A sharded
    model's ranks each noise their own rows of the sum, each coordinate once, from their own
    streams: the same Gaussian noise as one process's."""
    if world_size <= 1:
        return None
    if parallel == "pipeline":
        batches = "Poisson batches" if sampling == "poisson" else "shuffled batches"
        return (f"pipeline of {world_size} stages, one per process ({batches} drawn by rank 0; per-device "
                "clipping: each stage clips and noises its own parameters)")
    how = ("sharded Poisson sampling" if sampling == "poisson"
           else "fixed-size shuffled batches from one permutation drawn by rank 0, split over the ranks")
    if parallel == "fsdp":
        return (f"sharded (FSDP) over {world_size} processes ({how}; each rank noises its own shard of the summed "
                "gradient, every coordinate once, from its own noise stream)")
    return f"data parallel over {world_size} processes ({how}, noise drawn once by rank 0)"


def bound_text(x: float | None, digits: int = 4, upper: bool = True) -> str:
    """``x`` to ``digits`` significant digits rounded outward: up for an upper bound (a printed ε
    is never below the computed one: 7.958298 reads 7.959), down for a lower bound (an audit's
    ε ≥ ...)."""
    if x is None:
        return "n/a"
    if math.isinf(x) or math.isnan(x) or x == 0:
        return _fmt(x, digits)
    exact = Decimal(repr(float(x)))
    step = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    return f"{float(exact.quantize(step, rounding=ROUND_CEILING if upper else ROUND_FLOOR)):.{digits}g}"


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if math.isinf(x):
        return "inf"
    return f"{x:.{digits}g}"


@dataclass
class PrivacyStatement:
    """An (ε, δ) guarantee together with everything needed to interpret it.

    ``seeded_randomness``: noise and batches came from the recipe's seed; the first line
    then says the guarantee does not hold against anyone holding the recipe.
    ``not_covered``: what else the run releases outside ε (exact diagnostics), one line each.

    ``accountant`` is the accountant that produced ``epsilon``; when it is "pld",
    ``epsilon_rdp`` holds the RDP value alongside (None otherwise). ``sampling`` is how
    the loader forms batches: "poisson" (what the accountant assumes) or "shuffle"
    (fixed-size shuffled batches; adds :data:`SHUFFLE_CAVEAT`). A PLD->RDP fallback
    adds its reason to ``caveats``. ``world_size``: the processes that trained the run
    data-parallel (docs/distributed.md); above 1 it adds a ``distribution:`` line.
    """

    epsilon: float
    delta: float
    accountant: str
    conversion: str
    sample_rate: float | None
    steps: int
    noise_multiplier: float | None
    gradient_noise_multiplier: float | None = None
    sigma_aux: float | None = None
    epsilon_rdp: float | None = None
    sampling: str = "poisson"
    releases: list[str] = field(default_factory=lambda: [GRADIENT_RELEASE])
    caveats: list[str] = field(default_factory=list)
    fallback_reason: str | None = None
    unit: str = "example-level"
    neighbouring: str = "add/remove one example"
    seeded_randomness: bool = False
    not_covered: list[str] = field(default_factory=list)
    world_size: int = 1
    parallel: str = "data"   # across world_size processes: "data", "pipeline" or "fsdp"
    bands: int = 1           # banded matrix factorization's b (1: DP-SGD, independent noise)
    buffers: int = 0         # the BLT mechanism's k (0: not BLT)
    groups: int = 1          # BLT: the G groups sampled in turn
    sensitivity: float | None = None  # BLT: the whole run's sensitivity per unit clip norm
    own_batches: bool = False  # the batches are the caller's loader's (make_private(poisson_sampling=False))

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise AccountingError(
                f"unknown sampling {self.sampling!r}",
                "use 'poisson' (what the accountant assumes) or 'shuffle' (fixed-size shuffled batches)",
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise AccountingError(f"world_size must be a whole number >= 1, got {self.world_size!r}",
                                  "the number of processes that trained the run (1 without --nproc)")
        self.releases = list(self.releases)
        self.caveats = list(self.caveats)
        self.not_covered = list(self.not_covered)
        # Caveats are derived here, not left to callers, so none can be forgotten.
        if self.own_batches:
            self.caveats = [OWN_BATCHES_CAVEAT] + [c for c in self.caveats if c not in (SHUFFLE_CAVEAT, OWN_BATCHES_CAVEAT)]
        elif self.sampling == "shuffle" and SHUFFLE_CAVEAT not in self.caveats:
            self.caveats.insert(0, SHUFFLE_CAVEAT)
        if self.fallback_reason:
            fallback = f"PLD accounting was requested but RDP was used: {self.fallback_reason}"
            if fallback not in self.caveats:
                self.caveats.append(fallback)
        if self.sample_rate is not None:   # derived, like the caveats: every statement that states a q
            size = dataset_size_line("person" if self.unit.startswith("user-level") else "example")
            self.not_covered = [size] + [line for line in self.not_covered if line != size]
        if math.isinf(self.epsilon) and "no finite ε: a release without noise is not private" not in self.caveats:
            self.caveats.append("no finite ε: a release without noise is not private")

    def lines(self) -> list[str]:
        """Human-readable statement, one fact per line."""
        out = [SEEDED_RANDOMNESS_WARNING] if self.seeded_randomness else []
        out += [
            f"ε = {bound_text(self.epsilon)} at δ = {self.delta:g}",
            f"privacy unit: {self.unit}; neighbouring data sets: {self.neighbouring}"
            + (" (the cyclic groups drawn privately, independently for each)" if self.bands > 1 or self.buffers else ""),
            f"accountant: {self.accountant.upper()}: {self.conversion}",
        ]
        if self.epsilon_rdp is not None:
            out.append(f"RDP ε alongside: {bound_text(self.epsilon_rdp)}")
        sampling = "Poisson" if self.sampling == "poisson" else "fixed-size shuffled batches"
        if self.own_batches:
            sampling = "your loader's own batches, accounted as if Poisson (see the caveat)"
        elif self.buffers:   # q is the nominal rate: no step samples the whole data at q (the mechanism line)
            sampling = f"cyclic over {self.groups} groups, no amplification by sampling claimed (see mechanism)"
        elif self.bands > 1:
            sampling = f"cyclic Poisson over {self.bands} groups, each at q·b (see mechanism)"
        out.append(f"sampling: {sampling}, sample rate q = {_fmt(self.sample_rate, 6)}")
        distribution = self.distribution()
        if distribution is not None:
            out.append(f"distribution: {distribution}")
        out.append(f"steps: {self.steps}")
        member = "each person's group" if self.unit.startswith("user-level") else "each example's group"
        if self.bands > 1:
            out.append(f"mechanism: banded matrix factorization, {self.bands} bands (noise correlated across steps); "
                       f"cyclic Poisson sampling ({member} drawn privately from 0..{self.bands - 1}, step t samples group t mod "
                       f"{self.bands} at rate q·b = {_fmt(self.sample_rate * self.bands, 6)}); accounted as "
                       f"{-(-self.steps // self.bands)} participations, each PoissonSampled(q·b, Gaussian(σ)) "
                       "(amplified banded MF, Choquette-Choo et al. 2023)")
        if self.buffers:
            rate = None if self.sample_rate is None else min(1.0, self.sample_rate * self.groups)
            participations = -(-self.steps // self.groups)
            out.append(f"mechanism: BLT (buffered linear Toeplitz), {self.buffers} buffers (noise correlated across "
                       f"all steps); cyclic sampling ({member} drawn privately from 0..{self.groups - 1}, step t takes group t "
                       f"mod {self.groups} at rate {_fmt(rate, 6)}); "
                       + (f"at most {participations} participations, {self.groups} steps apart" if participations > 1
                          else "at most 1 participation") + "; no amplification by sampling is claimed: the run is one Gaussian "
                       f"mechanism of sensitivity {_fmt(self.sensitivity, 6)} per unit clip norm (worst participation "
                       f"pattern, Kalinin & Lampert 2024), {self._blt_multiplier()}, charged one participation at a time")
        out.append(f"noise multiplier (total, joint over all releases): {_fmt(self.noise_multiplier, 6)}")
        if self.sigma_aux is not None:
            out.append(f"gradient noise multiplier: {_fmt(self.gradient_noise_multiplier, 6)}")
            out.append(f"auxiliary statistic noise std: {_fmt(self.sigma_aux, 6)}")
        for release in self.releases:
            out.append(f"release sharing the budget: {release}")
        randomness = ("derived from the seed given (reproducible, NOT secret)" if self.seeded_randomness
                      else "generators' whole state from OS entropy, independent of any seed given")
        if self.own_batches:
            out.append(f"noise: {randomness}; batches: your loader's own, from its sampler")
        else:
            out.append(f"noise and batch sampling: {randomness}")
        out.append(f"arithmetic: {ARITHMETIC_ASSUMPTION}")
        for caveat in self.caveats:
            out.append(f"CAVEAT: {caveat}")
        for item in self.not_covered:
            out.append(f"not covered by ε: {item}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _blt_multiplier(self) -> str:
        """The BLT line's multiplier: σ/s, or with a statistic σ_g/s, the gradient's alone (each charge
        adds the statistic's own precision: docs/formulas.md, "BLT"; σ_eff/s is no mechanism's)."""
        if self.sigma_aux is None:
            sigma, name = self.noise_multiplier, "multiplier σ/sensitivity"
        else:
            sigma, name = self.gradient_noise_multiplier, "the gradient's multiplier σ_g/sensitivity"
        value = None if sigma is None or not self.sensitivity else sigma / self.sensitivity
        return f"{name} = {_fmt(value, 6)}" + ("" if self.sigma_aux is None else
                                                   " (each charge joint with the statistic of its step)")

    @property
    def _member(self) -> str:
        return "person" if self.unit.startswith("user-level") else "example"

    def mechanism(self) -> dict[str, Any]:
        """The noise mechanism and whether its accounting claims amplification by sampling, one key
        each: the facts of the ``mechanism:`` line (privacy.json's ``mechanism``)."""
        if self.buffers:
            return {"kind": "blt", "buffers": self.buffers, "groups": self.groups, "sensitivity": self.sensitivity,
                    "amplification_by_sampling": False}
        if self.bands > 1:
            return {"kind": "banded-mf", "bands": self.bands, "amplification_by_sampling": True}
        return {"kind": "dp-sgd", "amplification_by_sampling": True}

    def sampling_assumption(self) -> str:
        """How the batches were drawn, as the accounting assumes it (privacy.json)."""
        member = self._member
        if self.buffers:
            return (f"cyclic sampling: each {member}'s group drawn privately from {self.groups}; step t takes each "
                    f"{member} of group t mod {self.groups} with probability min(1, q·{self.groups}); no "
                    "amplification by sampling is claimed (one Gaussian mechanism over the whole run)")
        if self.bands > 1:
            return (f"cyclic Poisson sampling: each {member}'s group drawn privately from {self.bands}; step t "
                    f"includes each {member} of group t mod {self.bands} independently with probability q·{self.bands}")
        if self.own_batches:
            return "your loader's own batches, accounted as if Poisson-subsampled (see the caveat)"
        if self.sampling == "poisson":
            return (f"Poisson subsampling: each {member} joins each batch independently with probability q"
                    + (" (at most k of the person's records)" if member == "person" else ""))
        return SHUFFLE_ASSUMPTION

    def distribution(self) -> str | None:
        """The ``distribution:`` line's text (None: one process)."""
        return distribution_line(self.world_size, self.sampling, self.parallel)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (an infinite ε is written as null)."""
        d = asdict(self)
        d["sampling"] = "loader" if self.own_batches else sampling_name(self.sampling, self.bands, bool(self.buffers))
        for name in ("epsilon", "epsilon_rdp"):
            if d[name] is not None and not math.isfinite(d[name]):
                d[name] = None
        return d


def _gaussian_parameters(event: dp_accounting.DpEvent) -> tuple[float, float] | None:
    """(sample rate, noise multiplier) of a step event built by gradient_step_event, else None."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event, dp_accounting.GaussianDpEvent
    ):
        return event.sampling_probability, event.event.noise_multiplier
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return 1.0, event.noise_multiplier
    return None


def statement_from_ledger(ledger: "Ledger", sampling: str = "poisson", *, seeded_randomness: bool = False,
                          not_covered: list[str] | tuple[str, ...] = (), world_size: int = 1,
                          parallel: str = "data", bands: int = 1,
                          unit: dict[str, str] | None = None) -> PrivacyStatement:
    """The statement for what a run's ledger has spent (``dpclip account RUN_DIR``).

    ``unit``: the privacy unit's ``unit`` and ``neighbouring`` lines for a user-level run
    (:func:`dpclip.accounting.plan.user_unit`); None: example-level.

    Sample rate and noise multipliers are reported when every entry has the same ones;
    otherwise they are n/a and a caveat points to the ledger. ``world_size``: the processes
    that trained the run (meta.json's plan). Release descriptions come
    from the entries' metadata (key "releases", as written by PlanResult.step_metadata).
    """
    result = ledger.result()
    # A banded-MF run's uncharged steps are no-ops: they say nothing of its noise.
    charged = [entry for entry in ledger.entries if not isinstance(entry.event, dp_accounting.NoOpDpEvent)]
    parameters = {_gaussian_parameters(entry.event) for entry in charged}
    # A resumed run's ledger may hold entries written before the names were unified.
    metadatas = [with_current_names(entry.metadata or {}) for entry in charged]
    caveats: list[str] = []
    def common(name: str) -> Any:
        values = [m.get(name) for m in metadatas]
        return values[0] if values and all(v == values[0] for v in values) else None

    blt = {name: common(name) for name in ("buffers", "groups", "sample_rate", "sensitivity", "noise_multiplier")}
    if charged and blt["buffers"]:  # BLT: each participation's charge differs; its metadata names the mechanism
        sample_rate, noise_multiplier = blt["sample_rate"], blt["noise_multiplier"]
        blt["sensitivity"] = charged_sensitivity([(entry.event, entry.count) for entry in charged], common(
            "gradient_noise_multiplier") or noise_multiplier, common("sigma_aux"), common("aux_sensitivity"), blt["sensitivity"])
    elif len(parameters) == 1 and None not in parameters:
        sample_rate, noise_multiplier = next(iter(parameters))
        sample_rate /= bands  # a participation's event is at q·b; the statement states q
    else:
        sample_rate = noise_multiplier = None
        if charged:
            caveats.append("the ledger mixes several kinds of releases or noise levels; see its entries")

    releases: list[str] = []
    for m in metadatas:
        for release in m.get("releases", [GRADIENT_RELEASE]):
            if release not in releases:
                releases.append(release)
    return PrivacyStatement(
        epsilon=result.epsilon,
        delta=ledger.delta,
        accountant=result.accountant,
        conversion=result.conversion,
        sample_rate=sample_rate,
        steps=ledger.steps,
        noise_multiplier=noise_multiplier,
        gradient_noise_multiplier=((common("gradient_noise_multiplier") or noise_multiplier)
                                   if noise_multiplier is not None else None),
        sigma_aux=common("sigma_aux") if noise_multiplier is not None else None,
        epsilon_rdp=result.epsilon_rdp if result.accountant == "pld" else None,
        sampling=sampling,
        releases=releases or [GRADIENT_RELEASE],
        caveats=caveats,
        fallback_reason=result.fallback_reason,
        seeded_randomness=seeded_randomness,
        not_covered=list(not_covered),
        world_size=world_size,
        parallel=parallel,
        bands=bands,
        buffers=int(blt["buffers"] or 0),
        groups=int(blt["groups"] or 1),
        sensitivity=blt["sensitivity"],
        **(unit or {}),
    )

