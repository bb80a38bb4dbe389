"""How close a torch training step runs to its device, and the memory format it runs fastest in (issue 52).

**The device's rate.** :func:`matmul_rate`: the FLOP/s of a large matrix product (2048^3 by default) on this
process's device and threads, in fp32 or bf16, measured once per process and dtype. Where that product would take
over :data:`MATMUL_PRODUCT_SECONDS` (bf16 on a CPU without bf16 instructions runs it at about 1 GFLOP/s: over a
minute for the four products timed), the largest smaller power of two that does not is timed. A trial's step rate
(its counted FLOPs over its measured seconds) as a fraction of it says how near the hardware the trial ran: the
model-FLOPs utilisation on a GPU, its CPU equivalent here.

**The memory format.** 3D convolutions run at different speeds with their activations laid out channels-first
(``contiguous``, PyTorch's default) or channels-last (``torch.channels_last_3d``: what oneDNN's CPU kernels and the
tensor cores want), and which is faster depends on the network and the device (the distmis U-Net's step at 64^3,
batch 2, on a 2-core AVX-512 CPU: 1.72x faster channels-last; MONAI's DynUNet 1.13x). ``training.performance.
memory_format: auto`` measures the training step in each format on a copy of the network (a warm-up and a few
timed steps, :func:`choose_memory_format`) and keeps the faster; a format that is not at least
:data:`MARGIN` faster than the contiguous one is not taken. The choice is cached
(:class:`~distmis.train.choice_cache.ChoiceCache`, a JSON file) by what decides it: the network and its params, the
input, the batch, the precision, the device, the threads and the library versions.

**Compilation.** ``training.performance.compile`` runs the training step's forward and backward through
``torch.compile`` (TorchInductor's generated kernels: fused element-wise operations around the convolutions). It
costs a compilation at the trial's start (tens of seconds on a CPU; TorchInductor's on-disk cache makes the next
process's compilation of the same graph quicker) and pays off over many steps: ``auto`` measures it only for a trial
whose planned training is at least :data:`COMPILE_MIN_TRAINING_SECONDS` long, on a copy of the network
(:func:`choose_compile`), and compiles where the measured saving over the planned steps exceeds the measured
compilation. A network that does not compile (an operation TorchDynamo or the backend cannot take) trains eager,
and the trial says why (:class:`CompileChoice`'s ``reason``).

The format and the compilation change where values lie in memory and how kernels are fused, not what is computed:
losses agree to fp32 round-off.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Literal, Sequence

import torch

from distmis.train import compile_choice
from distmis.train.choice_cache import cache_key
from distmis.train.compile_choice import COMPILE_MIN_TRAINING_SECONDS, MARGIN, CompileChoice, decide_compile

__all__ = ["MemoryFormat", "MEMORY_FORMATS", "MARGIN", "COMPILE_MIN_TRAINING_SECONDS", "MemoryFormatChoice",
           "CompileChoice", "apply_memory_format", "in_memory_format", "device_name", "matmul_rate", "matmul_side",
           "median_seconds", "choose_memory_format", "compile_model", "measure_compiled", "decide_compile",
           "choose_compile", "compile_error", "choice_key"]

MemoryFormat = Literal["contiguous", "channels_last"]
MEMORY_FORMATS: dict[str, torch.memory_format] = {"contiguous": torch.contiguous_format,
                                                  "channels_last": torch.channels_last_3d}
#: TorchDynamo's backend for ``torch.compile`` (a test gives one that fails, to see the fallback)
COMPILE_BACKEND: str | Callable[..., Any] = "inductor"

_MATMUL_RATES: dict[tuple[str, torch.dtype, int, float, int], float] = {}
#: the most seconds one of :func:`matmul_rate`'s products is let take (a 2048^3 fp32 product takes 0.1-0.4 s on one
#: CPU core, under 10 ms on a GPU)
MATMUL_PRODUCT_SECONDS = 0.5
_FIRST_SIDE = 256


def in_memory_format(tensor: torch.Tensor, memory_format: MemoryFormat) -> torch.Tensor:
    """``tensor`` laid out in ``memory_format`` where it is a 5-D (batch, channel, depth, height, width) tensor;
    any other as it is."""
    if memory_format == "contiguous" or tensor.dim() != 5:
        return tensor
    return tensor.contiguous(memory_format=MEMORY_FORMATS[memory_format])


def apply_memory_format(model: torch.nn.Module, memory_format: MemoryFormat) -> torch.nn.Module:
    """``model`` with its 5-D parameters and buffers (3D convolutions' weights) in ``memory_format``, in place."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dim() == 5:
                tensor.data = tensor.data.contiguous(memory_format=MEMORY_FORMATS[memory_format])
    return model


def device_name(device: torch.device | str) -> str:
    """What a measurement on ``device`` depends on: the GPU's name, or the CPU's vector instructions and model."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu {torch.backends.cpu.get_cpu_capability()} {platform.processor() or platform.machine()}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(step: Callable[[], object], *, repeats: int = 3, warmup: int = 1,
                   timer: Callable[[], float] = time.perf_counter, device: torch.device | str = "cpu") -> float:
    """The median seconds of ``repeats`` calls of ``step`` after ``warmup`` untimed ones (the device synchronized
    around each timed call)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = timer()
        step()
        _synchronize(device)
        times.append(timer() - start)
    return statistics.median(times)


def matmul_rate(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *, size: int = 2048,
                repeats: int = 3, max_seconds: float | None = None) -> float:
    """FLOP/s of a square matrix product in ``dtype`` on ``device`` with this process's threads (measured once per
    process, device, dtype and thread count): of ``size``^3, or of the largest power of two below it whose product
    takes at most ``max_seconds`` (:data:`MATMUL_PRODUCT_SECONDS` when None; :func:`matmul_side`)."""
    device = torch.device(device)
    limit = MATMUL_PRODUCT_SECONDS if max_seconds is None else max_seconds
    key = (str(device), dtype, size, limit, torch.get_num_threads())
    if key not in _MATMUL_RATES:
        generator = torch.Generator(device="cpu").manual_seed(0)

        def product(side: int) -> Callable[[], object]:
            a = torch.rand((side, side), generator=generator).to(device=device, dtype=dtype)
            b = torch.rand((side, side), generator=generator).to(device=device, dtype=dtype)
            return lambda: torch.mm(a, b)

        def once(side: int) -> float:  # one product, after a warm-up at the first side (each warms the next)
            return median_seconds(product(side), repeats=1, warmup=int(side == min(size, _FIRST_SIDE)), device=device)

        side = matmul_side(once, size, limit)
        seconds = median_seconds(product(side), repeats=repeats, warmup=0, device=device)
        _MATMUL_RATES[key] = 2 * side**3 / seconds
    return _MATMUL_RATES[key]


def matmul_side(seconds_at: Callable[[int], float], size: int, max_seconds: float) -> int:
    """The side of the product :func:`matmul_rate` times: doubling from
    ``min(size, 256)`` while the next (eight times the work) is predicted at most ``max_seconds`` and the side is
    below ``size``. ``seconds_at(side)``: one product's measured seconds at ``side``."""
    if size < 1:
        raise ValueError(f"the matrix side must be at least 1, got {size}")
    side = min(size, _FIRST_SIDE)
    seconds = seconds_at(side)
    while side < size and 8 * seconds <= max_seconds:
        side = min(2 * side, size)
        seconds = seconds_at(side)
    return side


@dataclass(frozen=True)
class MemoryFormatChoice:
    """The format a trial trains in; ``seconds``: each candidate's measured step (empty when it was set, not
    measured); ``source``: ``set`` (the spec's), ``measured``, ``cached`` or ``not measured`` (a trial over several
    ranks, whose formats are not agreed by measuring)."""

    memory_format: MemoryFormat
    source: Literal["set", "measured", "cached", "not measured"]
    seconds: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """What the trial logs of it: ``channels_last`` (1 or 0) and each measured format's step seconds."""
        return {"channels_last": float(self.memory_format == "channels_last"),
                **{f"format_step_seconds_{name}": value for name, value in self.seconds.items()}}

    def cache_entry(self) -> dict[str, Any]:
        """What :class:`~distmis.train.choice_cache.ChoiceCache` keeps of it."""
        return {"memory_format": self.memory_format, "seconds": self.seconds}

    @classmethod
    def from_cache(cls, entry: dict[str, Any] | None) -> MemoryFormatChoice | None:
        """The choice a cache entry (:meth:`cache_entry`'s) holds, if it holds one."""
        if entry is None or entry.get("memory_format") not in MEMORY_FORMATS:
            return None
        seconds = entry.get("seconds")
        return cls(entry["memory_format"], "cached",
                   {str(name): float(value) for name, value in seconds.items()} if isinstance(seconds, dict) else {})


def choice_key(**decides: Any) -> str:
    """A cache key of what decides a choice (network, params, input, batch, precision, device, threads) and the
    torch and MONAI versions. MONAI's is its installed distribution's, read without importing MONAI: the import
    takes seconds, and a trial of a network of distmis's own would pay them for nothing."""
    return cache_key(**decides, torch=torch.__version__, monai=_installed_version("monai"))


def _installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None where it is not installed)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _sgd_step(forward: Callable[[torch.Tensor], Any], parameters: Sequence[torch.nn.Parameter],
              loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              autocast_dtype: torch.dtype | None) -> Callable[[], None]:
    """A training step for timing: ``forward`` (under ``autocast_dtype``'s autocast where given), ``loss_fn`` of its
    output, backward, and an SGD step of a negligible rate."""
    optimizer = torch.optim.SGD(parameters, lr=1e-6)
    device_type = x.device.type

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            output = forward(x)
        loss_fn(output, y).backward()
        optimizer.step()

    return step


def choose_memory_format(model: torch.nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         x: torch.Tensor, y: torch.Tensor, *, autocast_dtype: torch.dtype | None = None,
                         candidates: Sequence[MemoryFormat] = ("contiguous", "channels_last"),
                         repeats: int = 3, warmup: int = 1,
                         timer: Callable[[], float] = time.perf_counter) -> MemoryFormatChoice:
    """The fastest of ``candidates`` for a training step of ``model`` (forward, in ``autocast_dtype`` where given;
    ``loss_fn``, the trainer's, of the output; backward; an SGD step) on the batch ``(x, y)``, each measured on its
    own copy of the model (``model`` itself is not changed). Contiguous unless another is at least :data:`MARGIN`
    faster."""
    seconds: dict[str, float] = {}
    for name in candidates:
        copied = apply_memory_format(copy.deepcopy(model), name).train()
        step = _sgd_step(copied, list(copied.parameters()), loss_fn, in_memory_format(x, name),
                         in_memory_format(y, name), autocast_dtype)
        seconds[name] = median_seconds(step, repeats=repeats, warmup=warmup, timer=timer, device=x.device)
        del copied, step
    best = min(seconds, key=seconds.__getitem__)
    if best != "contiguous" and "contiguous" in seconds and seconds[best] * MARGIN > seconds["contiguous"]:
        best = "contiguous"
    return MemoryFormatChoice(best, "measured", seconds)  # type: ignore[arg-type]


def compile_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` compiled by ``torch.compile`` with :data:`COMPILE_BACKEND` (a wrapper sharing its parameters; the
    compilation happens at the first call)."""
    return torch.compile(model, backend=COMPILE_BACKEND)


def measure_compiled(model: torch.nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor, *, memory_format: MemoryFormat = "contiguous",
                     autocast_dtype: torch.dtype | None = None, repeats: int = 3,
                     timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """The compiled training step of a copy of ``model`` in ``memory_format``: ``compiled``, its steady seconds (the
    median of ``repeats``), and ``compiling``, what its first step (the compilation) took beyond that. Raises what
    the compilation raises."""
    copied = apply_memory_format(copy.deepcopy(model), memory_format).train()
    step = _sgd_step(compile_model(copied), list(copied.parameters()), loss_fn, in_memory_format(x, memory_format),
                     in_memory_format(y, memory_format), autocast_dtype)
    seconds = median_seconds(step, repeats=1, warmup=0, timer=timer, device=x.device)
    steady = median_seconds(step, repeats=repeats, warmup=0, timer=timer, device=x.device)
    return {"compiled": steady, "compiling": max(seconds - steady, 0.0)}


def choose_compile(model: torch.nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], x: torch.Tensor,
                   y: torch.Tensor, *, eager_seconds: float | None, planned_steps: int,
                   memory_format: MemoryFormat = "contiguous", autocast_dtype: torch.dtype | None = None,
                   repeats: int = 3, timer: Callable[[], float] = time.perf_counter,
                   min_training_seconds: float | None = None) -> CompileChoice:
    """``compile: auto`` for a trial of ``planned_steps`` training steps whose eager step takes ``eager_seconds``
    (None: measured here, in ``memory_format``, on a copy of ``model``: one step first, whose seconds bound a steady
    step's from above, and ``repeats`` more only where the trial is long enough at that bound): not measured where
    the planned training is shorter than ``min_training_seconds`` (default
    :data:`~distmis.train.compile_choice.COMPILE_MIN_TRAINING_SECONDS`); otherwise the compiled step measured on a
    copy of ``model`` (:func:`measure_compiled`) and :func:`decide_compile`'s verdict, or eager with the error where
    the network does not compile."""
    minimum = compile_choice.COMPILE_MIN_TRAINING_SECONDS if min_training_seconds is None else min_training_seconds

    def eager_step(repeats: int, warmup: int) -> float:
        return choose_memory_format(model, loss_fn, x, y, autocast_dtype=autocast_dtype, candidates=(memory_format,),
                                    repeats=repeats, warmup=warmup, timer=timer).seconds[memory_format]

    bound = ""
    if eager_seconds is None:
        eager_seconds = eager_step(repeats=1, warmup=0)  # the first step: kernels set up, memory allocated
        bound = "at most "
        if eager_seconds * planned_steps >= minimum:
            eager_seconds, bound = eager_step(repeats=repeats, warmup=1), ""
    planned = eager_seconds * planned_steps
    if planned < minimum:
        return CompileChoice(False, "not measured", {"eager": eager_seconds},
                             f"the planned training ({planned_steps} steps of {bound}{eager_seconds:.3g} s) is shorter "
                             f"than {minimum:.0f} s: a compilation would not be repaid")
    try:
        measured = measure_compiled(model, loss_fn, x, y, memory_format=memory_format,
                                    autocast_dtype=autocast_dtype, repeats=repeats, timer=timer)
    except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the step eager, and says why
        return CompileChoice(False, "fell back", {"eager": eager_seconds}, compile_error(exc))
    return decide_compile({"eager": eager_seconds, **measured}, planned_steps, "measured")


def compile_error(exc: BaseException) -> str:
    """A compilation's error in a line: its type and first line, and its root cause's (TorchDynamo wraps a
    backend's error in its own)."""
    def line(error: BaseException) -> str:
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}"

    cause = exc
    for _ in range(10):
        inner = getattr(cause, "inner_exception", None) or cause.__cause__
        if inner is None:
            break
        cause = inner
    return (line(exc) + (f" ({line(cause)})" if cause is not exc else ""))[:400]
