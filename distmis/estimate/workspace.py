"""What a kernel holds besides its outputs while it runs, for :class:`~distmis.estimate.live_bytes.LiveBytes`.

Only convolutions hold much, and on a CPU their workspace depends on which library runs them (torch 2.13's
``ConvParams::use_mkldnn``, :func:`uses_onednn`):

- **oneDNN** computes in its blocked layout, channels grouped in blocks of 16 on AVX-512 CPUs and of 8 on others,
  a group's last block padded. A forward reorders its input into that layout and writes its output in place; a
  backward reorders the output's gradient and the input (the weights' gradient needs both). So the workspace is
  the input with its channels padded to the block, and in a backward the output's gradient as well. Measured with
  the profiler's allocation events inside each convolution (``benchmarks/step_memory.py``): the forward's within
  1.2x of that, the backward's between 0.75x and 1x;
- **slow_conv3d** (fp32, one sample a batch and few channels) unfolds the input into columns of
  ``C_in x kernel`` values per output voxel, for the whole batch, once in the forward and twice in the backward.

On a GPU, cuDNN's workspace is allocated through the caching allocator as a tensor would be, but chosen by cuDNN at
run time; no rule is known here, and it is counted as nothing until a GPU's measurements say otherwise.
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Literal

import torch

__all__ = ["CpuSimd", "cpu_simd", "channel_block", "uses_onednn", "cpu_convolution_workspace", "workspace_rule"]

CpuSimd = Literal["avx512", "avx2"]
_aten = torch.ops.aten


def cpu_simd() -> CpuSimd:
    """This CPU's vector width as torch sees it (``torch.backends.cpu.get_cpu_capability``)."""
    return "avx512" if "AVX512" in torch.backends.cpu.get_cpu_capability().upper() else "avx2"


def channel_block(simd: CpuSimd) -> int:
    """Channels per block in oneDNN's blocked layout."""
    return 16 if simd == "avx512" else 8


def uses_onednn(input_shape: tuple[int, ...], weight_shape: tuple[int, ...], *, dtype: torch.dtype, strided: bool,
                groups: int, threads: int) -> bool:
    """Whether torch 2.13 runs a CPU convolution of an ``input_shape`` input and ``weight_shape`` weights with
    oneDNN (its ``ConvParams::use_mkldnn``); otherwise ``slow_conv3d`` runs it. 16-bit inputs always take oneDNN."""
    if dtype in (torch.bfloat16, torch.float16):
        return True
    batch = input_shape[0]
    one_by_one = weight_shape[-1] == 1 and weight_shape[-2] == 1
    eligible = strided or batch >= 16 or not one_by_one or threads > 1
    large = (groups > 1 or (weight_shape[-1] > 3 and weight_shape[-2] > 3) or batch > 1
             or prod(input_shape[:4]) > 20480)
    return eligible and large


def _padded(shape: tuple[int, ...], block: int, itemsize: int) -> int:
    channels = -(-shape[1] // block) * block
    return shape[0] * channels * prod(shape[2:]) * itemsize


def cpu_convolution_workspace(input_shape: tuple[int, ...], weight_shape: tuple[int, ...],
                              output_shape: tuple[int, ...], *, dtype: torch.dtype, strided: bool, groups: int,
                              backward: bool, threads: int, simd: CpuSimd) -> int:
    """Bytes a CPU convolution's kernel holds besides its outputs (see the module's docstring)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if uses_onednn(input_shape, weight_shape, dtype=dtype, strided=strided, groups=groups, threads=threads):
        block = channel_block(simd)
        work = _padded(input_shape, block, itemsize)
        return work + _padded(output_shape, block, itemsize) if backward else work
    columns = input_shape[0] * input_shape[1] // groups * prod(weight_shape[2:]) * prod(output_shape[2:]) * itemsize
    return 2 * columns if backward else columns


def workspace_rule(device: Literal["cpu", "cuda"], *, threads: int = 1,
                   simd: CpuSimd | None = None) -> Callable[[Any, tuple, Any], int]:
    """The workspace of each operation on ``device`` (a CPU running ``threads`` threads, with ``simd``: this
    one's by default), for :class:`~distmis.estimate.live_bytes.LiveBytes`."""
    if device == "cuda":
        return lambda func, args, out: 0
    width = simd or cpu_simd()

    def rule(func: Any, args: tuple, out: Any) -> int:
        if func is _aten.convolution.default:
            x, weight, _, stride = args[:4]
            groups = args[8]
            return cpu_convolution_workspace(tuple(x.shape), tuple(weight.shape), tuple(out.shape), dtype=x.dtype,
                                             strided=any(s != 1 for s in stride), groups=groups, backward=False,
                                             threads=threads, simd=width)
        if func is _aten.convolution_backward.default:
            grad, x, weight = args[:3]
            stride, groups = args[4], args[9]
            return cpu_convolution_workspace(tuple(x.shape), tuple(weight.shape), tuple(grad.shape), dtype=x.dtype,
                                             strided=any(s != 1 for s in stride), groups=groups, backward=True,
                                             threads=threads, simd=width)
        return 0

    return rule
