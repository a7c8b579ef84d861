"""Pipeline set-up refusals and the per-stage threshold spec, in one process (docs/distributed.md)."""

from __future__ import annotations

import math
from collections import OrderedDict
from types import SimpleNamespace

import pytest
from torch import nn

from dpclip.distributed.pipeline import PipelineEngine, stage_bounds, stage_threshold
from dpclip.errors import DpclipError
from dpclip.train.workflow import train
from tests.distributed.pipeline_case import pipeline_recipe


def test_stages_start_at_the_top_level_modules_their_regexes_name():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert stage_bounds(model, ["^1$", "^3$"]) == [(0, 3), (3, 6)]   # the first stage takes what is before
    assert stage_bounds(model, ["^1$", "^3$", "^5$"]) == [(0, 3), (3, 5), (5, 6)]


def test_a_stage_inside_a_module_or_a_non_sequential_model_is_refused_with_a_hint():
    nested = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    with pytest.raises(DpclipError, match="not a top-level module") as err:
        stage_bounds(nested, ["^0$", r"^0\.1$"])
    assert err.value.hint
    with pytest.raises(DpclipError, match="nn.Sequential"):
        stage_bounds(nn.Linear(2, 2), ["^$", "^$"])
    with pytest.raises(DpclipError, match="increasing order"):
        stage_bounds(nested, ["^1$", "^0$"])


def test_a_stage_gets_its_share_of_the_fixed_threshold_as_its_group_in_one_process():
    assert stage_threshold({"kind": "fixed", "value": 2.0}, 1, 4)["value"] == [pytest.approx(2.0 / math.sqrt(4))]
    assert stage_threshold({"kind": "fixed", "value": [0.1, 0.7]}, 1, 2)["value"] == [0.7]
    quantile = {"kind": "quantile", "initial": 0.4, "sigma": 1.0}
    assert stage_threshold(quantile, 1, 2) == quantile   # every group starts at `initial`
    with pytest.raises(DpclipError, match="does not run on pipeline stages") as err:
        stage_threshold({"kind": "dcsgd-p"}, 0, 2)
    assert "fixed or quantile" in err.value.hint


def test_a_pipeline_recipe_in_one_process_is_refused_before_any_file(tmp_path):
    with pytest.raises(DpclipError, match="one stage per process") as err:
        train(pipeline_recipe(tmp_path / "runs", "training.parallel=pipeline"), run_dir=tmp_path / "run")
    assert "--nproc" in err.value.hint
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("named", [False, True], ids=["numbered", "named"])
def test_a_stages_written_buffers_are_named_by_the_whole_models_checkpoint_keys(named):
    """Stage 1's child 0 is the model's child 2: the statement must name the key the gathered
    checkpoint holds, the child's own name in an OrderedDict Sequential."""
    children = [("fc1", nn.Linear(3, 4)), ("act", nn.ReLU()), ("counter", nn.Linear(4, 4)), ("fc2", nn.Linear(4, 2))]
    model = nn.Sequential(OrderedDict(children)) if named else nn.Sequential(*[m for _, m in children])
    engine = SimpleNamespace(forward_written_state={"0.calls"})
    link = SimpleNamespace(world=SimpleNamespace(rank=1))
    stage = PipelineEngine(engine, link, [], model, [(0, 2), (2, 4)], None)
    assert stage.forward_written_state == ({"counter.calls"} if named else {"2.calls"})
    assert stage.forward_written_state <= {name.rsplit(".", 1)[0] + ".calls" for name in model.state_dict()}
