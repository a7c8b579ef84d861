"""Membership-inference auditing of finished runs (`dpclip audit-mia`; docs/auditing.md).

    from dpclip.audit import audit
    report = audit(run_dir, ["loss", "logistic", "lira", "one-run"], shadows=8)

Modules: attacks (model outputs, loss and logistic attacks), lira (shadow models and the
likelihood-ratio attack), rmia (the robust attack, on LiRA's shadows), one_run (canary
audit and its ε lower bound), metrics (AUC, TPR at low FPR, the DP bound), plot
(roc.png), report (the whole audit), testing (a test-only seam that under-noises the
engine).
"""

from dpclip.audit.report import ATTACKS, audit

__all__ = ["ATTACKS", "audit"]
