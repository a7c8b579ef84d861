"""Evidence for docs/methods-evidence.md: DC-SGD's synthetic check and a digits comparison of clipping policies.

    python scripts/methods_evidence.py synthetic            # seconds: numpy/torch only
    python scripts/methods_evidence.py digits --seeds 0 1 2  # minutes on one CPU thread

Both print Markdown tables (pasted into docs/methods-evidence.md) and write JSON (and, for the
synthetic check, a PNG) under --out (default docs/methods-evidence/).

Synthetic (the DC-SGD paper's Figures 2–3): 256 norms from N(100, 20²), B = 256, σ_T = 1,
d = 10⁵, σ_H = 5, b ∈ {10, 20, 50}, R ∈ {120, 150}; over 200 draws of the histogram noise,
the percentile estimates of dpclip's DC-SGD-P rule against the true percentiles, and
dpclip's E(C) estimate against the exact E(C) computed from the 256 norms.

Digits: the quickstart MLP, flat clipping, Adam, Poisson batches of expected size 64,
`--epochs` epochs, ε ∈ {2, 8}, δ = 1e-5; each method trained with a hand-written loop around
DPEngine (no run directory, so the timing is the method's, not the workflow's IO). The
"tuning charged" columns calibrate each run's σ so that the method's G tuning runs compose
to the target ε (naive composition: G × steps Poisson-subsampled Gaussians, PLD accountant,
dpclip.accounting.calibrate_noise_multiplier).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpclip.accounting import calibrate_noise_multiplier  # noqa: E402
from dpclip.data import load_data  # noqa: E402
from dpclip.engine import DPEngine  # noqa: E402
from dpclip.engine.policies.histogram import error_threshold, expected_error, histogram_counts, percentile_threshold  # noqa: E402
from dpclip.models import build_model  # noqa: E402
from dpclip.models.evaluate import evaluate  # noqa: E402
from dpclip.recipe import load_recipe  # noqa: E402
from dpclip.train.step import PrivateStep  # noqa: E402

# ------------------------------------------------------------------ synthetic check


def synthetic(out: Path, draws: int = 200, sigma_hist: float = 5.0) -> dict:
    rng = np.random.default_rng(0)
    norms = np.clip(rng.normal(100.0, 20.0, 256), 0, None)
    batch, sigma_t, dim = 256, 1.0, 100_000
    percentiles = [0.1, 0.25, 0.5, 0.75, 0.9]
    true_p = {p: float(np.quantile(norms, p)) for p in percentiles}
    grid = torch.linspace(1.0, 200.0, 400, dtype=torch.float64)
    t_norms = torch.tensor(norms, dtype=torch.float64)
    exact = sigma_t ** 2 * grid ** 2 * dim / batch ** 2 + ((t_norms[None, :] - grid[:, None]).clamp(min=0) ** 2).mean(1)
    c_star = float(grid[int(torch.argmin(exact))])
    gen = torch.Generator().manual_seed(0)
    results, curves = [], {}
    for range_ in (150.0, 120.0):
        for bins in (10, 20, 50):
            counts = histogram_counts(t_norms, range_, bins)
            est_p = {p: [] for p in percentiles}
            est_curves, chosen = [], []
            for _ in range(draws):
                noisy = counts + torch.randn(bins, generator=gen, dtype=torch.float64) * sigma_hist
                for p in percentiles:
                    est_p[p].append(percentile_threshold(noisy, range_, p))
                est_curves.append(expected_error(grid, noisy, range_, sigma_t, dim, batch))
                chosen.append(error_threshold(1.0, noisy, range_, sigma_t, dim, batch, 1e-4, 1e4))
            est = torch.stack(est_curves)
            mean_curve = est.mean(0)
            argmins = grid[torch.argmin(est, dim=1)]
            excess = [float(exact[int(torch.argmin(torch.abs(grid - c)))] / exact.min() - 1) for c in chosen]
            row = {
                "R": range_, "b": bins,
                "percentiles": {str(p): {"true": true_p[p], "mean": statistics.fmean(est_p[p]),
                                         "std": statistics.pstdev(est_p[p]),
                                         "mae": statistics.fmean(abs(v - true_p[p]) for v in est_p[p])}
                                for p in percentiles},
                "E_exact_argmin": c_star,
                "E_est_argmin_mean": float(argmins.mean()), "E_est_argmin_std": float(argmins.std()),
                "E_curve_max_rel_gap": float(((mean_curve - exact).abs() / exact).max()),
                "dcsgd_e_choice_mean": statistics.fmean(chosen), "dcsgd_e_choice_std": statistics.pstdev(chosen),
                "dcsgd_e_excess_error_mean": statistics.fmean(excess),
            }
            results.append(row)
            curves[(range_, bins)] = (mean_curve.numpy(), est.quantile(0.05, 0).numpy(), est.quantile(0.95, 0).numpy())
    _plot_synthetic(out / "dcsgd-synthetic.png", grid.numpy(), exact.numpy(), curves, c_star)
    summary = {"norms": "N(100, 20^2), 256 draws, seed 0", "B": batch, "sigma_T": sigma_t, "d": dim,
               "sigma_H": sigma_hist, "draws": draws, "rows": results}
    (out / "dcsgd-synthetic.json").write_text(json.dumps(summary, indent=1))
    _print_synthetic(summary)
    return summary


def _plot_synthetic(path: Path, grid, exact, curves, c_star) -> None:
    import matplotlib  # lazy: only the synthetic plot needs it, and it is slow to import
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), sharex=True)
    for ax, ((range_, bins), (mean, low, high)) in zip(axes.flat, curves.items()):
        ax.plot(grid, exact, "k-", label="exact E(C)")
        ax.plot(grid, mean, "C1--", label="from noisy histogram (mean)")
        ax.fill_between(grid, low, high, color="C1", alpha=0.25, label="5–95% over draws")
        ax.axvline(c_star, color="k", lw=0.5)
        ax.axvline(range_, color="C3", lw=0.5, ls=":")
        ax.set_title(f"R = {range_:g}, b = {bins}")
        ax.set_yscale("log")
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("C")
    fig.suptitle("DC-SGD-E: E(C) from a noisy histogram (σ_H = 5) vs exact; 256 norms ~ N(100, 20²)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_synthetic(summary: dict) -> None:
    print(f"\n### Synthetic check ({summary['draws']} noise draws, σ_H = {summary['sigma_H']})\n")
    ps = list(summary["rows"][0]["percentiles"])
    print("| R | b | " + " | ".join(f"p={p}: true / est ± sd" for p in ps) + " |")
    print("|---|---|" + "---|" * len(ps))
    for row in summary["rows"]:
        cells = [f"{v['true']:.1f} / {v['mean']:.1f} ± {v['std']:.1f}" for v in row["percentiles"].values()]
        print(f"| {row['R']:g} | {row['b']} | " + " | ".join(cells) + " |")
    print("\n| R | b | argmin exact E | argmin est. E (mean ± sd) | max rel. gap of mean curve | "
          "DC-SGD-E choice from C0=1 (mean ± sd) | excess exact error of that choice |")
    print("|---|---|---|---|---|---|---|")
    for row in summary["rows"]:
        print(f"| {row['R']:g} | {row['b']} | {row['E_exact_argmin']:.1f} | {row['E_est_argmin_mean']:.1f} ± "
              f"{row['E_est_argmin_std']:.1f} | {row['E_curve_max_rel_gap']:.2f} | {row['dcsgd_e_choice_mean']:.1f} ± "
              f"{row['dcsgd_e_choice_std']:.1f} | {100 * row['dcsgd_e_excess_error_mean']:.1f}% |")


# ------------------------------------------------------------------ digits comparison

GRID = [0.1, 0.2, 0.5, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0]   # DC-SGD's C grid (docs/tuning.md)

# name -> (clipping dict, statistic kind or None, tuning runs G charged to the budget, why G)
METHODS = {
    "dpsgd-C=1 (median of grid)": ({"threshold": {"kind": "fixed", "value": 1.0}}, None, 1,
                                   "no tuning: the grid's (lower) median"),
    "quantile (p=0.5, r=0.01)": ({"threshold": {"kind": "quantile", "target": 0.5, "lr": 0.3, "initial": 1.0}},
                                 "quantile", 45, "Andrew et al.'s grid over p × η (docs/tuning.md)"),
    "dcsgd-p (p=0.5)": ({"threshold": {"kind": "dcsgd-p", "percentile": 0.5}}, "histogram", 9,
                        "p in 0.1..0.9"),
    "dcsgd-e": ({"threshold": {"kind": "dcsgd-e"}}, "histogram", 1, "nothing to tune"),
    "discriminative (norm > 4: L=2, S=0.5)": (
        {"threshold": {"kind": "discriminative", "small": 0.5, "large": 2.0, "tail_threshold": 4.0}}, None, 10,
        "c_small over a 10-value grid"),
    "discriminative (paper: top 10%, L=10S, S=1)": (
        {"threshold": {"kind": "discriminative", "small": 1.0, "large": 10.0, "tail_rule": "top_fraction",
                       "top_fraction": 0.1}}, None, 10, "c_small over a 10-value grid"),
    "auto (C=1)": ({"fn": "auto", "threshold": {"kind": "fixed", "value": 1.0}}, None, 1,
                   "with Adam, AUTO's C only rescales the update: nothing to tune"),
}
def sigma_hist_for(sigma_total: float) -> float:
    """The paper's σ_H (§VI-C): 5, raised to 8 for 2 ≤ σ ≤ 3 and 12 for σ > 3; beyond σ = 6 (heavily
    charged runs) 2σ, so that the histogram still takes at most a quarter of the budget."""
    if sigma_total < 2:
        return 5.0
    if sigma_total <= 3:
        return 8.0
    return max(12.0, 2 * sigma_total)


QUANTILE_FRACTION = 0.01


class Digits:
    def __init__(self):
        self.recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [])
        self.data = load_data(self.recipe.data, seed=0)
        self.n = len(self.data.train["labels"])


_SIGMA_CACHE: dict = {}


def total_sigma(eps: float, delta: float, q: float, steps: int) -> float:
    key = (eps, delta, q, steps)
    if key not in _SIGMA_CACHE:
        _SIGMA_CACHE[key] = calibrate_noise_multiplier(eps, delta, q, steps, "pld")
    return _SIGMA_CACHE[key]


def train_once(digits: Digits, clipping: dict, stat: str | None, sigma_total: float, *, seed: int, epochs: float,
               batch: int = 64, lr: float = 0.002) -> tuple[float, float]:
    """One private training; returns (test accuracy, wall seconds)."""
    data = digits.data
    q = batch / digits.n
    steps = math.ceil(epochs / q)
    clipping = json.loads(json.dumps(clipping))
    clipping.setdefault("grouping", "all-layer")
    threshold = clipping["threshold"]
    sigma_g = sigma_total
    if stat == "histogram":                      # σ_T = (σ⁻² − σ_H⁻²)^(−1/2), K = 1
        threshold["sigma_hist"] = sigma_hist_for(sigma_total)
        sigma_g = (sigma_total ** -2 - threshold["sigma_hist"] ** -2) ** -0.5
    elif stat == "quantile":                     # K/(4σ_b²) = r/σ², σ_g = σ/sqrt(1 − r)
        threshold["sigma"] = sigma_total * math.sqrt(1 / (4 * QUANTILE_FRACTION))
        sigma_g = sigma_total / math.sqrt(1 - QUANTILE_FRACTION)
    start = time.perf_counter()
    model, loss_fn = build_model(digits.recipe.model, data, seed=seed)
    engine = DPEngine(model, clipping, gradient_noise_multiplier=sigma_g, expected_batch_size=batch, seed=seed, sample_rate=q)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = torch.Generator().manual_seed(1000 + seed)
    private_step = PrivateStep(model, loss_fn, engine, optimizer, data.train, micro_batch_size=None)
    for _ in range(steps):
        private_step(torch.nonzero(torch.rand(digits.n, generator=sampler) < q).squeeze(1))
    engine.detach()
    accuracy = evaluate(model, loss_fn, data.test, data.task)["accuracy"]
    return accuracy, time.perf_counter() - start


def digits(out: Path, seeds: list[int], epochs: float, epsilons: list[float], delta: float = 1e-5) -> dict:
    torch.set_num_threads(1)
    data = Digits()
    q = 64 / data.n
    steps = math.ceil(epochs / q)
    rows = []
    for eps in epsilons:
        for seed in seeds:
            def sigma_for(g: int) -> float:
                return total_sigma(eps, delta, q, g * steps)

            grid = {c: train_once(data, {"threshold": {"kind": "fixed", "value": c}}, None, sigma_for(1), seed=seed,
                                  epochs=epochs) for c in GRID}
            grid_charged = {c: train_once(data, {"threshold": {"kind": "fixed", "value": c}}, None, sigma_for(10),
                                          seed=seed, epochs=epochs) for c in GRID}
            best = max(grid, key=lambda c: grid[c][0])
            best_charged = max(grid_charged, key=lambda c: grid_charged[c][0])
            rows.append({"eps": eps, "seed": seed, "method": "dpsgd best of 10-C grid", "G": 10,
                         "accuracy": grid[best][0], "seconds": sum(v[1] for v in grid.values()),
                         "charged_accuracy": grid_charged[best_charged][0], "detail": f"best C={best:g} "
                         f"(charged: C={best_charged:g})", "grid": {str(c): v[0] for c, v in grid.items()}})
            print(json.dumps(rows[-1]), flush=True)
            for name, (clipping, stat, g, _) in METHODS.items():
                if name.startswith("dpsgd-C=1"):     # in the grid already
                    acc, sec = grid[1.0]
                    charged = acc
                else:
                    acc, sec = train_once(data, clipping, stat, sigma_for(1), seed=seed, epochs=epochs)
                    charged = acc if g == 1 else train_once(data, clipping, stat, sigma_for(g), seed=seed,
                                                             epochs=epochs)[0]
                rows.append({"eps": eps, "seed": seed, "method": name, "G": g, "accuracy": acc, "seconds": sec,
                             "charged_accuracy": charged})
                print(json.dumps(rows[-1]), flush=True)
    summary = {"epochs": epochs, "steps": steps, "q": q, "delta": delta, "seeds": seeds,
               "sigma_total": {f"eps={e} G={g}": total_sigma(e, delta, q, g * steps)
                               for e in epsilons for g in (1, 9, 10, 45)},
               "rows": rows}
    (out / "digits.json").write_text(json.dumps(summary, indent=1))
    _print_digits(summary)
    return summary


def _print_digits(summary: dict) -> None:
    rows = summary["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    epsilons = sorted({r["eps"] for r in rows})
    n = len(summary["seeds"])
    print(f"\n### Digits ({summary['epochs']} epochs = {summary['steps']} steps, q = {summary['q']:.4f}, "
          f"δ = {summary['delta']}, {n} seed{'s' if n > 1 else ''}; mean ± sd over seeds)\n")
    print("| method | G | " + " | ".join(f"ε={e:g} acc | ε={e:g} acc, tuning charged" for e in epsilons)
          + " | s / run |")
    print("|---|---|" + "---|---|" * len(epsilons) + "---|")

    def fmt(values):
        return f"{100 * statistics.fmean(values):.1f} ± {100 * statistics.pstdev(values):.1f}" if len(values) > 1 \
            else f"{100 * values[0]:.1f}"

    for m in methods:
        cells, secs, g = [], [], None
        for e in epsilons:
            sel = [r for r in rows if r["method"] == m and r["eps"] == e]
            g = sel[0]["G"]
            cells += [fmt([r["accuracy"] for r in sel]), fmt([r["charged_accuracy"] for r in sel])]
            secs += [r["seconds"] / (10 if m.startswith("dpsgd best") else 1) for r in sel]
        print(f"| {m} | {g} | " + " | ".join(cells) + f" | {statistics.fmean(secs):.1f} |")
    print("\nσ (total, per run) for G runs composing to ε (σ_H used by dcsgd):")
    for key, value in summary["sigma_total"].items():
        print(f"  {key}: {value:.3f} (σ_H {sigma_hist_for(value):g})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["synthetic", "digits", "all"])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "methods-evidence")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=float, default=30)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 8.0])
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what in ("synthetic", "all"):
        synthetic(args.out)
    if args.what in ("digits", "all"):
        digits(args.out, args.seeds, args.epochs, args.epsilons)


if __name__ == "__main__":
    main()
