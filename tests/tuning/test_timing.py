import pytest

from dpclip.tuning.timing import measure_step_seconds, step_cost_signature, timing_clipping


def test_learning_rate_and_threshold_value_do_not_change_the_step_cost(tiny):
    _, a = tiny("training.optimizer.lr=0.1", "clipping.threshold.value=0.5")
    _, b = tiny("training.optimizer.lr=0.9", "clipping.threshold.value=5")
    assert step_cost_signature(a) == step_cost_signature(b)


def test_threshold_kind_and_model_change_the_step_cost(tiny):
    _, fixed = tiny()
    _, quantile = tiny("clipping.threshold={kind: quantile}")
    _, wider = tiny("model.hidden=[32]")
    assert len({step_cost_signature(r) for r in (fixed, quantile, wider)}) == 3


def test_statistics_get_a_stand_in_noise_for_timing(tiny):
    _, recipe = tiny("clipping.threshold={kind: quantile, budget_fraction: 0.1}")
    threshold = timing_clipping(recipe).threshold
    assert threshold.budget_fraction is None and threshold.sigma > 0


def test_measured_step_seconds_are_positive_and_count_every_step(tiny):
    _, recipe = tiny("clipping.threshold={kind: quantile}")
    ticks = []
    seconds = measure_step_seconds(recipe, steps=3, warmup_steps=1, on_step=lambda: ticks.append(1))
    assert seconds > 0
    assert len(ticks) == 4


def test_a_runs_fixed_cost_is_measured_and_leaves_nothing_behind(tiny, tmp_path):
    from dpclip.tuning.timing import measure_fixed_seconds

    _, recipe = tiny()
    assert measure_fixed_seconds(recipe) > 0
    assert not (tmp_path / "runs").exists(), "the measuring run lives in a deleted temporary directory"


@pytest.mark.slow
def test_tune_cost_estimate_of_one_run_is_within_a_factor_of_a_real_run(tiny):
    """Steps × seconds per step alone missed the data, model, calibration, checkpoints,
    evaluation and plot, which dominate a short run."""
    import math
    import time

    from dpclip.train.workflow import train
    from dpclip.tuning.cost import StepTimer, tune_cost

    base, recipe = tiny("training.steps=5", "model.hidden=[16]")
    # Estimate and run alternate, twice, and the fastest of each is compared: contention from other
    # processes only ever slows a timing down, so the minima are the timings least disturbed.
    estimates, steps_alone, actuals = [], [], []
    for _ in range(2):
        report = tune_cost(base, recipe, timer=StepTimer(calibration_steps=3, warmup_steps=1))
        run = report.runs[0]
        assert run.fixed_seconds > 0
        estimates.append(report.hours_per_run * 3600)
        steps_alone.append(run.steps * run.step_seconds)
        start = time.perf_counter()
        train(recipe)
        actuals.append(time.perf_counter() - start)
    estimate, steps_only, actual = min(estimates), min(steps_alone), min(actuals)
    # A factor of 3 either way (short wall times swing), and closer than the steps alone.
    assert actual / 3 < estimate < actual * 3, (estimates, actuals)
    assert abs(math.log(estimate / actual)) < abs(math.log(steps_only / actual)), (estimate, steps_only, actual)
