"""``distmis init``: a complete search spec drafted from a data set and a worker's memory (:func:`draft_spec`), written
as commented YAML by :mod:`distmis.search.draft_yaml`.

What is decided, and from what:

* **the data**: its layout (from its files), what to predict (``regions`` where the data set has region-based labels
  or is a brain-tumour set, else one class per label value), ``spacing: auto`` where the cases' spacings differ (the
  median, with nnU-Net's rule for an anisotropic axis), ``orientation: RAS`` where their orientations differ, and the
  normalization by each channel's name (``CT`` -> ``ct``, else ``zscore``), ``crop_to_nonzero`` where a case has a
  zero border (nnU-Net's crop), and ``crop`` where the cases' shapes (or non-zero regions) differ after resampling
  (the conversion stores one shape: each case padded about its centre to the largest, at most twice the median);
  the fingerprint
  (:func:`~distmis.data.fingerprint.fingerprint_for`) is kept in the search's output folder, where the search reuses
  it;
* **the networks** (``--networks``): each at the params its registry entry drafts for the data's volume
  (:attr:`~distmis.models.registry.ModelEntry.draft_params`), searched with ``model.name``;
* **the tile and the batch**: planned as ``training.tile: auto`` and ``batch_size: auto`` plan them
  (:mod:`~distmis.search.input_plan`), for every network at once, and written as values; a smaller tile that also
  fits (about half the voxels) is searched beside the planned one;
* **the recipe**: Adam with nnU-Net's poly schedule (power 0.9), dice + cross-entropy, augmentation on, a third of the
  tiles centred on foreground (nnU-Net's share) where the tile is smaller than the volume;
* **the search**: random sampling of the learning rate (log-uniform), the network and the tile, two trials per
  worker (at least 4), ASHA stopping the weakest;
* **the parallelism**: experiment-parallel, one trial per worker, ``memory_per_worker`` as given.

Every trial is then predicted to fit (:func:`~distmis.search.memory_fit.check_trials_fit`), and the prediction is
written into the spec as comments: the peak per step, the FLOPs, and the least time a trial's training steps take at
the device's rate (this machine's matmul rate measured, for CPU workers; ``--device-flops`` for GPUs).
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.input_plan import InputPlan, planned_tree
from distmis.search.data_shape import data_shape, trial_device
from distmis.search.memory_fit import StepsFit, check_trials_fit, step_rules
from distmis.search.tile_search import Tile, mib, tile_candidates
from distmis.spec.load import apply_config, validate_spec
from distmis.spec.schema import Spec

__all__ = ["DEFAULT_NETWORKS", "InitRequest", "Draft", "draft_spec", "matmul_rate", "size_text"]

#: The networks ``distmis init`` searches unless told: the DistMIS U-Net and MONAI's SegResNet.
DEFAULT_NETWORKS = ("unet3d", "segresnet")
#: The split of the cases ``distmis init`` writes.
SPLIT = {"train": 0.7, "val": 0.15, "test": 0.15, "seed": 0}
#: nnU-Net's share of training tiles centred on foreground.
FOREGROUND_SHARE = 0.33
#: The learning rates searched (log-uniform), around Adam's usual 1e-3.
LR_RANGE = (1.0e-4, 3.0e-3)


@dataclass(frozen=True)
class InitRequest:
    """What ``distmis init`` is asked: the data set, the workers (``None``: this machine's) and the search's shape."""

    dataset: str
    layout: str | None = None
    memory_per_worker: float | None = None  # bytes; None: this machine's memory over its workers (CPU workers)
    workers: int | None = None  # None: this machine's CPUs (CPU workers); required with GPUs
    gpus_per_worker: int = 0
    cpus_per_worker: int | None = None  # None: this machine's CPUs over the workers (CPU), 4 (GPU)
    networks: tuple[str, ...] = DEFAULT_NETWORKS
    framework: Literal["torch", "tensorflow"] = "torch"
    epochs: int = 50
    name: str | None = None
    device_flops: float | None = None  # FLOP/s of a worker; None: measured on this machine (CPU workers)

    def __post_init__(self) -> None:
        if not self.networks:
            raise ValueError("--networks: name at least one network")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.epochs}")


@dataclass(frozen=True)
class Draft:
    """A drafted spec: its tree (as the YAML holds it), the plan of its tile and batch, the smaller tile searched
    beside it (None: none fits the networks' rules), every trial's predicted step, and what was decided, by field
    path, for the comments."""

    tree: dict[str, Any]
    spec: Spec
    plan: InputPlan
    smaller_tile: Tile | None
    fit: StepsFit
    train_cases: int
    device_flops: float | None
    reasons: dict[tuple[str, ...], str] = field(default_factory=dict)
    header: tuple[str, ...] = ()


def size_text(size: float) -> str:
    """Bytes as a spec writes them, exactly: ``24GB``, ``16GiB``, ``512MiB``, or a plain number."""
    for unit, scale in (("GiB", 2**30), ("GB", 1e9), ("MiB", 2**20), ("MB", 1e6)):
        if size >= scale and (size / scale).is_integer():
            return f"{int(size / scale)}{unit}"
    return str(int(size))


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-._").lower()
    return slug or "search"


def _path_text(path: Path) -> str:
    """The data set's path as the spec writes it: relative to the working directory where it lies below it (a spec
    kept beside its data moves with it), else absolute."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


def _workers(request: InitRequest) -> tuple[int, int, float, str]:
    """Workers, CPUs per worker, memory per worker (bytes) and where the memory came from."""
    cpus = os.cpu_count() or 1
    if request.gpus_per_worker > 0:
        if request.memory_per_worker is None:
            raise ValueError("--memory-per-worker: GPU workers need their GPU's memory (e.g. 24GB); distmis does not "
                             "guess it from this machine")
        workers = request.workers or 1
        return workers, request.cpus_per_worker or 4, request.memory_per_worker, "given"
    import psutil

    workers = request.workers or cpus
    per_worker = request.cpus_per_worker or max(1, cpus // workers)
    if request.memory_per_worker is not None:
        return workers, per_worker, request.memory_per_worker, "given"
    total = psutil.virtual_memory().total
    memory = float(math.floor(total / workers / 2**30) * 2**30)
    if memory <= PROCESS_RESERVE:
        raise ValueError(f"--memory-per-worker: this machine's {total / 2**30:.1f} GiB over {workers} workers leaves "
                         f"too little per worker; give --memory-per-worker or fewer --workers")
    return workers, per_worker, memory, f"this machine's {total / 2**30:.1f} GiB over {workers} worker(s)"


def _labels(description: Any) -> tuple[str, str]:
    """``dataset.labels`` for the data set, and why."""
    from distmis.data.errors import DataError
    from distmis.data.targets import target_scheme

    try:
        channels = [c["name"] for c in target_scheme(description, "regions")["channels"]]
    except DataError:  # no regions
        return "classes", "one softmax channel per label value, background included"
    kind = "its region-based labels" if description.regions else "a brain-tumour set's regions"
    return "regions", f"{kind}: {', '.join(channels)}, each a sigmoid channel"


def matmul_rate(threads: int) -> float:
    """This machine's fp32 matmul rate (FLOP/s) on ``threads`` threads: the best of five 1024^3 products."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * 1024**3 / best


def _data_section(request: InitRequest) -> tuple[str, dict[str, Any], dict[tuple[str, ...], str], Any, Any]:
    """The search's name, the ``dataset`` section, its reasons, the data set's description and its fingerprint
    (kept in the search's output folder, where the search reuses it)."""
    from distmis.data.dataset_layouts import describe_dataset
    from distmis.data.fingerprint import fingerprint_for
    from distmis.data.scans import detect_layout

    root = Path(request.dataset)
    layout = request.layout or detect_layout(root).value
    description = describe_dataset(root, layout)
    name = request.name or _slug(description.name or root.resolve().name)
    fingerprint = fingerprint_for(root, layout, Path(os.environ.get("DISTMIS_OUTPUT", "runs")) / name)
    labels, why = _labels(description)
    dataset: dict[str, Any] = {"path": _path_text(root), "layout": layout, "labels": labels}
    reasons = {("dataset", "layout"): "given (--layout)" if request.layout else "detected from the files",
               ("dataset", "labels"): why}
    spacings = {case.spacing for case in fingerprint.cases}
    if len(spacings) > 1:
        dataset["spacing"] = "auto"
        spacing = "x".join(f"{s:.3g}" for s in fingerprint.median_spacing)
        reasons[("dataset", "spacing")] = (f"the cases' spacings differ: the median, {spacing} mm, with nnU-Net's "
                                           f"rule for an anisotropic axis (anisotropy {fingerprint.anisotropy:.2g})")
    orientations = sorted({case.orientation for case in fingerprint.cases})
    if len(orientations) > 1:
        dataset["orientation"] = "RAS"
        reasons[("dataset", "orientation")] = f"the cases are stored in {', '.join(orientations)}"
    dataset["split"] = dict(SPLIT)
    return name, dataset, reasons, description, fingerprint


def draft_spec(request: InitRequest) -> Draft:
    """The spec ``distmis init`` writes for ``request``. ValueError (a :class:`SpecError` naming the field where the
    spec's rules or the memory refuse it) when no search fits."""
    from distmis.models.registry import model_entry

    for network in request.networks:
        entry = model_entry(network)  # ValueError naming the registered networks
        if request.framework not in entry.frameworks:
            raise ValueError(f"--networks: {network} is built in {', '.join(entry.frameworks)}, not "
                             f"{request.framework} (--framework)")
    workers, cpus, memory, memory_source = _workers(request)
    name, dataset, reasons, description, fingerprint = _data_section(request)
    first, others = request.networks[0], request.networks[1:]
    tree: dict[str, Any] = {
        "name": name,
        "dataset": dataset,
        "model": {"name": first, "framework": request.framework},
        "training": {
            "epochs": request.epochs, "batch_size": "auto", "tile": "auto",
            "optimizer": {"name": "adam", "lr": 1.0e-3},
            "lr_schedule": {"name": "poly"},
            "loss": {"name": "dice-ce"}, "augment": {"enabled": True}, "seed": 0,
        },
        "search": {"algorithm": "random", "num_samples": max(4, 2 * workers), "metric": "val_dice", "mode": "max",
                   "scheduler": "asha", "asha": {"grace_period": max(1, request.epochs // 10), "reduction_factor": 2},
                   "space": {"training.optimizer.lr": {"loguniform": list(LR_RANGE)}}},
        "parallelism": {"mode": "experiment", "resources_per_trial": {"cpu": cpus, "gpu": request.gpus_per_worker},
                        "max_concurrent_trials": workers, "memory_per_worker": size_text(memory)},
        "tracking": {"uri": None},
    }
    # the networks' params follow the data's volume: known once the dataset section is a spec (read by a probe
    # whose network and tile take any volume)
    def probe() -> Spec:
        return validate_spec({**tree, "model": {"name": "unet3d", "framework": "torch", "params": {"levels": 2}},
                              "training": {**tree["training"], "tile": [2, 2, 2], "batch_size": 2}}, source="init")

    bordered = [case for case in fingerprint.cases if tuple(case.cropped_shape) != tuple(case.shape)]
    nonzero = {case.case_id: case.cropped_shape for case in fingerprint.cases} if bordered else None
    crop = _common_shape(probe(), nonzero)
    if crop is not None:
        dataset["crop"], reasons[("dataset", "crop")] = crop
    if nonzero is not None:
        dataset["crop_to_nonzero"] = True
        reasons[("dataset", "crop_to_nonzero")] = (
            f"{len(bordered)} of {len(fingerprint.cases)} case(s) have a zero border: each is cropped to its non-zero "
            "region first (nnU-Net's crop), then centred in dataset.crop")
    volume = data_shape(probe()).volume
    params = {network: model_entry(network).draft_params(volume) for network in request.networks}
    tree["model"]["params"] = params[first]
    if others:
        tree["model"]["per_model"] = {network: params[network] for network in others}
        tree["search"]["space"]["model.name"] = {"choice": list(request.networks)}

    planned, plan = planned_tree(tree, source="init")
    assert isinstance(plan, InputPlan)
    smaller = _smaller_tile(validate_spec(planned, source="init"), plan)
    if smaller is not None:
        planned["search"]["space"]["training.tile"] = {"choice": [list(plan.tile), list(smaller)]}
    if smaller is not None or any(t < v for t, v in zip(plan.tile, plan.volume)):
        planned["training"]["tile_sampling"] = FOREGROUND_SHARE
    spec = validate_spec(planned, source="init")
    fit = check_trials_fit(spec)
    assert fit is not None  # memory_per_worker is set, and nothing is split over ranks
    device, threads = trial_device(spec)
    rate = request.device_flops or (matmul_rate(threads) if device == "cpu" else None)
    reasons.update(_plan_reasons(plan, memory_source, workers, params, volume))
    train_cases = max(1, round(len(fingerprint.cases) * SPLIT["train"]))
    header = _header(request, description, fingerprint, spec)
    return Draft(planned, spec, plan, smaller, fit, train_cases, rate, reasons, header)


def _common_shape(spec: Spec, nonzero: Mapping[str, Sequence[int]] | None = None) -> tuple[list[int], str] | None:
    """Where the cases' preprocessed shapes differ, or they are cropped to their non-zero regions (``nonzero``: case
    id -> that region's shape), the one shape they are cropped or padded to about their centre (``dataset.crop``:
    the conversion stores cases of one shape) and why: each side the largest case's, so that nothing is cut away,
    but at most twice the median case's, so that one outlier does not pad them all."""
    from distmis.search.input_fit import preprocessed_volumes

    shapes = [volume.shape for volume in preprocessed_volumes(spec, nonzero)]
    if len(set(shapes)) <= 1 and nonzero is None:
        return None
    median = [sorted(axis)[len(axis) // 2] for axis in zip(*shapes)]
    crop = [min(max(axis), 2 * m) for axis, m in zip(zip(*shapes), median)]
    cut = sum(any(s > c for s, c in zip(shape, crop)) for shape in shapes)
    regions = "non-zero regions' " if nonzero is not None else ""
    if len(set(shapes)) == 1:
        return crop, f"the shape of the cases' {regions}preprocessed volumes"
    why = (f"the cases' {regions}shapes differ ({len(set(shapes))} shapes, median {'x'.join(map(str, median))}): "
           "each is padded (or cropped) about its centre to the largest, at most twice the median")
    return crop, why + (f"; {cut} case(s) lose a border" if cut else "")


def _smaller_tile(spec: Spec, plan: InputPlan) -> Tile | None:
    """The first tile of the planner's sequence after the planned one with at most half its voxels, that every
    network takes (it fits: smaller tiles need less)."""
    from distmis.search.input_plan import network_configs

    data = data_shape(spec)
    device, threads = trial_device(spec)
    trials = [apply_config(spec, config) for config in network_configs(spec)]
    valid, _ = step_rules(trials, data, device, threads)
    multiple = math.lcm(*(trial.model.input_multiple for trial in trials))
    equal_pair = bool(spec.training.augment.enabled and spec.training.augment.rotate90)
    halved = (tile for tile in tile_candidates(plan.volume, multiple, equal_pair=equal_pair)
              if math.prod(tile) * 2 <= math.prod(plan.tile) and all(t <= p for t, p in zip(tile, plan.tile)))
    return next((tile for tile in halved if valid(tile, plan.batch)), None)


def _plan_reasons(plan: InputPlan, source: str, workers: int, params: Mapping[str, Mapping[str, Any]],
                  volume: Tile) -> dict[tuple[str, ...], str]:
    chosen = plan.chosen
    larger = plan.next_larger
    tile = (f"planned: the largest that fits every network ({mib(chosen.peak)} MiB predicted per step, "
            f"{mib(plan.usable)} MiB usable)")
    if larger is not None:
        tile += f"; {list(larger.tile)} at batch {larger.batch} would need {mib(larger.peak)} MiB"
    reasons = {
        ("training", "tile"): tile,
        ("training", "batch_size"): "planned: at least 2, grown while it fits, at most 5% of the data set's voxels",
        ("training", "tile_sampling"): "nnU-Net's share of tiles centred on foreground",
        ("parallelism", "memory_per_worker"): f"{source}; {mib(PROCESS_RESERVE)} MiB of it is the process's own",
        ("parallelism", "max_concurrent_trials"): f"{workers} worker(s), one trial each",
        ("search", "num_samples"): "two trials per worker (at least 4)",
        ("search", "space", "training.tile"): "the planned tile, and a smaller one that fits",
    }
    for network, values in params.items():
        where = ("model", "params") if network == next(iter(params)) else ("model", "per_model", network)
        reasons[where] = (f"drafted for the data's {'x'.join(map(str, volume))} volume" if values
                          else f"{network}'s defaults")
    return reasons


def _header(request: InitRequest, description: Any, fingerprint: Any, spec: Spec) -> tuple[str, ...]:
    channels = ", ".join(description.channels)
    classes = ", ".join(f"{value} {name}" for name, value in description.classes)
    shape = "x".join(map(str, fingerprint.median_shape))
    spacing = "x".join(f"{s:.3g}" for s in fingerprint.median_spacing)
    return (
        f"Drafted by distmis init from {request.dataset} ({spec.dataset.layout}): {len(fingerprint.cases)} cases, "
        f"channels {channels}; labels {classes}.",
        f"Median case: {shape} voxels (cropped to its non-zero region) at {spacing} mm.",
    )
