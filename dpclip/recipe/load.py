"""Load a recipe from YAML, apply ``key=value`` overrides, validate, explain errors.

Every error is a :class:`RecipeError` naming the dotted path of the bad field and what
is allowed there, e.g. ``clipping.threshold.kind: 'dcsgd_x' is not one of fixed,
quantile, dcsgd-p, dcsgd-e, discriminative``.
"""

from __future__ import annotations

import copy
import difflib
import os.path
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dpclip.errors import RecipeError
from dpclip.recipe.schema import Recipe, annotation_now
from dpclip.recipe.shipped import shipped_names


_MERGE_TAG = "tag:yaml.org,2002:merge"

#: the hint for YAML nested deeper than Python's parser recurses (thousands of brackets: not a recipe)
_TOO_DEEP_HINT = "a recipe is a few levels of sections; check for unclosed or repeated [ and { brackets"
_DEEPEST_KEY = 32


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping: YAML keeps the last silently,
    and a doubled ``privacy.epsilon`` would go unnoticed."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:   # `<<: *anchor`: YAML's merge key, whose keys this mapping may override
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                given_twice = key in seen
            except TypeError:   # a list or mapping as a key: SafeLoader refuses it below, with its line
                continue
            if given_twice:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice in one section",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a plain mapping; missing files and bad YAML are RecipeErrors."""
    path = Path(path)
    if not path.exists():
        hint = "check the path"
        other = next((p for p in (path.with_suffix(".yaml"), path.with_suffix(".yml"))
                      if path.suffix in (".yaml", ".yml", "") and p != path and p.is_file()), None)
        if other is not None:   # quickstart.yml for quickstart.yaml
            raise RecipeError(f"recipe file not found: {path}", f"did you mean {other}?")
        if path.stem in shipped_names():
            copy = f"`dpclip recipes copy {path.stem} .`, then use {path.stem}.yaml"
            if path.parent.name == "recipes" and not path.parent.is_dir():   # recipes/NAME.yaml outside the root
                hint = (f"'{path.stem}' is a shipped recipe, but this folder has no recipes/ folder of the "
                        f"repository: run from its root, or {copy}")
            else:
                hint = f"'{path.stem}' is a shipped recipe: use recipes/{path.stem}.yaml or {copy}"
        elif path.suffix not in (".yaml", ".yml"):   # a run directory's name, mistyped or gone
            raise RecipeError(f"no run directory or recipe file at {path}",
                              "a run directory is a folder `dpclip train` created (under the recipe's output_dir, "
                              "runs/ by default: list it); a recipe is a .yaml file (`dpclip recipes list`)")
        else:
            hint += "; `dpclip recipes list` shows the shipped recipes"
        raise RecipeError(f"recipe file not found: {path}", hint)
    if path.is_dir():
        raise RecipeError(f"{path} is a directory, not a recipe file", "pass a .yaml recipe file")
    if not path.is_file():   # a device or a pipe (/dev/zero, a FIFO): read to its end, it might never end
        raise RecipeError(f"{path} is not a regular file", "pass a .yaml recipe file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read {path}: {exc}", "is it a UTF-8 text file?") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"{path} is not valid YAML{where}: {problem}",
                          "check indentation and quoting near that line") from None
    except RecursionError:
        raise RecipeError(f"{path} is nested too deeply to be read", _TOO_DEEP_HINT) from None
    if data is None:
        raise RecipeError(f"{path} is empty", "a recipe needs at least name, data, model, training, privacy")
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a mapping of sections, not a {type(data).__name__}",
                          "start from `dpclip recipes show quickstart`")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a path and a YAML-parsed value (``lr=0.05`` -> 0.05)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(f"override {text!r} is not of the form key=value",
                          "example: training.optimizer.lr=0.05")
    if key.count(".") >= _DEEPEST_KEY:   # a recipe is a few sections deep; thousands of levels crashed the loader
        raise RecipeError(f"override {key[:40]}...=: its key is nested too deeply ({key.count('.') + 1} levels)",
                          _TOO_DEEP_HINT)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise RecipeError(f"override {key}=...: its value is nested too deeply to be read", _TOO_DEEP_HINT) from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key=value`` set (sections are created as needed)."""
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise RecipeError(f"override {text!r}: {where} is a value, not a section",
                                  f"set {where}=... directly")
            node = child
        node[path[-1]] = value
    return data


def validate_recipe(data: dict[str, Any], source: str = "recipe", overrides: list[str] = ()) -> Recipe:
    """The validated recipe; an error names where each problem came from: ``source`` (the file), or
    the ``key=value`` override that set the field."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        lines = [_located(err, data, source, overrides) for err in exc.errors()]
        first, rest = lines[0], lines[1:]
        message = first
        if rest:
            message += "\n" + "\n".join(f"  also: {line}" for line in rest)
        raise RecipeError(message, "see docs/recipes.md for every field, its type and default") from None


def _located(err: dict[str, Any], data: dict[str, Any], source: str, overrides: list[str]) -> str:
    """One problem and where it came from: the file (``source: problem``), or a ``key=value``
    override (``problem (from your key=value override, not source)``): the field's path names the key."""
    origin, text = _origin(err, data, source, overrides), explain_error(err, data)
    if origin == source:
        return f"{source}: {text}"
    return f"{text} (from your key=value override, not {Path(source).name})"


def _origin(err: dict[str, Any], data: dict[str, Any], source: str, overrides: list[str]) -> str:
    """"override" when a key=value override set the error's field or a section above it, else ``source``."""
    where = [str(part) for part in _clean_location(err["loc"], data)]
    for text in reversed(list(overrides)):
        key = text.partition("=")[0].strip().split(".")
        if where[:len(key)] == key or key[:len(where)] == where and where:
            return "override"
    return source


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override, resolve paths and validate a recipe file (docs/recipes.md, "Paths").

    Relative paths written in the file are resolved against the file's directory; relative
    paths given in ``key=value`` overrides against the current directory (where they were
    typed). The validated recipe therefore holds absolute paths, and so does the
    ``recipe.yaml`` a run saves, so its run directory works from any directory.
    """
    return validate_recipe(read_recipe_data(path, overrides), source=str(path), overrides=overrides or [])


def read_recipe_data(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The mapping :func:`load_recipe` validates: the file's paths resolved against its
    directory, then the overrides applied, their paths resolved against the current one."""
    data = resolve_paths(read_yaml(path), Path(path).resolve().parent)
    return resolve_paths(apply_overrides(data, overrides or []), Path.cwd())


def _resolve_path(value: Any, base: Path, *, always: bool) -> Any:
    """``value`` made absolute against ``base``: always (a field that can only be a path), or
    only when it is explicitly relative (./x, ../x) or exists under ``base`` (a field that
    may also name something in the Hugging Face cache, e.g. ``tokenizer: gpt2``)."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if always or value.startswith(("./", "../")) or (base / path).exists():
        return os.path.normpath(base / path)
    return value


#: (section, field, always) of every recipe field that names a local path; see _resolve_path.
PATH_FIELDS = (("data", "train", True), ("data", "test", True), ("data", "tokenizer", False),
               ("model", "pretrained", False), ("model", "module_dir", True),
               ("public", "train", True), ("public", "test", True), ("public", "tokenizer", False))


def resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of a recipe mapping with its relative paths resolved against ``base`` (see
    :data:`PATH_FIELDS`; ``data.name`` of ``source: hf`` too when it is a local folder).
    A custom model's ``module_dir`` defaults to ``base``: the factory's module may sit
    beside the recipe (docs/recipes.md, "Paths")."""
    data = copy.deepcopy(data)
    for section_name, field_name, always in PATH_FIELDS:
        section = data.get(section_name)
        if isinstance(section, dict) and field_name in section:
            section[field_name] = _resolve_path(section[field_name], base, always=always)
    for section_name in ("data", "public"):
        source = data.get(section_name)
        if isinstance(source, dict) and source.get("source") == "hf" and "name" in source:
            source["name"] = _resolve_path(source["name"], base, always=False)
    model = data.get("model")
    if isinstance(model, dict) and model.get("kind") == "custom" and model.get("module_dir") is None:
        model["module_dir"] = str(base)
    return data


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe (defaults filled in), as YAML a user can read and reload."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


# ----------------------------------------------------------- error explanations

_TAG_FIELDS = ("kind", "source")


def _clean_location(loc: tuple[Any, ...], data: Any) -> list[Any]:
    """Drop the discriminator tags pydantic inserts into the location of union members."""
    path: list[Any] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part not in node and any(node.get(t) == part for t in _TAG_FIELDS):
            continue  # a union tag such as 'fixed' in clipping.threshold.fixed.value
        if isinstance(part, str) and part.startswith(("function-", "tagged-union[", "literal[")):
            continue
        path.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return path


def _dotted(path: list[Any]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "recipe"


def _model_at(path: list[Any], data: Any) -> type[BaseModel] | None:
    """The schema class that owns the mapping at ``path`` (to list its allowed keys)."""
    model: Any = Recipe
    node = data
    for part in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        model = _resolve(model.model_fields[part].annotation, node.get(part) if isinstance(node, dict) else None)
        node = node.get(part) if isinstance(node, dict) else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _resolve(annotation: Any, value: Any) -> Any:
    """Pick the model class of a (possibly Optional / discriminated-union) annotation."""
    annotation = annotation_now(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _resolve(typing.get_args(annotation)[0], value)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        candidates = [a for a in typing.get_args(annotation) if a is not type(None)]
        models = [a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)]
        for model in models:
            for tag in _TAG_FIELDS:
                field = model.model_fields.get(tag)
                if field is not None and isinstance(value, dict) and value.get(tag) in typing.get_args(field.annotation):
                    return model
        return models[0] if len(models) == 1 else None
    return annotation


def explain_error(err: dict[str, Any], data: dict[str, Any]) -> str:
    path = _clean_location(err["loc"], data)
    where = _dotted(path)
    kind = err["type"]
    given = err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        owner = _model_at(path[:-1], data)
        allowed = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
        text = f"{where}: unknown key"
        if close:
            text += f" (did you mean '{close[0]}'?)"
        if allowed:
            text += f"; allowed keys: {', '.join(allowed)}"
        return text
    if kind == "union_tag_invalid":
        tags = ", ".join(t.strip(" '") for t in str(ctx.get("expected_tags", "")).split(","))
        field = ctx.get("discriminator", "kind").strip("'")
        return f"{where}.{field}: {ctx.get('tag')!r} is not one of {tags}"
    if kind == "union_tag_not_found":
        field = ctx.get("discriminator", "kind").strip("'")
        return f"{where}: missing '{field}' (which variant this section is)"
    if kind == "literal_error":
        allowed = ", ".join(str(v).strip(" '") for v in str(ctx.get("expected", "")).replace(" or ", ", ").split(","))
        return f"{where}: {given!r} is not one of {allowed}"
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{where}: expected a mapping of fields, got {type(given).__name__} {given!r}"
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if message.startswith("."):  # a section's check on one of its fields (recipe/section.py)
        return f"{where}{message}" if path else message[1:]
    if given is not None and not isinstance(given, (dict, list)) and kind != "value_error":
        return f"{where}: {message} (got {given!r})"
    return message if not path else f"{where}: {message}"
