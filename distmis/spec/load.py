"""Load a search spec from YAML, apply ``--set`` overrides, validate it, and explain what is wrong.

Everything here runs before any trial starts and writes nothing: a bad spec costs the user a
clear message, never a half-started search.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from distmis.models.registry import MODELS, PARALLELISM_NAMES, model_entry
from distmis.spec.searchers import PBT_MUTABLE, algorithm_entry
from distmis.spec.curriculum import TrainingStage, training_stages
from distmis.perf.partition import check_sequence_parallel
from distmis.perf.partition import token_grid
from distmis.spec.schema import ModelSpec, Spec, unknown_argument

# Sections whose values may be searched. The dataset is converted once per search, so its
# fields are fixed; parallelism and tracking describe the search itself, not a trial.
SEARCHABLE_SECTIONS = ("model", "training", "parallelism.sequence_parallel", "parallelism.pipeline")


def is_searchable(path: str) -> bool:
    return any(path == section or path.startswith(f"{section}.") for section in SEARCHABLE_SECTIONS)


#: A SpecError's message lists at most this many problems (the rest are counted), each line at most
#: MAX_LINE_CHARACTERS long, and shows a value's repr up to MAX_VALUE_CHARACTERS: whatever a spec holds (10^5 unknown
#: keys, a grid value of megabytes), its error stays a screenful.
MAX_LISTED_PROBLEMS = 20
MAX_LINE_CHARACTERS = 1000
MAX_VALUE_CHARACTERS = 200


def clipped(text: str, limit: int = MAX_LINE_CHARACTERS) -> str:
    """``text`` whole if it has at most ``limit`` characters; else its start and end around how long it is, so that
    a line keeps both the field it names and what is allowed."""
    if len(text) <= limit:
        return text
    tail = limit // 4
    return f"{text[:limit - tail]} ... ({len(text):,} characters) ... {text[-tail:]}"


def shown(value: Any, limit: int = MAX_VALUE_CHARACTERS) -> str:
    """A value as an error message shows it: its repr, cut after ``limit`` characters with its length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class SpecError(ValueError):
    """A search spec is invalid. ``problems`` holds ``(field path, message)`` pairs, all of them; the message lists
    the first :data:`MAX_LISTED_PROBLEMS`, each line cut to :data:`MAX_LINE_CHARACTERS`."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [clipped(f"invalid search spec {source}:")]
        listed = problems[:MAX_LISTED_PROBLEMS]
        lines += [clipped(f"  - {path or '<top level>'}: {message}") for path, message in listed]
        if len(problems) > len(listed):
            lines.append(f"  ... and {len(problems) - len(listed):,} more problem(s) ({len(problems):,} in all)")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple:  # picklable, so a trial's SpecError reaches the driver with its message
        return (type(self), (self.source, self.problems))


# --------------------------------------------------------------------------- dotted paths
def set_path(tree: dict[str, Any], path: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``path="a.b.c"``, creating missing mappings."""
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def with_overrides(tree: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of ``tree`` with each dotted path in ``overrides`` set."""
    out = copy.deepcopy(dict(tree))
    for path, value in overrides.items():
        set_path(out, path, value)
    return out


def parse_set_options(items: Iterable[str]) -> dict[str, Any]:
    """Parse CLI ``--set dotted.key=value`` items; values are YAML (``1e-3``, ``true``, ``[1,2]``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError("--set", [(item, "expected dotted.key=value, e.g. training.epochs=3")])
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise SpecError("--set", [(key.strip(), f"value {shown(raw)} is not valid YAML: {exc}")]) from None
        except RecursionError:
            raise SpecError("--set", [(key.strip(), f"value {shown(raw)} nests too deeply to read")]) from None
        why = too_large(out[key.strip()])
        if why:
            raise SpecError("--set", [(key.strip(), why)])
    return out


# --------------------------------------------------------------------------- errors
def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at ``loc`` (for listing allowed keys)."""
    model: Any = Spec
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        # Unwrap Optional[X] / X | None and dict[str, X].
        args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif args and isinstance(args[-1], type) and issubclass(args[-1], BaseModel):
            model = args[-1]
        else:
            model = None
    return model if isinstance(model, type) else None


def problems_from_validation_error(error: ValidationError) -> list[tuple[str, str]]:
    """Turn pydantic's errors into ``(path, message)`` with the bad value and what is allowed."""
    problems = []
    allowed_at: dict[tuple[Any, ...], str] = {}  # the allowed keys of a section, found once (10^5 unknown keys in one)
    for err in error.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        path = ".".join(str(p) for p in loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            if loc[:-1] not in allowed_at:
                owner = _model_at(loc[:-1])
                allowed_at[loc[:-1]] = ", ".join(owner.model_fields) if owner else "see docs/spec.md"
            message = f"unknown key {shown(str(loc[-1]))}; allowed keys here: {allowed_at[loc[:-1]]}"
        elif kind == "missing":
            message = "required field is missing"
        elif kind in ("unknown_argument", "unknown_model"):  # the model's params: the message names what is allowed
            message = err["msg"]
        else:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and kind != "model_type":
                message += f" (got {shown(err['input'], limit=80)})"
        problems.append((path, message))
    return problems


# --------------------------------------------------------------------------- loading
#: The most values (mappings, lists, keys and scalars) a spec may hold with its YAML aliases expanded. A real spec
#: holds hundreds; the cap refuses an alias bomb (a few lines whose aliases of aliases expand to billions of values)
#: before anything walks it.
MAX_SPEC_VALUES = 1_000_000


def _safe_loader() -> type:
    """``yaml.safe_load``'s loader with its scanning and parsing in C where PyYAML has libyaml: the same safe
    constructors, the nodes composed in Python as ``yaml.safe_load`` composes them, four times faster on a large
    spec. (libyaml's own composer, ``yaml.CSafeLoader``'s, recurses in C: a document nested 50,000 deep, 100 kB
    of ``- - - ...``, crashes the process; Python's composer raises RecursionError.)"""
    if not getattr(yaml, "__with_libyaml__", False):
        return yaml.SafeLoader
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.cyaml import CParser
    from yaml.resolver import Resolver

    class SafeLoader(Composer, CParser, SafeConstructor, Resolver):  # Composer's methods before CParser's
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    return SafeLoader


SAFE_LOADER = _safe_loader()


def expanded_size(tree: Any, limit: int = MAX_SPEC_VALUES) -> int:
    """How many values ``tree`` holds with every YAML alias expanded: a mapping, list or scalar counts one, a
    mapping's keys count too, and a list or mapping that several places refer to (an alias) counts at each of them.
    Each shared object is walked once, so a bomb costs no more than its text. Stops counting above ``limit``
    (returning a number above it). ValueError when a list or mapping holds itself (a recursive alias)."""
    sizes: dict[int, int] = {}  # id -> expanded size, of the lists and mappings done
    started: set[int] = set()  # the lists and mappings whose children are being counted: the current path
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        key = id(node)
        children = list(node.values()) if isinstance(node, dict) else node
        if children_done:
            size = 1 + (len(node) if isinstance(node, dict) else 0)
            size += sum(sizes[id(c)] if isinstance(c, (dict, list)) else 1 for c in children)
            if size > limit:
                return size
            sizes[key] = size
            started.discard(key)
        elif key in started:
            raise ValueError("a list or mapping holds itself (a recursive YAML alias)")
        elif key not in sizes:
            started.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children)
    return sizes.get(id(tree), 1)


def too_large(tree: Any) -> str | None:
    """Why a value read from YAML is refused before it is validated (None: it is not): it holds itself, or more than
    :data:`MAX_SPEC_VALUES` values once its aliases are expanded."""
    try:
        size = expanded_size(tree)
    except ValueError as exc:
        return f"{exc}: a spec is a tree of values"
    if size > MAX_SPEC_VALUES:
        return (f"holds more than {MAX_SPEC_VALUES:,} values once its YAML aliases (*name) are expanded: a spec "
                "holds hundreds; write the values out, or refer to fewer")
    return None


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML spec safely; ``SpecError`` if missing, unparsable, not a mapping, or too large once its aliases are
    expanded (:func:`too_large`)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(str(path), [("", "file not found")])
    try:
        tree = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise SpecError(str(path), [("", f"not valid YAML: {exc}")]) from None
    except RecursionError:
        raise SpecError(str(path), [("", "its lists or mappings nest too deeply to read")]) from None
    if not isinstance(tree, dict):
        raise SpecError(str(path), [("", f"must be a YAML mapping, got {type(tree).__name__}")])
    why = too_large(tree)
    if why:
        raise SpecError(str(path), [("", why)])
    return tree


def validate_spec(tree: Mapping[str, Any], source: str = "<spec>") -> Spec:
    """Validate a spec mapping: field types, then the cross-field rules of ``check_spec``."""
    try:
        spec = Spec.model_validate(dict(tree))
    except ValidationError as exc:
        raise SpecError(source, problems_from_validation_error(exc)) from None
    problems = check_spec(spec)
    if problems:
        raise SpecError(source, problems)
    return spec


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Spec:
    """Read, override and validate a spec file. The one entry point the CLI uses."""
    tree = with_overrides(read_spec_file(path), overrides or {})
    return validate_spec(tree, source=str(path))


def spec_to_dict(spec: Spec) -> dict[str, Any]:
    """The fully resolved spec (defaults filled in) as plain YAML-able data."""
    return spec.model_dump(mode="json")


def default_output_dir(spec: Spec) -> Path:
    """Where a search writes by default: ``runs/<name>`` (``$DISTMIS_OUTPUT/<name>``)."""
    return Path(os.environ.get("DISTMIS_OUTPUT", "runs")) / spec.name


def spec_to_yaml(spec: Spec) -> str:
    return yaml.safe_dump(spec_to_dict(spec), sort_keys=False)


# --------------------------------------------------------------------------- cross-field rules
def volume_shape(spec: Spec) -> tuple[int, int, int] | None:
    """The shape every case has after preprocessing, when the spec determines it (or, on a :func:`with_volume` copy,
    the data set on disk does)."""
    data = spec.dataset
    if data.resize is not None:
        return data.resize
    if data.crop is not None:
        return data.crop
    if spec._volume is not None:
        return spec._volume[0]
    if data.synthetic is not None and not Path(data.path).exists():
        return data.synthetic.shape
    return None


def with_volume(spec: Spec, shape: Sequence[int], source: str) -> Spec:
    """A copy of ``spec`` whose cases have the preprocessed ``shape`` (``source``: where it comes from, for
    messages), for a data set on disk whose shape no field fixes (no ``dataset.crop`` or ``resize``): its checks
    (:func:`check_spec`) then hold every whole-volume input a trial may take, each searched network's and each
    curriculum stage's, to the network's input rule, as they do for a volume the spec fixes."""
    known = spec.model_copy(deep=True)
    known._volume = (tuple(int(s) for s in shape), source)  # type: ignore[assignment]
    return known


def _volume_field(spec: Spec) -> str:
    """The field (or, for a volume only the data set fixes, the tile that leaves it the input) to change for another
    whole volume, in a message."""
    data = spec.dataset
    if data.resize is not None:
        return "dataset.resize"
    if data.crop is not None:
        return "dataset.crop"
    return "training.tile (null: the whole volume)" if spec._volume is not None else "dataset.synthetic.shape"


def _of_volume(spec: Spec) -> str:
    """`` (where the volume comes from)`` for a volume the data set on disk fixes, else nothing."""
    data = spec.dataset
    return f" ({spec._volume[1]})" if spec._volume is not None and data.resize is None and data.crop is None else ""


def check_input_shape(spec: Spec, shape: tuple[int, int, int] | None = None) -> list[tuple[str, str]]:
    """The network input (tile, or whole volume) must fit the volume and divide by the pooling factor
    (U-Net) or the patch size (ViT)."""
    if spec.training.curriculum:
        return _per_stage(spec, lambda stage: check_input_shape(stage, shape))
    problems: list[tuple[str, str]] = []
    volume = shape or volume_shape(spec)
    factor = spec.model.input_multiple
    tile = spec.training.tile
    if tile is not None:
        if any(t % factor for t in tile):
            problems.append(
                ("training.tile", f"every dimension must divide by {factor} ({spec.model.input_rule}), "
                 f"got {list(tile)}")
            )
        if volume is not None and any(t > v for t, v in zip(tile, volume)):
            problems.append(
                ("training.tile", f"{list(tile)} is larger than the preprocessed volume {list(volume)}")
            )
    elif volume is not None and any(v % factor for v in volume):
        problems.append(
            (_volume_field(spec), f"the whole volume {list(volume)}{_of_volume(spec)} is the network input "
             f"(training.tile is null), so every dimension must divide by {factor} ({spec.model.name}: "
             f"{spec.model.input_rule}); crop/resize to such a shape or set training.tile")
        )
    network = tile if tile is not None else volume
    check = spec.model.entry.input_check
    if not problems and network is not None and check is not None:
        why = check(spec.model.params, tuple(network), spec.training.batch_size)  # type: ignore[arg-type]
        if why:
            where = "training.tile" if tile is not None else "training.tile (null: the whole volume)"
            of = "" if tile is not None else _of_volume(spec)
            problems.append((where, f"{spec.model.name} cannot train on {list(network)}{of}: {why}"))
    return problems


def stage_spec(spec: Spec, stage: TrainingStage) -> Spec:
    """``spec`` as one stage of its ``training.curriculum`` trains: ``training.tile``, ``batch_size`` and
    ``tile_sampling`` the stage's, no curriculum (``training.epochs`` stays the whole run's: the learning-rate
    schedule spans every stage). A spec without a curriculum is returned as it is. SpecError when the stage's
    values do not make a valid spec (a rotation that needs two equal sides of the tile, ...)."""
    if not spec.training.curriculum:
        return spec
    return apply_config(spec, {"training.curriculum": None, "training.tile": stage.tile,
                               "training.batch_size": stage.batch_size, "training.tile_sampling": stage.tile_sampling},
                        source=f"training.curriculum stage {stage.number}")


def _per_stage(spec: Spec, check: Callable[[Spec], list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """``check``'s problems with each stage of ``training.curriculum`` as a spec of its own (:func:`stage_spec`),
    each under ``training.curriculum[i]``."""
    problems: list[tuple[str, str]] = []
    for stage in training_stages(spec.training):
        where = f"training.curriculum[{stage.number - 1}]"
        try:
            trial = stage_spec(spec, stage)
        except SpecError as exc:
            problems += [(where, f"{path}: {message}") for path, message in exc.problems]
            continue
        problems += [(where, f"{path}: {message}") for path, message in check(trial)]
    return problems


def check_curriculum(spec: Spec) -> list[tuple[str, str]]:
    """A curriculum changes the input's size from stage to stage, and the inference comparison predicts whole
    volumes: a network built for one input size (its registry entry's ``fixed_input``: a position embedding sized
    to the tile) does neither."""
    entry = spec.model.entry
    if not entry.fixed_input:
        return []
    problems = []
    name = spec.model.name
    inputs = {stage.tile for stage in training_stages(spec.training)}
    if spec.training.curriculum and len(inputs) > 1:
        others = [f"'{n}'" for n, e in MODELS.items() if not e.fixed_input]
        problems.append(("training.curriculum", f"{name} is built for one input size (its position embedding is "
                                                f"sized to the tile), so its input cannot change from stage to stage: "
                                                f"a curriculum that changes the tile needs model.name "
                                                f"{', '.join(others[:-1])} or {others[-1]} (set training.tile for "
                                                f"{name} instead)"))
    if spec.training.inference.compare:
        problems.append(("training.inference.compare", f"{name} predicts only windows of its tile (it is built for "
                                                       "one input size), so it has no whole-volume inference to "
                                                       "compare: the comparison needs a network whose input may "
                                                       "change, such as model.name 'unet3d'"))
    return problems


def check_search_space(spec: Spec) -> list[tuple[str, str]]:
    """Search-space paths exist and are searchable; every value (or range end) gives a valid spec."""
    problems: list[tuple[str, str]] = []
    space = spec.search.space
    algorithm = algorithm_entry(spec.search.algorithm)
    problems += [(f"search.space.{path}", algorithm.refusal(domain.kind))
                 for path, domain in space.items() if domain.kind not in algorithm.domains]
    if problems:
        return problems

    base_problems = set(trial_problems(spec))  # reported once, not per value
    picks = searched_models(spec)
    for path, domain in space.items():
        where = f"search.space.{path}"
        if not is_searchable(path):
            problems.append((where, f"only fields under {', '.join(SEARCHABLE_SECTIONS)} can be searched "
                             "(the dataset is converted once per search)"))
            continue
        with_models: list[dict[str, Any]] = [{}]  # the model.name values each value is checked with
        if picks and path.startswith(f"{PARAMS_PATH}."):
            # a searched argument of the searched models: every model model.name picks must take it
            argument = path.removeprefix(f"{PARAMS_PATH}.")
            lacking = [name for name in picks if argument not in MODELS[name].params.model_fields]
            if lacking:
                problems.append((where, f"search.space.model.name picks {' and '.join(map(repr, lacking))}, which "
                                        f"take{'s' if len(lacking) == 1 else ''} no argument {argument!r}: a searched "
                                        "model.params field must be an argument of every model model.name picks "
                                        "(give a model's own params in model.per_model)"))
                continue
            section, field = MODELS[picks[0]].params, argument
            with_models = [{MODEL_NAME_PATH: name} for name in picks]
        else:
            try:
                section, field = _field_of(spec, path)
            except KeyError as missing:
                message = _missing(spec, path, missing.args[0])
                if message.startswith("no field"):
                    message += "; see docs/spec.md for the fields"
                problems.append((where, message))
                continue
        if domain.kind in ("uniform", "loguniform") and _is_integer_field(section, field):
            low, high = (int(v) if float(v).is_integer() else v for v in domain.values)
            problems.append((where, f"'{domain.kind}' samples real numbers, but {path} takes integers; "
                             f"use randint: [{low}, {high}] or a choice of integers"))
            continue
        for value in values_to_check(domain):
            for model in with_models:
                picked = f" (model.name {model[MODEL_NAME_PATH]!r})" if model else ""
                try:
                    trial = apply_config(spec, {**model, path: value})
                except SpecError as exc:
                    for sub_path, message in exc.problems:
                        problems.append((where, f"value {shown(value)}{picked} is invalid for {sub_path}: {message}"))
                    continue
                for sub_path, message in set(trial_problems(trial)) - base_problems:
                    problems.append((where, f"value {shown(value)}{picked} makes {sub_path} invalid: {message}"))
    return problems


def searched_models(spec: Spec) -> list[str] | None:
    """The registered models ``search.space``'s ``model.name`` picks from (None: model.name is not searched)."""
    domain = spec.search.space.get(MODEL_NAME_PATH)
    if domain is None:
        return None
    return list(dict.fromkeys(v for v in domain.values if isinstance(v, str) and v in MODELS))


def check_model_combinations(spec: Spec) -> list[tuple[str, str]]:
    """With ``model.name`` searched beside other fields, every combination of their values must make a valid trial
    (a tile one model takes and another does not; each value alone is checked by :func:`check_search_space`)."""
    space = spec.search.space
    if MODEL_NAME_PATH not in space or len(space) < 2:
        return []
    base_problems = set(trial_problems(spec))
    problems: list[tuple[str, str]] = []
    for config in searched_combinations({path: values_to_check(domain) for path, domain in space.items()}):
        try:
            found = sorted(set(trial_problems(apply_config(spec, config))) - base_problems)
        except SpecError as exc:
            found = exc.problems
        problems += [("search.space", f"the trial with {_named(config)}: {path}: {message}") for path, message in found]
    return problems[:5]


OPTIMIZER_NAME_PATH = "training.optimizer.name"


def check_optimizer_combinations(spec: Spec) -> list[tuple[str, str]]:
    """With ``training.optimizer.name`` searched beside other ``training.optimizer`` fields, every combination of
    their values must make a valid optimizer: ``amsgrad: {grid: [true, false]}`` beside ``name: {grid: [adam, sgd]}``
    would give an SGD trial ``amsgrad``, which SGD does not take (each value alone is checked by
    :func:`check_search_space`, the base spec's fields with it)."""
    space = spec.search.space
    paths = [path for path in space if path.startswith("training.optimizer.")]
    if OPTIMIZER_NAME_PATH not in paths or len(paths) < 2:
        return []
    problems: list[tuple[str, str]] = []
    for config in searched_combinations({path: values_to_check(space[path]) for path in paths}):
        try:
            apply_config(spec, config)
        except SpecError as exc:
            problems += [("search.space", f"the trial with {_named(config)}: {path}: {message}; search "
                                          "training.optimizer as a whole to give each optimizer its own fields "
                                          "({grid: [{name: adam, amsgrad: true}, {name: sgd}]})")
                         for path, message in exc.problems]
    return problems[:5]


def searched_combinations(searched: Mapping[str, list[Any]]) -> Iterator[dict[str, Any]]:
    """Every combination of the searched paths' values as a trial config, the first
    :data:`MAX_CHECKED_COMBINATIONS` of them."""
    import itertools

    for values in itertools.islice(itertools.product(*searched.values()), MAX_CHECKED_COMBINATIONS):
        yield dict(zip(searched, values))


def _named(config: Mapping[str, Any]) -> str:
    """``"path=value, ..."``: a trial config in a message."""
    def text(value: Any) -> str:
        return value if isinstance(value, str) and len(value) <= MAX_VALUE_CHARACTERS else shown(value)

    return ", ".join(f"{path}={text(value)}" for path, value in config.items())


# Integer ranges up to this many values are checked value by value (a rule such as "a power of two" can hold
# at both ends and fail between them); longer ones at their ends.
MAX_CHECKED_INTEGERS = 512


def values_to_check(domain: Any) -> list[Any]:
    """The values of a domain that stand for all of it: every grid/choice value, every integer of a short
    randint range, the ends of any other range."""
    if domain.kind == "randint":
        low, high = domain.randint
        if high - low < MAX_CHECKED_INTEGERS:
            return list(range(low, high + 1))
    return domain.values


def _is_integer_field(section: BaseModel | type[BaseModel], field: str) -> bool:
    """True when the field takes only integers (``int``, or ``int | None``)."""
    annotation = (section if isinstance(section, type) else type(section)).model_fields[field].annotation
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return annotation is int or (bool(args) and all(a is int for a in args))


# --------------------------------------------------------------------------- a trial's spec
def _field_of(spec: Spec, path: str) -> tuple[BaseModel, str]:
    """The section holding the field at dotted ``path`` and the field's name; ``KeyError`` naming the missing part."""
    *sections, field = path.split(".")
    node: Any = spec
    for i, part in enumerate(sections + [field]):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            raise KeyError(".".join(path.split(".")[: i + 1]))
        if i < len(sections):
            node = getattr(node, part)
    return node, field


MODEL_NAME_PATH = "model.name"
PARAMS_PATH = "model.params"


def _missing(spec: Spec, path: str, missing: str) -> str:
    """Why ``path`` (whose part ``missing`` does not exist) is no field of ``spec``."""
    if path.startswith(f"{PARAMS_PATH}.") and missing.count(".") == 2:
        return unknown_argument(spec.model.name, missing.rpartition(".")[2])
    return f"no field {missing!r} in the spec"


def _model_section(spec: Spec, config: Mapping[str, Any], source: str) -> ModelSpec:
    """The model section of a trial whose ``config`` changes ``model.name``: the new model's params are
    ``model.per_model``'s entry for it (its defaults without one), with the config's ``model.params.<field>`` on
    top; SpecError when they do not make the new model's params (a searched field the new model does not take).
    The spec's own model's params move to ``per_model`` (which never names the trial's model)."""
    name = config[MODEL_NAME_PATH]
    try:
        model_entry(name)
    except (ValueError, TypeError) as exc:  # TypeError: a name that is no string (a list)
        raise SpecError(source, [(MODEL_NAME_PATH, str(exc) if isinstance(exc, ValueError)
                                  else f"a registered network's name, got {name!r}")]) from None
    # per_model keeps the params of every model but the trial's: the spec's own model's go in, the new one's out
    per_model = {model: params for model, params in spec.model.per_model.items() if model != name}
    per_model[spec.model.name] = spec.model.params.model_dump(exclude_unset=True)
    tree: dict[str, Any] = {"name": name, "framework": spec.model.framework, "per_model": per_model}
    params: dict[str, Any] = dict(spec.model.per_model.get(name, {}))
    for path, value in config.items():
        field = path.removeprefix("model.")
        if path == PARAMS_PATH:
            params = dict(value) if isinstance(value, Mapping) else value
        elif path.startswith(f"{PARAMS_PATH}."):
            params[path.removeprefix(f"{PARAMS_PATH}.")] = value
        elif field in ModelSpec.model_fields and field != "params":
            tree[field] = value
        else:
            raise SpecError(source, [(path, f"no field {field!r} in the model section")])
    try:
        return ModelSpec.model_validate({**tree, "params": params})
    except ValidationError as exc:
        raise SpecError(source, [(f"model.{sub}" if sub else "model", message)
                                 for sub, message in problems_from_validation_error(exc)]) from None


#: A trial config's key that is not a spec path: the id of the configuration a cross-validation fold's trial belongs
#: to (:mod:`distmis.search.folds`). :func:`apply_config` passes over it.
CONFIGURATION_KEY = "distmis.configuration"
#: The trial config's key of the fold a cross-validation trial validates on: a spec path, set per trial by the search.
FOLD_KEY = "dataset.split.fold"


def searched_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's searched values alone: its config without the fold and the configuration's id."""
    return {key: value for key, value in config.items() if key not in (FOLD_KEY, CONFIGURATION_KEY)}


def apply_config(spec: Spec, config: Mapping[str, Any], *, source: str = "trial config") -> Spec:
    """The spec of one trial: a copy of ``spec`` with each dotted path of ``config`` (a Ray Tune trial's config,
    ``{"training.optimizer.lr": 0.001}``) set, every changed section validated by the schema as a whole (so
    values that are only valid together, like ``base_filters`` and ``norm_groups``, may change together).

    A config that changes ``model.name`` gives the trial the new model's params: ``model.per_model``'s entry for it
    (its defaults without one), with the config's own ``model.params.<field>`` values on top (SpecError when the new
    model takes no such field).

    The one place where a trial's values reach its spec; trainers, workers and callbacks receive the result.
    """
    config = {path: value for path, value in config.items() if path != CONFIGURATION_KEY}
    if not config:
        return spec
    if MODEL_NAME_PATH in config and config[MODEL_NAME_PATH] != spec.model.name:  # the model section anew
        model_paths = {path: value for path, value in config.items() if path == "model" or path.startswith("model.")}
        switched = spec.model_copy(deep=True)
        switched.model = _model_section(spec, model_paths, source)
        config = {path: value for path, value in config.items() if path not in model_paths}
        if not config:
            return switched
        spec = switched
    updates: dict[str, dict[str, Any]] = {}
    for path, value in config.items():
        try:
            _field_of(spec, path)
        except KeyError as missing:
            raise SpecError(source, [(path, _missing(spec, path, missing.args[0]))]) from None
        section_path, _, field = path.rpartition(".")
        updates.setdefault(section_path, {})[field] = value
    trial = spec.model_copy(deep=True)
    for section_path in sorted(updates, key=lambda p: -p.count(".")):  # inner sections first
        parent, name = _field_of(trial, section_path) if section_path else (None, "")
        section = getattr(parent, name) if parent is not None else trial
        try:
            rebuilt = type(section).model_validate({**dict(section), **updates[section_path]})
        except ValidationError as exc:
            raise SpecError(source, [(".".join(p for p in (section_path, sub) if p), message)
                                     for sub, message in problems_from_validation_error(exc)]) from None
        if parent is None:
            trial = rebuilt  # type: ignore[assignment]
            continue
        try:  # the enclosing section's own rules (training's warm-up within its epochs) run on assignment
            setattr(parent, name, rebuilt)
        except ValidationError as exc:
            enclosing = section_path.rpartition(".")[0]
            raise SpecError(source, [(".".join(p for p in (enclosing, sub) if p), message)
                                     for sub, message in problems_from_validation_error(exc)]) from None
    return trial


def network_input(spec: Spec) -> tuple[int, int, int] | None:
    """The shape the network sees: the tile, or the whole volume when it is known from the spec."""
    return tuple(spec.training.tile) if spec.training.tile is not None else volume_shape(spec)  # type: ignore[return-value]


def _unsupported(spec: Spec, parallelism: str, detail: str) -> str:
    """The refusal of ``parallelism`` for a model whose registry entry lacks it, naming the models that have it."""
    models = [f"'{name}'" for name, entry in MODELS.items() if entry.supports(parallelism)]
    needs = f"model.name {' or '.join(models)}" if models else "a model that supports it"
    if parallelism == "pp":
        needs += " with model.framework 'torch'"
    return (f"model {spec.model.name!r} does not support {PARALLELISM_NAMES[parallelism]}: it needs {needs}, "
            f"not {spec.model.name!r} ({spec.model.framework}); {detail}")


def network_tile(spec: Spec, volume: Sequence[int] | None = None) -> tuple[int, int, int] | None:
    """The network input a trial's network is built for (``NetworkInput.tile``): the per-axis greatest common divisor
    of every input it trains on, each curriculum stage's tile (a stage of whole volumes: ``volume``, else the
    spec's own volume shape), the inference window (the last stage's) among them. Without a curriculum, the tile or
    the volume. An architecture planned from it (DynUNet's strides) divides every input, so one network serves every
    stage; a network built for one input size (``fixed_input``) has no curriculum that changes it. None when a whole
    volume is an input and its shape is unknown."""
    shapes = []
    for stage in training_stages(spec.training):
        shape = stage.tile if stage.tile is not None else (volume if volume is not None else volume_shape(spec))
        if shape is None:
            return None
        shapes.append(tuple(int(s) for s in shape))
    return tuple(math.gcd(*axis) for axis in zip(*shapes))  # type: ignore[return-value]


def sequence_parallel_problems(spec: Spec) -> list[tuple[str, str]]:
    """Sequence parallelism needs the ViT, and a token grid, heads and split that suit the degree."""
    sp = spec.parallelism.sequence_parallel
    where = "parallelism.sequence_parallel"
    entry = spec.model.entry
    attention = entry.token_attention(spec.model.params) if entry.token_attention is not None else None
    if sp.attention == "dsp" and attention != "axial":
        model = f"model.params.attention {attention!r}" if attention else f"model.name {spec.model.name!r}"
        axial = " or ".join(repr(name) for name, other in MODELS.items() if other.token_attention is not None)
        return [(f"{where}.attention", "'dsp' (dynamic sequence parallelism) keeps the tokens split along an axis "
                                       f"the current stage does not attend along, so it needs model.name {axial} "
                                       f"with model.params.attention 'axial', not {model}: full attention attends "
                                       "along every axis at once and leaves no axis free of communication; use "
                                       "'ulysses' or 'allgather-kv', or make the model axial")]
    if sp.degree == 1:
        return []
    if sp.degree == "auto":
        return check_auto_degree(spec)
    if not spec.model.entry.supports("sp"):
        return [(f"{where}.degree", _unsupported(spec, "sp", f"got degree {sp.degree}"))]
    if spec.parallelism.mode == "compare":
        return [(f"{where}.degree", "mode 'compare' runs trials of one worker; use mode 'experiment' or 'data' "
                                    f"with degree {sp.degree}")]
    shape = network_input(spec)
    if shape is None or any(s % spec.model.input_multiple for s in shape):
        return []  # check_input_shape reports it (or the data decides it)
    grid = token_grid(shape, spec.model.input_multiple)
    try:
        check_sequence_parallel(grid, spec.model.params.heads, sp.degree, attention=sp.attention, decoder=sp.decoder,
                                split=sp.split, model_attention=attention or "full")
    except ValueError as exc:
        return [(where, f"{exc} (tile {list(shape)}, patch {spec.model.input_multiple}: token grid {list(grid)})")]
    return []


def check_auto_degree(spec: Spec) -> list[tuple[str, str]]:
    """``degree: auto`` needs the ViT in a search of its own layout, and some degree that fits a worker."""
    where = "parallelism.sequence_parallel.degree"
    if not spec.model.entry.supports("sp"):
        return [(where, _unsupported(spec, "sp", "degree 'auto' sizes it"))]
    if spec.parallelism.mode == "compare":
        return [(where, "mode 'compare' runs trials of one worker; use mode 'experiment' or 'data' with degree 'auto'")]
    shape = network_input(spec)
    if shape is None or any(s % spec.model.input_multiple for s in shape):
        return []  # check_input_shape reports it (or the data decides it)
    from distmis.spec.sizing import auto_sp_degree

    choice = auto_sp_degree(spec, shape)
    return [] if choice.degree is not None else [(where, f"'auto': {choice.reason()}")]


def check_auto_degree_combinations(spec: Spec) -> list[tuple[str, str]]:
    """With ``degree: auto`` and several searched shape fields, every combination of their values must leave
    some degree that fits (each value alone is checked by :func:`check_search_space`)."""
    from distmis.spec.sizing import SP_DEGREE_PATH, memory_configs

    degree = spec.search.space.get(SP_DEGREE_PATH)
    auto = spec.parallelism.sequence_parallel.degree == "auto" or (degree is not None and "auto" in degree.values)
    configs = memory_configs(spec)
    if not auto or not configs or len(configs[0]) < 2:
        return []
    problems: list[tuple[str, str]] = []
    for config in configs:
        try:
            trial = apply_config(spec, config)
        except SpecError:
            continue  # check_search_space reports the value
        if trial.parallelism.sequence_parallel.degree != "auto":
            continue
        for _, message in check_auto_degree(trial):
            problems.append(("search.space", f"the trial with {_named(config)}: degree {message}"))
    return problems[:5]


def check_pipeline(spec: Spec) -> list[tuple[str, str]]:
    """A pipeline (``stages > 1``) needs a torch network whose registry entry cuts it into stages (``pp``: the
    U-Net), enough cells to cut, micro-batches that divide the batch and, for 1F1B, at least one micro-batch per
    stage."""
    pipe = spec.parallelism.pipeline
    where = "parallelism.pipeline"
    if pipe.stages == 1:
        return []
    if not spec.model.entry.supports("pp"):
        return [(f"{where}.stages", _unsupported(spec, "pp", f"got stages {pipe.stages}"))]
    if spec.model.framework != "torch":
        return [(f"{where}.stages", f"a pipeline cuts the torch network into stages: it needs model.name "
                                    f"{spec.model.name!r} with model.framework 'torch', not {spec.model.name!r} "
                                    f"({spec.model.framework}); got stages {pipe.stages}")]
    if spec.parallelism.mode == "compare":
        return [(f"{where}.stages", f"mode 'compare' runs trials of one worker; use mode 'experiment' or 'data' with "
                                    f"stages {pipe.stages}")]
    problems = []
    levels = getattr(spec.model.params, "levels", None)  # the U-Net's: 2 * levels - 1 cells to cut
    if levels is not None and pipe.stages > 2 * levels - 1:
        problems.append((f"{where}.stages", f"a U-Net of {levels} levels (model.params.levels) is a sequence of "
                                            f"{2 * levels - 1} cells (encoder levels, bottleneck, decoder levels): "
                                            f"it cannot be cut into {pipe.stages} stages"))
    for stage in training_stages(spec.training):  # one, or every stage of the curriculum
        batch = stage.batch_size
        if batch % pipe.microbatches:
            source = (f"training.curriculum[{stage.number - 1}].batch_size" if spec.training.curriculum
                      else "training.batch_size")
            problems.append((f"{where}.microbatches", f"{source} {batch} must divide into {pipe.microbatches} "
                                                      "equal micro-batches"))
    if pipe.schedule == "1f1b" and pipe.microbatches < pipe.stages:
        problems.append((f"{where}.microbatches", f"the 1f1b schedule needs at least one micro-batch per stage: "
                                                  f"{pipe.microbatches} for {pipe.stages} stages; use gpipe or more "
                                                  "micro-batches"))
    return problems


#: Fields whose values decide together whether a pipeline is valid: every searched combination is checked.
PIPELINE_PATHS = ("parallelism.pipeline.stages", "parallelism.pipeline.microbatches",
                  "parallelism.pipeline.schedule", "training.batch_size", "model.params.levels")
MAX_CHECKED_COMBINATIONS = 512


def check_pipeline_combinations(spec: Spec) -> list[tuple[str, str]]:
    """With several of :data:`PIPELINE_PATHS` searched, every combination of their values must make a valid
    pipeline (each value alone is checked by :func:`check_search_space`)."""
    searched = {path: values_to_check(spec.search.space[path]) for path in PIPELINE_PATHS
                if path in spec.search.space and spec.search.space[path].kind in ("grid", "choice", "randint")}
    if len(searched) < 2:
        return []
    problems: list[tuple[str, str]] = []
    for config in searched_combinations(searched):
        try:
            trial = apply_config(spec, config)
        except SpecError:
            continue  # check_search_space reports the value
        problems += [("search.space", f"the trial with {_named(config)}: {path}: {message}")
                     for path, message in check_pipeline(trial)]
    return problems[:5]


def check_loss(spec: Spec) -> list[tuple[str, str]]:
    """Binary cross-entropy is for sigmoid outputs: ``dataset.labels: classes`` (softmax) takes ``dice-ce``."""
    if spec.dataset.labels == "classes" and spec.training.loss.name == "dice-bce":
        return [("training.loss.name", "'dice-bce' adds binary cross-entropy, for sigmoid outputs; dataset.labels "
                                       "'classes' predicts mutually exclusive classes (softmax): use 'dice-ce' "
                                       "(dice + categorical cross-entropy) or 'dice'")]
    return []


def trial_gpus(spec: Spec) -> float:
    """The GPUs each process of a trial of ``spec`` is given (its workers', or its own): the fewest over the modes a
    comparison runs."""
    par = spec.parallelism
    if par.mode == "compare":
        return min(par.resources_per_trial.gpu, par.resources_per_worker.gpu)
    workers = par.mode in ("data", "auto") or par.workers_per_trial > 1
    return (par.resources_per_worker if workers else par.resources_per_trial).gpu


def check_precision(spec: Spec) -> list[tuple[str, str]]:
    """``training.precision: fp16`` in TensorFlow needs a GPU: TensorFlow's CPU kernels of the U-Net's max pooling
    (``MaxPool3D``) take float32 and bfloat16 only, so a Keras ``mixed_float16`` trial fails at its first step on a
    CPU. (torch's fp16 on a CPU is checked where the trial runs: it needs the CPU's float16 instructions.)"""
    if spec.training.precision != "fp16" or spec.model.framework != "tensorflow" or trial_gpus(spec) > 0:
        return []
    return [("training.precision", "fp16 with model.framework 'tensorflow' needs a GPU: TensorFlow has no CPU "
                                   "float16 kernel for the U-Net's max pooling (MaxPool3D). Use bf16 on CPUs (mixed "
                                   "bfloat16, which TensorFlow runs there), or give the trials a GPU "
                                   "(parallelism.resources_per_trial / resources_per_worker gpu)")]


def check_deep_supervision(spec: Spec) -> list[tuple[str, str]]:
    """``training.deep_supervision`` needs a network whose registry entry has deep supervision heads in the trial's
    framework, and no pipeline stages (a stage would hold a decoder level's head apart from the loss)."""
    if not spec.training.deep_supervision:
        return []
    entry, framework = spec.model.entry, spec.model.framework
    if framework not in entry.deep_supervision:
        having = ", ".join(f"{name} ({' and '.join(sorted(other.deep_supervision))})"
                           for name, other in MODELS.items() if other.deep_supervision)
        return [("training.deep_supervision", f"model {entry.name!r} has no deep supervision heads in {framework}; "
                                              f"the networks that have them: {having}. Set it to false, or use one "
                                              "of those")]
    stages = spec.parallelism.pipeline.stages
    if stages > 1:
        return [("training.deep_supervision", f"a pipeline of {stages} stages (parallelism.pipeline.stages) computes "
                                              "the loss on the last stage's output only, and the decoder's lower "
                                              "levels lie on other stages: use deep supervision without pipeline "
                                              "stages, or set it to false")]
    return []


def trial_problems(spec: Spec) -> list[tuple[str, str]]:
    """The rules every trial's spec must meet (checked for the spec and for every searched value)."""
    curriculum = check_curriculum(spec)
    refused = any(path == "training.curriculum" for path, _ in curriculum)  # its stages are not checked one by one
    shape = [] if refused else check_input_shape(spec)
    return (shape + curriculum + sequence_parallel_problems(spec) + check_pipeline(spec) + check_loss(spec)
            + check_precision(spec) + check_deep_supervision(spec) + check_performance(spec))


def check_performance(spec: Spec) -> list[tuple[str, str]]:
    """``training.performance``'s settings set by hand: torch choices, for trials whose every rank holds the whole
    network (channels-last activations and compiled steps have not been run through sequence-parallel attention or
    a pipeline's stage-to-stage sends)."""
    return check_memory_format(spec) + check_compile(spec)


def check_compile(spec: Spec) -> list[tuple[str, str]]:
    """``training.performance.compile: on``: a torch step, of a trial whose ranks each hold the whole network."""
    where = "training.performance.compile"
    if spec.training.performance.compile != "on":
        return []
    if spec.model.framework == "tensorflow":  # XLA's jit_compile, for a step of one replica
        if spec.parallelism.mode != "experiment":
            return [(where, "'on' compiles a TensorFlow trial's step with XLA, which distmis does for trials of one "
                            f"replica; parallelism.mode is {spec.parallelism.mode!r}: use 'experiment', or leave "
                            "it 'auto'")]
        if spec.parallelism.workers_per_trial != 1:
            return [(where, "'on' compiles a TensorFlow trial's step with XLA, which distmis does for trials of one "
                            f"replica; parallelism.workers_per_trial is {spec.parallelism.workers_per_trial}: use 1, "
                            "or leave it 'auto'")]
        return []
    split = {"parallelism.sequence_parallel.degree": spec.parallelism.sequence_parallel.degree,
             "parallelism.pipeline.stages": spec.parallelism.pipeline.stages}
    for path, value in split.items():
        if value not in (1, "auto"):
            return [(where, f"'on' is for trials whose ranks each hold the whole network; {path} is {value}: use "
                            "'off' or 'auto' (which runs such a trial eager)")]
    return []


def check_memory_format(spec: Spec) -> list[tuple[str, str]]:
    """``training.performance.memory_format`` set by hand (see :func:`check_performance`)."""
    chosen = spec.training.performance.memory_format
    where = "training.performance.memory_format"
    if chosen == "auto":
        return []
    if spec.model.framework != "torch":
        return [(where, f"'{chosen}' lays out a torch network's activations; the TensorFlow U-Net is channels-last "
                        "already: leave it 'auto'")]
    if chosen == "channels_last":
        split = {"parallelism.sequence_parallel.degree": spec.parallelism.sequence_parallel.degree,
                 "parallelism.pipeline.stages": spec.parallelism.pipeline.stages}
        for path, value in split.items():
            if value not in (1, "auto"):
                return [(where, f"'channels_last' is for trials whose ranks each hold the whole network; {path} is "
                                f"{value}: use 'contiguous' or 'auto' (which trains such a trial contiguous)")]
    return []


def check_budget(spec: Spec) -> list[tuple[str, str]]:
    """``search.budget`` ends one search; a comparison (``parallelism.mode: compare``) times whole searches against
    each other, which a budget would cut at different points."""
    if spec.search.budget is not None and spec.parallelism.mode == "compare":
        return [("search.budget", "mode 'compare' times whole searches against each other, which a budget would "
                                  "end at different points: run the comparison without a budget, or one search "
                                  "(mode 'experiment', 'data' or 'auto') with it")]
    return []


def check_pbt(spec: Spec) -> list[tuple[str, str]]:
    """``scheduler: pbt`` copies one trial's weights into another mid-training and changes its searched values:
    what it may change (:data:`~distmis.spec.searchers.PBT_MUTABLE`), and what it combines with."""
    search = spec.search
    if search.scheduler != "pbt":
        return []
    problems: list[tuple[str, str]] = []
    if spec.parallelism.mode != "experiment":
        problems.append(("search.scheduler", f"'pbt' restarts a trial from another trial's checkpoint, which distmis "
                                             f"does for mode 'experiment' trials; got mode "
                                             f"'{spec.parallelism.mode}'"))
    if spec.cv_folds:
        problems.append(("search.scheduler", "'pbt' would copy the weights of a trial trained on one fold into a "
                                             "trial of another, whose validation cases it trained on: use it "
                                             "without dataset.split.folds"))
    if not algorithm_entry(search.algorithm).variant_generator:
        problems.append(("search.algorithm", f"'{search.algorithm}' proposes configurations from results, which "
                                             "'pbt' changes under it: use 'grid' or 'random' with 'pbt'"))
    if search.pbt.interval >= spec.training.epochs:
        problems.append(("search.pbt.interval", f"{search.pbt.interval} epochs leave no perturbation in "
                                                f"{spec.training.epochs} epochs: make it smaller than "
                                                "training.epochs"))
    allowed = ", ".join(sorted(PBT_MUTABLE))
    for path in search.pbt.mutations or []:
        if path not in PBT_MUTABLE:
            problems.append(("search.pbt.mutations", f"{path!r} cannot change mid-training (the network, its "
                                                     f"tiles or its data would change); PBT may change {allowed}"))
        elif path not in search.space:
            problems.append(("search.pbt.mutations", f"{path!r} is not searched: add it to search.space, whose "
                                                     "domain bounds what explore may set"))
        elif search.space[path].kind == "randint":
            problems.append((f"search.space.{path}", "'pbt' perturbs a list's values or a range of reals: use "
                                                     "'choice', 'grid', 'uniform' or 'loguniform'"))
    if search.pbt.mutations is None and not any(path in PBT_MUTABLE for path in search.space):
        problems.append(("search.space", f"'pbt' perturbs searched values it may change mid-training, and none is "
                                         f"searched: search one of {allowed}"))
    return problems


def check_stage_rungs(spec: Spec) -> list[tuple[str, str]]:
    """``scheduler: stage-asha`` and ``stage-halving`` judge trials at the ends of the curriculum's stages: they need
    two at least. ``stage-halving`` pauses each trial at a stage's end until every trial of the search has reached
    it, and restarts the best from their checkpoints: what it combines with."""
    name = spec.search.scheduler
    if name not in ("stage-asha", "stage-halving"):
        return []
    if len(spec.training.curriculum or []) < 2:
        return [("search.scheduler", f"'{name}' stops trials at the ends of training.curriculum's stages, and "
                                     f"{'the curriculum has one stage' if spec.training.curriculum else 'there is no curriculum'}: "
                                     "give training.curriculum two stages or more (small tiles first), or use 'asha'")]
    if name == "stage-asha":
        return []
    problems: list[tuple[str, str]] = []
    if spec.parallelism.mode != "experiment":
        problems.append(("search.scheduler", f"'stage-halving' pauses trials and restarts them from their "
                                             f"checkpoints, which distmis does for mode 'experiment' trials; got mode "
                                             f"'{spec.parallelism.mode}': use 'stage-asha', which never pauses"))
    if spec.cv_folds:
        problems.append(("search.scheduler", "'stage-halving' would judge each fold's trial on its own, stopping "
                                             "some folds of a configuration and not others: use 'stage-asha' with "
                                             "dataset.split.folds, or no folds"))
    if spec.search.budget is not None:
        problems.append(("search.budget", "'stage-halving' holds trials paused at a stage's end until every trial "
                                          "reaches it, which a budget may never let happen: use 'stage-asha' with "
                                          "a budget"))
    if spec.parallelism.max_concurrent_trials is not None:
        problems.append(("parallelism.max_concurrent_trials",
                         "'stage-halving' starts every trial before the first stage's end (a paused trial holds no "
                         "workers, and Ray Tune counts it among those at once): leave it unset, the trials then "
                         "run as many at a time as the cluster holds"))
    return problems


def check_algorithm_folds(spec: Spec) -> list[tuple[str, str]]:
    """An algorithm that distmis's fold searcher cannot drive (:attr:`AlgorithmEntry.takes_folds`) is refused with
    folds."""
    if spec.cv_folds and not algorithm_entry(spec.search.algorithm).takes_folds:
        return [("search.algorithm", f"'{spec.search.algorithm}' is not run with cross-validation folds (a "
                                     "configuration's cost is its folds' together, which it is not told): use "
                                     "'optuna', 'grid' or 'random' with folds, or drop dataset.split.folds")]
    return []


def check_folds(spec: Spec) -> list[tuple[str, str]]:
    """Cross-validation: ``search.folds`` names folds that ``dataset.split.folds`` makes, and a spec leaves
    ``dataset.split.fold`` (one trial's fold) to the search."""
    split, chosen = spec.dataset.split, spec.search.folds
    problems: list[tuple[str, str]] = []
    if split.fold is not None:
        problems.append(("dataset.split.fold", f"is set by the search for each trial (got {split.fold}); choose the "
                                               "folds every configuration trains with search.folds"))
    if split.folds is None and chosen != "all":
        problems.append(("search.folds", f"{chosen} needs cross-validation folds: set dataset.split.folds (k >= 2)"))
    elif split.folds is not None and chosen != "all" and max(chosen) >= split.folds:
        problems.append(("search.folds", f"{chosen} names folds that do not exist: dataset.split.folds "
                                         f"{split.folds} makes folds 0 to {split.folds - 1}"))
    return problems


def check_auto_mode(spec: Spec) -> list[tuple[str, str]]:
    """``parallelism.mode: auto`` grows a trial by data-parallel replicas: a trial split by sequence parallelism or
    pipeline stages (set or searched) has a fixed number of ranks per replica that the pool does not size, and is
    refused by name."""
    if spec.parallelism.mode != "auto":
        return []
    problems = []
    fixed = {"parallelism.sequence_parallel.degree": spec.parallelism.sequence_parallel.degree,
             "parallelism.pipeline.stages": spec.parallelism.pipeline.stages}
    for path, value in fixed.items():
        searched = spec.search.space.get(path)
        if value != 1 or (searched is not None and list(searched.values) != [1]):
            shown = f"searched over {list(searched.values)}" if searched is not None else f"{value!r}"
            problems.append((path, f"mode 'auto' sizes each trial by data-parallel replicas (one worker each) and "
                                   f"grows it onto idle workers; a trial split over several ranks ({path} {shown}) "
                                   "cannot be sized so: use mode 'experiment' or 'data' for it, or set it to 1"))
    return problems


def check_spec(spec: Spec) -> list[tuple[str, str]]:
    """Rules that span sections. Returns problems rather than raising, so all are shown at once."""
    problems = (trial_problems(spec) + check_search_space(spec) + check_folds(spec) + check_auto_mode(spec)
                + check_budget(spec) + check_pbt(spec) + check_algorithm_folds(spec)
                + check_stage_rungs(spec))
    return (problems or check_auto_degree_combinations(spec) or check_pipeline_combinations(spec)
            or check_model_combinations(spec) or check_optimizer_combinations(spec))
