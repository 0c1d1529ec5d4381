"""Weight-only int8 and fp8 (`--quant int8|fp8`): every projection of the layers (`model.Linear`: attention, dense
MLPs) and every MoE's stacked experts keep their weights in one byte with one fp32 scale per output row (symmetric:
the row's largest magnitude over 127 for int8, over 448 -- e4m3's largest -- for fp8), and the head a 1-byte copy
beside the float one (a tied embedding keeps reading its float rows); activations, norms, the router and the
embedding stay in the model's dtype. A decode step streams its weights, so a quarter of fp32's bytes, half of bf16's,
is the point: on the CPU `kernels/skinny.c`'s int8 kernel for up to 16 rows, on CUDA one Triton kernel
(`kernels/quant_triton.py`) for the projections, the head and the experts alike, the weights widened in registers.

The quantised model is a model of its own: the strategies are exact to it (a strategy equals greedy `ar` of the
model it runs), and it is close to `dequantized(model)` -- the same numbers in float -- by the order of
accumulation only, which the tests bound. How far it is from the float model is a matter of measurement
(`dlm-studio bench --quant int8` against a float run), not of exactness."""
from __future__ import annotations

import copy
import importlib.util

import torch
from torch import nn

from studio.engine.model import Linear, unfuse_projections
from studio.engine.moe import Experts
from studio.errors import BadInput

QUANTS = ("none", "int8", "fp8")
# each scheme's storage and the magnitude a row's largest weight maps to
_STORAGE = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def check_quant(kind: str, device: torch.device) -> None:
    """BadInput, in one line, where `kind` has no kernel on `device`: int8 runs on the CPU (our kernel) and on CUDA
    (Triton); fp8 on CUDA devices of compute capability 8.9 or newer (Ada, Hopper: e4m3 in Triton). Elsewhere every
    product would widen every weight in memory, slower than not quantising."""
    if kind == "none":
        return
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise BadInput(f"--quant {kind} on CUDA needs Triton (pip install triton)")
    if kind == "fp8" and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise BadInput("--quant fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                       "--quant int8 runs on the CPU and on any CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise BadInput(f"--quant {kind} runs on the CPU and on CUDA, not on {device.type}")


def quantized_rows(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, D] in one byte and fp32 scales [..., N]: each row over its largest magnitude / the scheme's top,
    rounded to the nearest int8 step or e4m3 value."""
    dtype, top = _STORAGE[kind]
    w = w.detach().float()
    scale = (w.abs().amax(dim=-1) / top).clamp(min=torch.finfo(torch.float32).tiny)   # a zero row: any scale
    scaled = w / scale[..., None]
    q = torch.round(scaled).clamp(-top, top).to(dtype) if dtype == torch.int8 else scaled.clamp(-top, top).to(dtype)
    return q, scale.contiguous()


def quantize(model: nn.Module, kind: str = "int8") -> None:
    """Every `Linear` of the model and every MoE's experts in one byte (`kind`: int8 | fp8) with fp32 row scales, and a
    1-byte copy of the head beside the float one (which a tied embedding keeps reading), in place. Call it once the
    model is on its device and dtype, before `fuse_projections` (a fused product concatenates its parts' rows and
    scales)."""
    quantize_layers(model, kind)
    quantize_head(model, kind)


def quantize_layers(module: nn.Module, kind: str) -> None:
    """`quantize` for the projections and experts within `module` (a layer, as a model is placed one at a time)."""
    for m in module.modules():
        if isinstance(m, Linear) and m.scale is None:
            assert not m.fused, "quantise before fusing"
            q, m.scale = quantized_rows(m.weight, kind)
            m.weight = nn.Parameter(q, requires_grad=False)
        elif isinstance(m, Experts) and m.scales is None:
            m.scales = {}
            for name in m.PROJECTIONS:
                q, m.scales[name] = quantized_rows(getattr(m, name), kind)
                setattr(m, name, nn.Parameter(q, requires_grad=False))


def quantize_head(model: nn.Module, kind: str) -> None:
    if model.head_scale is None:
        model.head_quant, model.head_scale = quantized_rows(model.lm_head.weight, kind)


def is_quantized(model: nn.Module) -> bool:
    return model.head_scale is not None   # `quantize` makes the 1-byte head with the layers


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of a quantised model (or layer) with float weights holding the same numbers (1-byte x scale), unfused: the
    oracle the kernels are tested against, and a float model's stand-in for timing."""
    twin = copy.deepcopy(model)
    unfuse_projections(twin)
    for m in twin.modules():
        if isinstance(m, Linear) and m.scale is not None:
            m.weight = nn.Parameter(m.weight.float() * m.scale[:, None], requires_grad=False)
            m.scale = None
        elif isinstance(m, Experts) and m.scales is not None:
            for name in m.PROJECTIONS:
                widened = getattr(m, name).float() * m.scales[name][..., None]
                setattr(m, name, nn.Parameter(widened, requires_grad=False))
            m.scales = None
    if getattr(twin, "head_scale", None) is not None:   # a model's head of its own (a tied embedding keeps its float rows)
        twin.lm_head.weight = nn.Parameter(twin.head_quant.float() * twin.head_scale[:, None], requires_grad=False)
        twin.head_quant = twin.head_scale = None
    return twin
