"""How often a step reads values back from the device (dpclip/engine/microbatch.py).

On a GPU each read (``.tolist()``, ``float(t)``, ``bool(t)``, ``.item()``) makes the host wait
for the device, so a GPT-2 layer-wise step paid two per group: the cancellation check's flags
and the non-finite check. They are one read now; counted here on the CPU, where the same
calls happen."""

import torch
from torch import nn

from dpclip.engine import DPEngine


class _Net(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(depth))
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x).pow(2).mean((1, 2))


def _reads_per_step(monkeypatch, grouping, depth):
    model = _Net(depth)
    engine = DPEngine(model, {"grouping": grouping, "norm_method": "ghost"}, gradient_noise_multiplier=1.0,
                      expected_batch_size=4, seed=0)
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    engine.backward(model(x))   # first step: batch-axis probes
    engine.privatize()
    model.zero_grad(set_to_none=True)
    count = [0]
    for name in ("tolist", "item", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            count[0] += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    engine.backward(model(x))
    monkeypatch.undo()
    return count[0], len(engine.groups)


def test_layer_wise_backward_reads_the_device_once_per_group(monkeypatch):
    reads, groups = _reads_per_step(monkeypatch, "layer", depth=6)
    assert groups == 7
    assert reads <= groups + 2, reads


def test_reads_grow_by_one_per_added_layer(monkeypatch):
    shallow, _ = _reads_per_step(monkeypatch, "layer", depth=3)
    deep, _ = _reads_per_step(monkeypatch, "layer", depth=7)
    assert deep - shallow == 4, (shallow, deep)


def test_groups_finalized_together_read_the_device_once_per_finalization(monkeypatch):
    """On a GPU groups are finalized FINALIZE_BATCH at a time: one read for their checks."""
    from dpclip.engine import microbatch

    monkeypatch.setitem(microbatch.FINALIZE_BATCH, "cpu", 3)
    reads, groups = _reads_per_step(monkeypatch, "layer", depth=8)
    assert groups == 9
    assert reads <= 3 + 2, reads   # 9 groups, 3 at a time


# ------------------------------------------------------------------ kernels per step
#
# On a GPU each tensor operation is a kernel launch that the host pays for, and GPT-2 small's
# small steps are bound by the host (docs/performance.md). The group-level work must not
# grow with the number of small parameters (biases, LayerNorms) or of checked weights.

from torch.utils._python_dispatch import TorchDispatchMode   # noqa: E402

_VIEWS = {"view", "_unsafe_view", "slice", "transpose", "expand", "select", "unsqueeze", "squeeze",
          "t", "diagonal", "detach", "reshape", "split", "alias", "permute", "as_strided", "unbind"}
_GROUP_LEVEL = ("dpclip/engine/microbatch.py", "dpclip/engine/group_norms.py", "dpclip/engine/cancellation.py")


class _CountOps(TorchDispatchMode):
    """Non-view aten operations run by the engine's group-level code (per-parameter norm
    arithmetic included: its fast paths live in group_norms.py and factors.param_norm_sq)."""

    def __init__(self, files):
        super().__init__()
        self.files, self.count = files, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import traceback
        if func.__name__.split(".")[0] not in _VIEWS:
            frames = [f.filename.replace("\\", "/") for f in traceback.extract_stack()]
            inner = [f for f in frames if "/dpclip/" in f]
            if inner and inner[-1].endswith(self.files):
                self.count += 1
        return func(*args, **(kwargs or {}))


class _Stack(nn.Module):
    """depth blocks of Linear + LayerNorm: per block one weight, three small parameters."""

    def __init__(self, depth):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6)) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean((1, 2))


def _group_ops(depth, files=_GROUP_LEVEL + ("dpclip/engine/factors.py",)):
    model = _Stack(depth)
    engine = DPEngine(model, {"grouping": "all-layer", "norm_method": "ghost"}, gradient_noise_multiplier=1.0,
                      expected_batch_size=4, seed=0)
    x = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))
    engine.backward(model(x))
    engine.privatize()
    counter = _CountOps(files)
    loss = model(x)
    with counter:
        engine.backward(loss)
    return counter.count


def test_all_layer_group_work_does_not_grow_with_small_parameters_or_checked_weights():
    """Per added block (a ghost-normed weight with its cancellation check, a bias and a
    LayerNorm's two parameters) the group-level code adds only the weight's own norm and
    clipped sum: its norm² joins one stack, its check one stacked comparison, and the three
    small gradients one concatenation, normed and summed once for the group. Before, each
    small parameter took a norm, an add and a product of its own, and each weight three
    comparison kernels and a probe."""
    three, five = _group_ops(3), _group_ops(5)
    weight_only = _group_ops(5, ("dpclip/engine/grams.py",)) - _group_ops(3, ("dpclip/engine/grams.py",))
    assert weight_only > 0   # the counter sees the weights' own Gram work
    group_level = _group_ops(5, _GROUP_LEVEL) - _group_ops(3, _GROUP_LEVEL)
    assert group_level == 0, (group_level, three, five)
    # factors.py: the weight's norm (a view for one group of columns) and its clipped sum
    assert five - three <= 2 * 2 * 2, (three, five)


# ------------------------------------------------------------------ the same numbers

import pytest   # noqa: E402

from dpclip.engine import group_norms, microbatch   # noqa: E402

# tail samples (total norm above 0.49: half of them here) clipped at 0.6, the body at 0.3
_DISCRIMINATIVE = {"kind": "discriminative", "small": 0.3, "large": 0.6, "tail_rule": "threshold",
                   "tail_threshold": 0.49}


def _step(monkeypatch, grouping, threshold, batched, nonfinite, finalize_batch=1):
    """p.grad (σ = 0), the clip fractions and the per-sample norms of one step of _Stack."""
    if not batched:   # every small gradient normed and summed on its own, as before
        monkeypatch.setattr(group_norms, "DENSE_BATCH_MAX_NUMEL", -1)
    monkeypatch.setitem(microbatch.FINALIZE_BATCH, "cpu", finalize_batch)
    torch.manual_seed(3)
    model = _Stack(3)
    clipping = {"grouping": grouping, "norm_method": "ghost", "threshold": threshold}
    engine = DPEngine(model, clipping, gradient_noise_multiplier=0.0, expected_batch_size=6, seed=0)
    x = torch.randn(6, 5, 6, generator=torch.Generator().manual_seed(1)) * 3
    if nonfinite:
        x[2, 1, 3] = float("inf")
    engine.backward(model(x))
    norms = torch.cat(engine.step_accumulator.norms)
    report = engine.privatize()
    monkeypatch.undo()
    return [p.grad.clone() for p in model.parameters()], report.clip_fraction, norms


@pytest.mark.parametrize("threshold", [{"kind": "fixed"}, {"kind": "fixed", "value": "one per group"}, _DISCRIMINATIVE],
                         ids=["fixed", "fixed-per-group", "per-sample"])
@pytest.mark.parametrize("grouping", ["all-layer", "layer", "param"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "one-inf-sample"])
@pytest.mark.parametrize("finalize_batch", [1, 4], ids=["groups-one-by-one", "groups-four-at-a-time"])
def test_small_gradients_normed_and_summed_together_match_one_at_a_time(monkeypatch, grouping, threshold,
                                                                        nonfinite, finalize_batch):
    """Against every group finalized alone and every small gradient normed and summed alone."""
    if threshold == {"kind": "fixed"}:   # between the samples' norms: some clipped, some not
        threshold = {"kind": "fixed", "value": 0.49 if grouping == "all-layer" else 0.2}
    elif threshold["kind"] == "fixed":   # a different C_k for each group, around its norms
        groups = {"all-layer": 1, "layer": 6, "param": 12}[grouping]
        threshold = {"kind": "fixed", "value": [0.49] if groups == 1 else
                     [0.02 + 0.3 * (k % 5) / 4 for k in range(groups)]}
    grads, fraction, norms = _step(monkeypatch, grouping, threshold, True, nonfinite, finalize_batch)
    ref_grads, ref_fraction, ref_norms = _step(monkeypatch, grouping, threshold, False, nonfinite)
    finite = torch.isfinite(ref_norms)
    assert torch.equal(torch.isfinite(norms), finite)
    assert (not finite.all()) == nonfinite
    torch.testing.assert_close(norms[finite], ref_norms[finite], rtol=1e-6, atol=0)
    assert torch.equal(fraction, ref_fraction)
    assert (fraction > 0).any() and (fraction < 1).any(), fraction
    # each group's count against the threshold its samples were clipped at, recomputed here
    groups = norms.shape[1]
    if threshold["kind"] == "fixed" and isinstance(threshold["value"], list):
        per_sample = torch.tensor(threshold["value"]).expand_as(norms)
    elif threshold["kind"] == "fixed":
        per_sample = torch.full_like(norms, threshold["value"] / groups ** 0.5)   # a float: the total
    else:
        tail = ref_norms.nan_to_num(posinf=1e30).norm(dim=1, keepdim=True) > threshold["tail_threshold"]
        per_sample = torch.where(tail, threshold["large"], threshold["small"]) / groups ** 0.5
        assert tail.any() and not tail.all()
    torch.testing.assert_close(fraction, (norms > per_sample).float().mean(0), rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
