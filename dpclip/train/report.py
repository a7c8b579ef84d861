"""`dpclip report RUN_DIR`: a run's summary and one self-contained HTML page with every
plot of the run and its privacy statement (docs/cli.md, "report"; docs/training.md,
"Plots and logging").

The page is built from the run directory alone. ε, δ and the statement are the run's
headline (:func:`dpclip.rundir.searchdir.headline`, as ``dpclip account RUN_DIR``): its
ledger.json checked against the plan re-solved from its recipe, or for a run a
``tune-cost --run`` search selected, the search's ledger (the run's own ε is shown beside it); the held-out metrics and the audit's results are exact,
computed on private data, and are labelled "not covered by ε" wherever they appear.
Plots missing from the run (a run that stopped before its end drew them) are drawn in
memory from metrics.jsonl; the run directory itself is never written, except the page
when ``--out`` is not given (``RUN_DIR/report.html``).
"""

from __future__ import annotations

import base64
import html
import io
from datetime import datetime
from pathlib import Path
from typing import Any

from dpclip import layout
from dpclip.accounting import bound_text
from dpclip.errors import DpclipError
from dpclip.files import read_json, write_text_atomic
from dpclip.train.plots import (THRESHOLDS_PLOT, TRAINING_PLOT, read_metrics, threshold_rows, thresholds_figure,
                                training_figure)
from dpclip.rundir.run import UNFINISHED, RunDir, planned_step
from dpclip.rundir.searchdir import headline

REPORT_FILE = layout.REPORT
NOT_COVERED = "not covered by ε"
#: Beside the f-DP ε lower bound (as dpclip.audit.one_run.FDP_CONDITION, which this layer cannot import).
FDP_CONDITION = "a lower bound only if the trade-off curve is Gaussian; the Steinke bound assumes nothing"


def run_summary(run_dir: Path) -> dict[str, Any]:
    """What `dpclip report` prints: steps, ε, δ, accountant, why the run stopped, the final
    held-out metrics (labelled not covered by ε) and the privacy statement."""
    run = RunDir(Path(run_dir).expanduser().resolve())
    if not run.path.is_dir():
        raise DpclipError(f"{run.path} is not a folder", "pass a run directory, e.g. runs/quickstart-20261121-101500")
    recipe = run.recipe()  # error + hint when the folder is not a run
    found = headline(run.path)
    ledger = found.run_ledger
    _, planned = planned_step(run.path, recipe)
    summary = run.summary() if run.summary_file.exists() else {}
    records = read_metrics(run.metrics_file)
    final_eval = summary.get("final_eval") or next((r["eval"] for r in reversed(records) if "eval" in r), {})
    if not isinstance(final_eval, dict) or not all(isinstance(k, str) and _number(v) for k, v in final_eval.items()):
        raise DpclipError(f"the final held-out metrics in {run.summary_file} (or {run.metrics_file}) are not "
                          "named numbers: the file is damaged", "restore it from a backup of the run directory "
                          "(or delete summary.json: the run then reads as unfinished)")
    return {
        "run_dir": str(run.path), "name": recipe.name, "steps_done": ledger.steps, "steps_planned": planned,
        # The headline: for a run a search selected, the search's ε (everything released with the run).
        "epsilon": found.epsilon, **({"delta": recipe.privacy.delta, "accountant": recipe.privacy.accountant}
                                     if found.search_dir is None else
                                     {"delta": found.delta, "accountant": found.statement.accountant}),
        "epsilon_cap": recipe.privacy.epsilon,
        "selected_by_search": found.selected_by(),
        "stopped": _stopped(run, ledger.steps),
        "final_eval": final_eval, "not_covered_by_epsilon": ["final_eval"] if final_eval else [],
        "statement": found.statement.lines(),
    }


def _stopped(run: RunDir, steps_done: int) -> str:
    stopped = run.stopped(steps_done)
    return stopped if stopped != UNFINISHED else \
        f"{UNFINISHED} (no summary.json of its last step): resume with dpclip train --resume RUN_DIR"


def _png(figure) -> bytes:
    import matplotlib.pyplot as plt  # loaded already by the figure's maker

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def run_plots(run_dir: Path, selected_by: dict[str, Any] | None = None) -> list[tuple[str, str, bytes]]:
    """(title, caption, PNG bytes) of every plot of a run: training.png, thresholds.png (drawn
    in memory when the run has none) and the audit's PNGs if it has an audit/ folder.
    ``selected_by``: the search that selected the run (its ε curve is then the run's own alone)."""
    run = RunDir(run_dir)
    records = read_metrics(run.metrics_file)
    plots = []
    training = run.path / TRAINING_PLOT
    if training.exists():
        data = training.read_bytes()
    elif any("eval" not in r for r in records):
        recipe = run.recipe()
        data = _png(training_figure(records, epsilon_cap=recipe.privacy.epsilon, delta=recipe.privacy.delta))
    else:
        data = None
    if data is not None:
        spent_caption = "ε spent (charged in the ledger)" if selected_by is None else (
            f"ε of this run's own training alone; publishing it costs the search's ε = "
            f"{bound_text(selected_by['epsilon'])}")
        plots.append(("training", f"{spent_caption}; the loss and held-out metrics are exact "
                      f"diagnostics, {NOT_COVERED}", data))
    thresholds = run.path / THRESHOLDS_PLOT
    steps, rows = threshold_rows(records)
    if thresholds.exists():
        data = thresholds.read_bytes()
    elif steps:
        groups = run.public_plan().get("groups") or []
        data = _png(thresholds_figure(steps, rows, groups, policy=run.recipe().clipping.threshold.kind))
    else:
        data = None
    if data is not None:
        plots.append(("thresholds", "clipping thresholds per group (released, charged in the ledger)", data))
    audit = layout.audit_dir(run.path)
    if audit.is_dir():
        for path in sorted(audit.glob("*.png")):
            plots.append((f"audit: {path.stem}", "membership-inference attacks on the trained model, measured on "
                          f"private data, {NOT_COVERED}; dashed: the bound the ledger's (ε, δ) puts on them",
                          path.read_bytes()))
    return plots


def _audit(run_dir: Path) -> dict[str, Any] | None:
    """The run's audit/report.json (dpclip audit-mia), or None when it has none; one that
    cannot be read or is not of the shape audit-mia writes is an error (:func:`audit_report_problem`)."""
    path = layout.audit_dir(run_dir) / layout.AUDIT_REPORT
    if not path.exists():
        return None
    try:
        report = read_json(path)
        problem = audit_report_problem(report)
    except (OSError, ValueError) as exc:   # a folder, unreadable bytes, not JSON
        problem = type(exc).__name__
    if problem is not None:
        raise DpclipError(f"{path} is damaged ({problem}): the audit's results cannot be shown",
                          f"write it again with dpclip audit-mia {run_dir}, or move it away to report without "
                          "the audit")
    return report


def _number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def audit_report_problem(report: Any) -> str | None:
    """What in an audit report keeps the page from showing it (a field of the wrong type), or None."""
    if not isinstance(report, dict):
        return f"a {type(report).__name__}, not a mapping"
    parts = {key: report.get(key) for key in ("ledger", "attacks", "one_run", "exposure")}
    wrong = [key for key, part in parts.items() if part is not None and not isinstance(part, dict)]
    if wrong:
        return f"{wrong[0]} is not a mapping"
    ledger, attacks, one_run, exposure = (part or {} for part in parts.values())
    if not _number(ledger.get("epsilon")) or not isinstance(ledger.get("tpr_bound") or {}, dict):
        return "ledger's epsilon or tpr_bound is of the wrong type"
    if not all(isinstance(r, dict) and isinstance(r.get("auc_ci95") or [], list) for r in attacks.values()):
        return "an attack's result is not a mapping with an auc_ci95 list"
    fdp = one_run.get("fdp") or {}
    if not (isinstance(fdp, dict) and _number(one_run.get("epsilon_lower_bound")) and
            _number(fdp.get("mu_lower_bound")) and _number(fdp.get("epsilon_lower_bound")) and
            _number(one_run.get("confidence"))):
        return "one_run's bounds are not numbers"
    if not (isinstance(exposure.get("planted", []), list) and all(isinstance(r, dict) for r in exposure.get("planted", []))
            and isinstance(exposure.get("controls", {}), dict)):
        return "exposure's planted or controls is of the wrong type"
    notes = report.get("notes") or []
    if not (isinstance(notes, list) and all(isinstance(note, str) for note in notes)):
        return "notes is not a list of text"
    return _figures_problem(ledger, attacks, one_run, exposure)


#: The figures of each part of an audit report that the page shows as numbers.
_ATTACK_FIGURES = ("auc", "tpr_at_0.1%_fpr", "tpr_at_1%_fpr", "members", "non_members")
_ONE_RUN_FIGURES = ("canaries", "correct", "guesses")


def _figures_problem(ledger: dict, attacks: dict, one_run: dict, exposure: dict) -> str | None:
    """Which figure the page would show is not a number (or absent), or None: a report.json that
    travels with a run is data, and text in a figure's place is damage (or markup), not a figure."""
    for name, result in attacks.items():
        if not all(_number(result.get(key)) for key in _ATTACK_FIGURES) or \
                not all(_number(value) for value in result.get("auc_ci95") or []):
            return f"a figure of the attack {name!r} is not a number"
    if not all(_number(value) for value in (ledger.get("tpr_bound") or {}).values()):
        return "the ledger's tpr_bound is not a number"
    fdp = one_run.get("fdp") or {}
    if not all(_number(one_run.get(key)) and _number(fdp.get(key) if key != "canaries" else None)
               for key in _ONE_RUN_FIGURES):
        return "one_run's guess counts are not numbers"
    controls = exposure.get("controls") or {}
    figures = [exposure.get("max_exposure"), exposure.get("chance"), controls.get("count"),
               controls.get("mean_exposure")]
    figures += [row.get(key) for row in exposure.get("planted") or [] for key in ("exposure", "repetitions")]
    if not all(_number(value) for value in figures):
        return "an exposure figure is not a number"
    return None


def _audit_html(report: dict[str, Any]) -> list[str]:
    """The attacks compared on one run: a row per attack, the ledger's bound under them, the
    one-run audits' ε lower bounds beside the ledger's ε, and the canary exposure."""
    e = html.escape

    def n(value: Any) -> str:   # a figure, escaped: the shape check vouches for numbers, this for the rest
        return e(_fmt(value))

    ledger = report.get("ledger", {})
    out = [f'<h2>Membership-inference audit <span class="nc">({NOT_COVERED})</span></h2>',
           f"<p>{e(str(report.get('checkpoint', '')))}, step {e(_fmt(report.get('step')))}; the ledger's "
           f"ε = {e(bound_text(ledger.get('epsilon')))} at δ = {e(_fmt(ledger.get('delta')))}</p>"]
    attacks = report.get("attacks", {})
    if attacks:
        out.append("<table><tr><th>attack</th><th>AUC [95% CI]</th><th>TPR at 0.1% FPR</th><th>TPR at 1% FPR</th>"
                   "<th>members / non-members</th></tr>")
        for name, r in attacks.items():
            low, high = (r.get("auc_ci95") or [None, None])[:2]
            ci = f" [{n(low)}, {n(high)}]" if low is not None else ""
            out.append(f"<tr><td>{e(name)}</td><td>{n(r.get('auc'))}{ci}</td>"
                       f"<td>{n(r.get('tpr_at_0.1%_fpr'))}</td><td>{n(r.get('tpr_at_1%_fpr'))}</td>"
                       f"<td>{e(_fmt(r.get('members')))} / {e(_fmt(r.get('non_members')))}</td></tr>")
        bound = ledger.get("tpr_bound")
        if bound:
            out.append(f"<tr><td><i>what the ledger allows</i></td><td></td><td>≤ {n(bound.get('fpr_0.1%'))}</td>"
                       f"<td>≤ {n(bound.get('fpr_1%'))}</td><td></td></tr>")
        out.append("</table>")
    one_run = report.get("one_run")
    if one_run:
        items = [f"Steinke et al. (any trade-off curve): {one_run.get('correct')}/{one_run.get('guesses')} right → "
                 f"ε ≥ {bound_text(one_run.get('epsilon_lower_bound'), upper=False)}"]
        fdp = one_run.get("fdp")
        if fdp:
            items.append(f"f-DP, Gaussian curve: {fdp.get('correct')}/{fdp.get('guesses')} right → μ ≥ "
                         f"{bound_text(fdp.get('mu_lower_bound'), upper=False)}, "
                         f"ε ≥ {bound_text(fdp.get('epsilon_lower_bound'), upper=False)} ({FDP_CONDITION})")
        level = one_run.get("confidence") or 0.95
        bound, epsilon = one_run.get("epsilon_lower_bound"), ledger.get("epsilon")
        # the verdict follows the figures shown (a report without "flagged", or one that lost it, is not "within")
        flagged = bool(report.get("flagged")) or (bound is not None and epsilon is not None and bound > epsilon)
        verdict = (f"exceeds the ledger's ε at {100 * level:g}% confidence: a privacy bug, or a wrong ledger (a "
                   f"correct run is flagged in at most {100 * (1 - level):.2g}% of audits)") if flagged \
            else f"within the ledger's ε at {100 * level:g}% confidence"
        out.append(f"<p>One-run audit on {e(_fmt(one_run.get('canaries')))} canaries ({verdict}):</p><ul>"
                   + "".join(f"<li>{e(item)}</li>" for item in items) + "</ul>")
    notes = report.get("notes") or []
    if notes:
        out.append("<p>Notes:</p><ul>" + "".join(f"<li>{e(note)}</li>" for note in notes) + "</ul>")
    exposure = report.get("exposure")
    if exposure:
        planted = ", ".join(f"{_fmt(row.get('exposure'))} bits ({row.get('repetitions')}x)"
                            for row in exposure.get("planted", []))
        controls = exposure.get("controls", {})
        out.append(f"<p>Canary exposure (of at most {n(exposure.get('max_exposure'))} bits): planted {e(planted)}; "
                   f"{e(_fmt(controls.get('count')))} never-planted controls {n(controls.get('mean_exposure'))} "
                   f"on average (chance {n(exposure.get('chance'))}).</p>")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "n/a" if value is None else str(value)


def report_html(summary: dict[str, Any], plots: list[tuple[str, str, bytes]],
                audit: dict[str, Any] | None = None) -> str:
    """One self-contained HTML page (PNG images embedded as base64)."""
    e = html.escape
    rows = [("run", summary["run_dir"]), ("steps", f"{summary['steps_done']} of {summary['steps_planned']}"),
            ("ε spent", f"{bound_text(summary['epsilon'])} at δ = {summary['delta']:.3g} ({summary['accountant']})"),
            ("ε cap", _fmt(summary["epsilon_cap"])), ("stopped", summary["stopped"])]
    selected_by = summary.get("selected_by_search")
    if selected_by is not None:
        rows[2] = ("ε spent", f"{bound_text(summary['epsilon'])} at δ = {summary['delta']:.3g} ({summary['accountant']}): "
                   f"the search {selected_by['search_dir']} that selected this run, every trial included")
        rows.insert(3, ("ε of this run alone", f"{bound_text(selected_by['run_epsilon_alone'])} (understates what "
                        "publishing the run costs)"))
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>dpclip report: {e(summary['name'])}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
        "td,th{padding:.2em .8em;text-align:left;vertical-align:top}.nc{color:#a33}"
        "img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.9em;color:#555}</style></head><body>",
        f"<h1>dpclip run report: {e(summary['name'])}</h1>",
        "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in rows) + "</table>",
    ]
    if summary["final_eval"]:
        parts.append(f'<h2>Final held-out metrics <span class="nc">({NOT_COVERED})</span></h2>')
        parts.append('<p class="nc">Exact, computed without noise on the held-out split of the private data.</p>')
        parts.append("<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(_fmt(v))}</td></tr>"
                                         for k, v in summary["final_eval"].items()) + "</table>")
    parts.append("<h2>Privacy statement</h2><ul>")
    parts += [f"<li>{e(line)}</li>" for line in summary["statement"]]
    parts.append("</ul>")
    if audit:
        parts += _audit_html(audit)
    parts.append("<h2>Plots</h2>")
    for title, caption, data in plots:
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure><img alt="{e(title)}" src="data:image/png;base64,{encoded}">'
                     f"<figcaption>{e(title)}: {e(caption)}</figcaption></figure>")
    if not plots:
        parts.append("<p>The run has no plot yet (no step was recorded).</p>")
    parts.append(f"<p><small>written by dpclip report, {e(datetime.now().isoformat(timespec='seconds'))}</small></p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(run_dir: Path, out: Path | None = None) -> tuple[dict[str, Any], Path]:
    """The run's summary, and the HTML page written (atomically) to ``out`` or
    ``RUN_DIR/report.html``."""
    summary = run_summary(run_dir)
    path = Path(summary["run_dir"])
    out = path / REPORT_FILE if out is None else Path(out).expanduser().resolve()
    if out.is_dir():
        raise DpclipError(f"{out} is a folder", "pass a file name for --out, e.g. --out report.html")
    if out.resolve() != (path / REPORT_FILE).resolve() and out.resolve().is_relative_to(path.resolve()):
        # `--out RUN/ledger.json` replaced the run's ledger with the page: the run could no longer be accounted
        raise DpclipError(f"--out {out} is inside the run directory {path}, whose files the page must not replace",
                          f"write the page outside the run, or leave --out out for {path / REPORT_FILE}")
    if not out.parent.is_dir():
        raise DpclipError(f"{out.parent} does not exist", "create the folder first, or choose another --out")
    page = report_html(summary, run_plots(path, summary["selected_by_search"]), _audit(path))
    write_text_atomic(out, page)
    return summary, out
