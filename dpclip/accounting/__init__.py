"""Privacy accounting for dpclip, built on Google's ``dp_accounting``.

What is accounted: example-level differential privacy under add/remove-one-example
neighbours, for Poisson-sampled Gaussian steps; every release of a step (gradient and
auxiliary threshold statistics) shares one budget as a joint Gaussian (docs/accounting.md, joint release).
See docs/accounting.md. This package never imports torch.
"""

from dpclip.accounting.accountants import (
    ACCOUNTANTS,
    RDP_CONVERSION,
    RDP_ORDERS,
    PLD_METHOD,
    AccountingResult,
    account,
    delta_for_epsilon,
    epsilon,
    pld_discretization,
    rdp_curve,
)
from dpclip.accounting.calibrate import SIGMA_MAX, SIGMA_MIN, calibrate_noise_multiplier, epsilon_for_noise
from dpclip.accounting.events import (
    SERIALIZABLE_EVENT_TYPES,
    check_same_release,
    event_from_dict,
    event_to_dict,
    gradient_step_event,
    joint_noise_multiplier,
    same_event,
    training_event,
)
from dpclip.accounting.ledger import LEDGER_FORMAT, Ledger, LedgerEntry
from dpclip.accounting.plan import AuxSpec, PlanResult, PrivacyPlan, participations, solve, steps_for_epochs
from dpclip.accounting.split import NoiseSplit, check_aux_fits, split_noise, with_current_names
from dpclip.accounting.statement import (
    GRADIENT_RELEASE,
    SAMPLINGS,
    SHUFFLE_CAVEAT,
    PrivacyStatement,
    bound_text,
    statement_from_ledger,
)

__all__ = [
    "participations",
    # events
    "check_same_release",
    "same_event",
    "gradient_step_event",
    "joint_noise_multiplier",
    "training_event",
    "event_to_dict",
    "event_from_dict",
    "SERIALIZABLE_EVENT_TYPES",
    # accountants
    "ACCOUNTANTS",
    "RDP_ORDERS",
    "RDP_CONVERSION",
    "PLD_METHOD",
    "AccountingResult",
    "account",
    "epsilon",
    "delta_for_epsilon",
    "pld_discretization",
    "rdp_curve",
    # calibration
    "SIGMA_MIN",
    "SIGMA_MAX",
    "calibrate_noise_multiplier",
    "epsilon_for_noise",
    # budget split
    "NoiseSplit",
    "split_noise",
    "check_aux_fits",
    "with_current_names",
    # ledger
    "LEDGER_FORMAT",
    "Ledger",
    "LedgerEntry",
    # statement
    "SAMPLINGS",
    "SHUFFLE_CAVEAT",
    "GRADIENT_RELEASE",
    "PrivacyStatement",
    "bound_text",
    "statement_from_ledger",
    # plan
    "AuxSpec",
    "PrivacyPlan",
    "PlanResult",
    "solve",
    "steps_for_epochs",
]
