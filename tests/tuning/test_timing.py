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
    threshold = timing_clipping(recipe)["threshold"]
    assert threshold["budget_fraction"] is None and threshold["sigma"] > 0


def test_measured_step_seconds_are_positive_and_count_every_step(tiny):
    _, recipe = tiny("clipping.threshold={kind: quantile}")
    ticks = []
    seconds = measure_step_seconds(recipe, steps=3, warmup_steps=1, on_step=lambda: ticks.append(1))
    assert seconds > 0
    assert len(ticks) == 4
