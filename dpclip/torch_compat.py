"""torch's private API, in one place: every name of torch's that starts with an underscore and
every patch of torch's own objects that dpclip relies on, each behind a name of its own here.

An upgrade of torch may move or drop any of them without notice; this is the one module to
read and test when it does (tests/test_architecture.py refuses private torch names anywhere
else). Each entry says what it is, why the public API does not suffice, and the torch
version it was checked against (2.13). The re-exports are documented by the ``#:`` comment
above them (a re-exported function or class keeps torch's own docstring).
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import batchnorm, instancenorm
from torch.nn.utils import parametrize
from torch.utils import _python_dispatch, _pytree

# --- re-exports ------------------------------------------------------------------------------

#: ``tree_flatten(tree) -> (leaves, spec)``: the leaves of nested tuples, lists, dicts and
#: torch's and libraries' registered containers (transformers registers its ``ModelOutput``
#: here), in a fixed order. torch 2.13 has no public pytree module (``torch.utils.pytree`` does
#: not exist), and a walk of our own would not know the containers libraries register.
#: Checked against torch 2.13.
tree_flatten = _pytree.tree_flatten

#: ``tree_unflatten(leaves, spec)``: the inverse of :data:`tree_flatten` (same module, same
#: reason). Checked against torch 2.13.
tree_unflatten = _pytree.tree_unflatten

#: The base class of a mode that sees every ATen operation (``bernoulli_``, its tags such as
#: ``nondeterministic_seeded``) below autograd: the public ``torch.overrides.TorchFunctionMode``
#: sees Python-level calls only, before decomposition, so it cannot tell a random draw inside
#: ``F.dropout`` or a fused kernel. Checked against torch 2.13.
TorchDispatchMode = _python_dispatch.TorchDispatchMode

#: The common base of ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy variants and users'
#: subclasses: no public class covers them all (isinstance against the public ones would miss
#: the lazy ones). Checked against torch 2.13.
BatchNormBase = batchnorm._BatchNorm

#: The common base of ``InstanceNorm1d/2d/3d`` and the lazy variants (same reason as
#: :data:`BatchNormBase`). Checked against torch 2.13.
InstanceNormBase = instancenorm._InstanceNorm

# --- tensors ---------------------------------------------------------------------------------


def is_view(t: Tensor) -> bool:
    """Whether autograd treats ``t`` as a view of another tensor (``Tensor._is_view``). No public
    API tells: ``t._base`` is private too, and comparing storages cannot tell a view from a tensor
    sharing memory by other means. Checked against torch 2.13."""
    return t._is_view()


def func_transform_active() -> str | None:
    """The torch.func transform the current code runs inside, as its user calls it (``torch.vmap``,
    ``torch.func.grad/vjp/jacrev``, ``torch.func.jvp/jacfwd``, ``torch.func.functionalize``), or
    None outside any (``torch._C._functorch.peek_interpreter_stack``: the innermost transform's
    interpreter). No public API tells whether code runs under a transform; a tensor's own flags do
    not either (``in_dims=None`` leaves an input unbatched inside ``vmap``). Checked against torch 2.13."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    if interpreter is None:
        return None
    kind = interpreter.key().name
    return {"Vmap": "torch.vmap", "Grad": "torch.func.grad (or vjp, jacrev)",
            "Jvp": "torch.func.jvp (or jacfwd)", "Functionalize": "torch.func.functionalize"}.get(kind, kind)


def unsafe_view(t: Tensor, shape) -> Tensor:
    """``t``'s memory as a tensor of ``shape`` that autograd does not treat as a view
    (``aten._unsafe_view``: no copy, a version counter of its own). ``view``/``reshape`` return
    views, ``clone`` copies; nothing public returns the same memory un-viewed. Checked against
    torch 2.13."""
    return torch.ops.aten._unsafe_view(t, shape)


def tensor_version(t: Tensor) -> int:
    """``t``'s version counter (``Tensor._version``): bumped by every in-place change, so that a
    cached result computed from ``t`` can tell it is stale. No public API exposes it. Checked
    against torch 2.13."""
    return t._version


def gradient_hooks(t: Tensor) -> list:
    """The hooks registered on the leaf ``t`` by ``t.register_hook`` and
    ``t.register_post_accumulate_grad_hook`` (``Tensor._backward_hooks``,
    ``Tensor._post_accumulate_grad_hooks``): no public API lists them. Checked against torch 2.13."""
    return [*(getattr(t, "_backward_hooks", None) or {}).values(),
            *(getattr(t, "_post_accumulate_grad_hooks", None) or {}).values()]


def foreach_mul_(tensors: list[Tensor], scalars: list[float]) -> None:
    """``tensors[j] *= scalars[j]`` in one multi-tensor kernel (``torch._foreach_mul_``, as torch's
    optimizers use it). The public per-tensor ``mul_`` computes the same values with one kernel
    launch (and a host-side dispatch) per tensor. Checked against torch 2.13."""
    torch._foreach_mul_(tensors, scalars)


def foreach_add_(tensors: list[Tensor], others: list[Tensor]) -> None:
    """``tensors[j] += others[j]`` in one multi-tensor kernel (``torch._foreach_add_``; same reason
    as :func:`foreach_mul_`). Checked against torch 2.13."""
    torch._foreach_add_(tensors, others)


# --- modules ---------------------------------------------------------------------------------

#: an ``nn.Module``'s own dicts of forward hooks (the user's and the engine's)
_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameter dict by attribute name (``module._parameters``, live: read it,
    never write it), a registered ``None`` included. ``named_parameters(recurse=False)`` builds
    a generator and skips ``None``, ``get_parameter`` walks a dotted path: a book-kept call reads
    its parameters at every call, where a dict lookup is what the host's time allows. Checked
    against torch 2.13."""
    return module._parameters


def functional_call_restoring(module: nn.Module, tensors: dict, args, kwargs=None, **options):
    """``torch.func.functional_call`` that leaves every submodule holding the parameter objects it
    held before. torch 2.13 swaps a parameter in and back by name: one that two modules reach
    through a shared ``nn.ParameterDict`` (peft's trainable tokens on tied input and output
    embeddings) came back as the plain tensor swapped in, so the model went on reading a copy the
    optimizer never steps. Each module's own parameter dict is put back as it was."""
    held = [(m, dict(m._parameters)) for m in module.modules()]
    try:
        return torch.func.functional_call(module, tensors, args, kwargs, **options)
    finally:
        for m, before in held:
            for name, p in before.items():
                if m._parameters.get(name) is not p:
                    m._parameters[name] = p


def saved_buffers(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``module``'s own buffers that its ``state_dict`` saves (``Module._buffers`` less
    ``_non_persistent_buffers_set``), without running ``state_dict`` (its hooks gather sharded
    tensors, and it walks the whole tree): cheap enough for every forward. Checked against torch 2.13."""
    for key, t in module._buffers.items():
        if t is not None and key not in module._non_persistent_buffers_set:
            yield key, t


@contextmanager
def forward_hooks_silenced(model: nn.Module, keep: Iterable = ()) -> Iterator[None]:
    """Inside, no forward hook of any module of ``model`` runs (the user's, the engine's own), but
    those whose handles are in ``keep``; each module's hook dicts are put back after, in their
    order. torch offers a handle's ``remove()`` only: removing and registering again would change
    the hooks' order and ids, and no public switch turns hooks off. Global hooks
    (``register_module_forward_hook``) are left alone. Checked against torch 2.13."""
    kept = {h.id for h in keep}
    saved = []
    for m in model.modules():
        for name in _FORWARD_HOOK_DICTS:
            hooks = getattr(m, name, None)
            if hooks:
                saved.append((m, name, hooks))
                setattr(m, name, type(hooks)((k, v) for k, v in hooks.items() if k in kept))
    try:
        yield
    finally:
        for m, name, hooks in saved:
            setattr(m, name, hooks)


def qkv_packed(attention: nn.MultiheadAttention) -> bool:
    """Whether an ``nn.MultiheadAttention`` keeps its query, key and value projections in one
    ``in_proj_weight`` (``_qkv_same_embed_dim``: key and value of the embedding's size), as its
    own forward decides. The module has no public attribute for it. Checked against torch 2.13."""
    return attention._qkv_same_embed_dim


def conv_pad_widths(conv: nn.Module) -> tuple[int, ...]:
    """The ``F.pad`` widths a convolution with a ``padding_mode`` other than "zeros" pads its
    input by before convolving unpadded (``_reversed_padding_repeated_twice``: last dimension
    first, each side), as its own forward does. The public ``padding`` may be a string ("same")
    whose widths the module computed at construction. Checked against torch 2.13."""
    return conv._reversed_padding_repeated_twice


def parametrization_cache() -> dict:
    """The dict in which ``torch.nn.utils.parametrize.cached()`` keeps each parametrized tensor,
    keyed by ``(id(module), name)`` (``parametrize._cache``). Read it anew inside each ``cached()``
    block: torch replaces the dict when the outermost block ends. The public ``cached()`` only
    fills it lazily; nothing public puts a given value there. Checked against torch 2.13."""
    return parametrize._cache


@contextmanager
def parametrizations_uncached() -> Iterator[None]:
    """Inside, every read of a parametrized tensor evaluates its parametrization anew, even within
    a user's ``parametrize.cached()`` block; the cache and its depth are put back on leaving. A probe
    or a certificate replay runs in the middle of the training forward: under ``cached()`` it would
    read the training forward's W (a replay's own originals never reached) or leave its own W for
    the training forward to read (its backward running into the probe's graph). torch has no
    public switch (``parametrize._cache_enabled``, ``parametrize._cache``). Checked against torch 2.13."""
    depth, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = depth, cache


def canonical_attention_masks(key_padding_mask: Tensor | None, attn_mask: Tensor | None,
                              dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """``nn.MultiheadAttention``'s own conversion of its two masks to float masks of ``dtype``
    (bool -> -inf, checked against each other), as its forward does (``F._canonical_mask``,
    ``F._none_or_dtype``): so that a mask means the same in a rule's recomputation as in the
    module. No public function does it. Checked against torch 2.13."""
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
        target_type=dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                  other_name="", target_type=dtype, check_other=False)
    return key_padding_mask, attn_mask


@contextmanager
def reentrant_checkpoints_inline(seen: Callable[[tuple], None] | None = None) -> Iterator[None]:
    """Inside, a reentrant ``torch.utils.checkpoint`` block (``use_reentrant=True``) runs as a
    plain call of its function: ``CheckpointFunction.apply`` is replaced for the duration, in
    the whole process (every thread), and put back after. torch has no switch that runs such a
    block inline, and its ``apply`` differentiates only by a ``.backward()`` into the block's
    own parameters, which ``torch.autograd.grad`` on other leaves refuses. ``seen``, if given, is
    called with each block's arguments first. Checked against torch 2.13."""
    from torch.utils.checkpoint import CheckpointFunction
    own = "apply" in CheckpointFunction.__dict__
    kept = CheckpointFunction.__dict__.get("apply")

    def inline(function, _preserve_rng, *args):
        if seen is not None:
            seen(args)
        return function(*args)
    CheckpointFunction.apply = staticmethod(inline)
    try:
        yield
    finally:
        if own:
            CheckpointFunction.apply = kept
        else:
            del CheckpointFunction.apply


# --- process-wide state ----------------------------------------------------------------------


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now (docs/distributed.md: imported after the process group exists,
    it keeps a reference to the group that ``destroy_process_group`` cannot drop). It has no public
    module to import instead, and ``torch.compile`` imports it only when first called. Checked
    against torch 2.13."""
    import torch._dynamo  # noqa: F401


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches: sharding propagation (Python and C++), the redistribution planners
    and transform plans, the meshes' topologies. Their entries hold device meshes, and through
    them the process group (``dpclip.distributed.world`` clears them before the group goes).
    torch has no public call that clears them; each private name is looked up and skipped where
    this torch has no such cache. Call only once ``torch.distributed.tensor`` is imported.
    Checked against torch 2.13."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    from torch.distributed.tensor import _redistribute  # its planners and transform plans, per mesh
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()
    from torch.distributed.tensor import _collective_utils  # the meshes' topologies (cost estimates)
    topology = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if hasattr(topology, "cache_clear"):
        topology.cache_clear()


def graph_breaks(fn, *args, autograd_traced: bool = False) -> tuple[int, int, list[tuple[str, str, int]]]:
    """(graphs, graph breaks, [(reason, file, line)]) of ``torch.compile`` tracing one call
    ``fn(*args)``, by ``torch._dynamo.explain``; the compiled code is dropped afterwards
    (``torch._dynamo.reset``), so nothing compiled outlives the measure. ``torch.compile``'s
    public API raises at the first break (``fullgraph=True``) or prints them (``TORCH_LOGS``);
    only ``explain`` lists them all with where they happen. ``autograd_traced``: as
    :func:`compile_fullgraph` traces, ``torch.autograd.grad`` inside the graph. Checked against torch 2.13."""
    import logging

    import torch._dynamo as dynamo

    quiet = logging.getLogger("torch._dynamo")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its warnings repeat the breaks this returns
    try:
        dynamo.reset()
        with dynamo.config.patch(trace_autograd_ops=autograd_traced):
            explained = dynamo.explain(fn)(*args)
    finally:
        dynamo.reset()
        quiet.setLevel(level)
    reasons = []
    for item in explained.break_reasons:
        frame = item.user_stack[-1] if item.user_stack else None
        reasons.append((str(item.reason).splitlines()[0], frame.filename if frame else "?",
                        frame.lineno if frame else 0))
    return explained.graph_count, explained.graph_break_count, reasons


def compile_fullgraph(fn, backend: str = "inductor", cuda_graphs: bool = False):
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` with ``torch.autograd.grad`` traced
    into the graph (``torch._dynamo.config.trace_autograd_ops``: off by default, so a call to it
    breaks the graph; the compiled micro-batch's backward is one such call) and, under inductor,
    random operations (dropout) drawn as eager draws them (``fallback_random``), so that a compiled
    micro-batch and the engine's eager one on the same rows and generator state see the same
    masks, and modules' hooks guarded (``skip_nnmodule_hook_guards`` off: torch's default would keep
    using a cached graph, run without a hook registered since; guarded, a new graph is compiled, and
    checked by the compiled step before use). ``cuda_graphs``: inductor also records the graph as a
    CUDA graph (``mode="reduce-overhead"``'s setting; ``mode`` and ``options`` cannot both be given),
    replayed with one launch. Checked against torch 2.13."""
    import torch._dynamo.config as dynamo_config

    options = ({"fallback_random": True, **({"triton.cudagraphs": True} if cuda_graphs else {})}
               if backend == "inductor" else None)
    compiled = torch.compile(own_code(fn), fullgraph=True, dynamic=False, backend=backend, options=options)
    limit = max(COMPILED_SHAPES_LIMIT, dynamo_config.recompile_limit)

    def run(*args):
        with dynamo_config.patch(trace_autograd_ops=True, recompile_limit=limit, skip_nnmodule_hook_guards=False):
            return compiled(*args)
    return run


#: graphs (batch shapes) one :func:`compile_fullgraph` function may compile; torch's default
#: recompile limit, 8, is reached by a Trainer's batches padded to their longest sequence
COMPILED_SHAPES_LIMIT = 64


def own_code(fn):
    """``fn`` (a function or bound method) with a code object of its own: torch.compile keeps its
    graphs, and counts them against its recompile limit, per code object, so two compiled
    micro-batches (two models in one process) would otherwise share one count."""
    bound = getattr(fn, "__self__", None)
    plain = getattr(fn, "__func__", fn)
    copy = types.FunctionType(plain.__code__.replace(), plain.__globals__, plain.__name__, plain.__defaults__,
                              plain.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = plain.__kwdefaults__, plain.__qualname__
    return copy if bound is None else types.MethodType(copy, bound)


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (dynamo's own count,
    ``counters["stats"]["unique_graphs"]``): a call that moves it compiled a new graph (a first
    shape, or a guard that changed: a Python flag the forward reads). Checked against torch 2.13."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def recompile_limit_hit(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.compile's refusal to compile one more graph of a function."""
    return type(exc).__name__ == "FailOnRecompileLimitHit"


def zero_draws_cpu_state(state: Tensor) -> Tensor | None:
    """Torch's CPU random ``state`` with its 624 Mersenne Twister words zero and no cached normal
    sample: every draw is then 0 (rand, randn, randint at its low, bernoulli 1 where p > 0), so a
    draw over the whole batch no longer moves with the count (the collate check, integrations/collate.py).
    The layout of the state is torch's own, not public (CPUGeneratorImpl.cpp, THGeneratorStateNew;
    checked against 2.13): None where it differs, as tried by drawing."""
    if state.numel() != 5056:
        return None
    zeros = state.clone()
    zeros[24:5016] = 0      # the state words, after the seed, left, seeded and next fields
    zeros[5040:5044] = 0    # normal_is_valid
    zeros[5052] = 0         # is_next_float_normal_sample_valid
    current = torch.get_rng_state()
    try:
        torch.set_rng_state(zeros)
        drawn = torch.cat([torch.rand(8), torch.randn(40), torch.randn(3, dtype=torch.float64).float()])
    except RuntimeError:
        return None
    finally:
        torch.set_rng_state(current)
    return zeros if not drawn.any() else None
