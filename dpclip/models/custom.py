"""Your own model (``model.kind: custom``): ``target: "package.module:factory"``.

The factory is imported with importlib (its module looked for in ``model.module_dir`` first,
the recipe file's directory unless given: docs/recipes.md, "Paths") and called with ``model.kwargs``; it also gets
``input_shape`` and ``num_classes`` from the data when its signature names them (and
the recipe's kwargs do not). The loss is "cross-entropy", "mse", or
``"package.module:fn"`` with ``fn(outputs, labels) -> Tensor[b]`` (one loss per example).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from contextlib import contextmanager

from torch import nn

from dpclip.errors import DpclipError
from dpclip.models.losses import CustomCriterion, cross_entropy, squared_error

BUILTIN_LOSSES = {"cross-entropy": cross_entropy, "mse": squared_error}

# Values from the data a factory may ask for by naming them as parameters.
DATA_ARGUMENTS = ("input_shape", "num_classes")


@contextmanager
def _searched_first(directory: str | None):
    """``directory`` at the front of ``sys.path`` while the block runs, and only then (a
    module that imports its siblings later, inside a function, needs them on PYTHONPATH)."""
    if directory is None:
        yield
        return
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        try:
            sys.path.remove(directory)
        except ValueError:
            pass


def import_target(target: str, what: str, module_dir: str | None = None):
    """The object named by ``"package.module:attribute"``, or a DpclipError saying why not;
    the module is looked for in ``module_dir`` first when given."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise DpclipError(f"{what} {target!r} is not of the form 'package.module:name'",
                          "e.g. model.target: mypackage.models:make_net")
    try:
        with _searched_first(module_dir):
            module = importlib.import_module(module_name)
    except ImportError as exc:
        where = f"in {module_dir} (model.module_dir)" if module_dir else "beside the recipe file"
        raise DpclipError(f"cannot import {what} {target!r}: {exc}",
                          f"put {module_name.replace('.', '/')}.py {where}, or install the module or put it on "
                          "PYTHONPATH") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        public_names = [name for name in dir(module) if not name.startswith("_")]
        raise DpclipError(f"module {module_name!r} has no {attribute!r} (the {what} {target!r})",
                          f"check the name after the colon; the module defines: "
                          f"{', '.join(public_names[:12])}{', ...' if len(public_names) > 12 else ''}") from None


def _signature(factory) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None  # some builtins have none: the call itself will decide


def build_custom(config, data) -> nn.Module:
    """Import and call the factory; the result must be a torch ``nn.Module``."""
    factory = import_target(config.target, "model factory", config.module_dir)
    if not callable(factory):
        raise DpclipError(f"model.target {config.target!r} is not callable", "point it at a function or class")
    kwargs = dict(config.kwargs)
    signature = _signature(factory)
    if signature is not None:
        for name in DATA_ARGUMENTS:
            if name in signature.parameters and name not in kwargs:
                kwargs[name] = getattr(data, name)
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise DpclipError(f"model factory {config.target!r} does not accept the arguments "
                              f"{sorted(kwargs)}: {exc}",
                              "check model.kwargs against the factory's parameters") from None
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise DpclipError(f"model factory {config.target!r} returned {type(model).__name__}, not a torch nn.Module",
                          "return an nn.Module from the factory")
    return model


def custom_criterion(loss: str, data, module_dir: str | None = None):
    """The criterion for ``model.loss``: a builtin name or an imported per-sample function."""
    if loss == "cross-entropy" and data.task != "classification":
        raise DpclipError(f"model.loss 'cross-entropy' needs class labels, but the data is {data.task}",
                          "use model.loss: mse for regression")
    if loss in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[loss]
    if ":" not in loss:
        raise DpclipError(f"model.loss {loss!r} is unknown", "use cross-entropy, mse, or 'package.module:fn'")
    fn = import_target(loss, "loss function", module_dir)
    if not callable(fn):
        raise DpclipError(f"model.loss {loss!r} is not callable", "point it at a function fn(outputs, labels)")
    return CustomCriterion(fn, loss)
