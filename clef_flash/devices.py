"""Which torch device runs arithmetic (``--device auto|cpu|cuda|mps``): the weight planner and the
torch engine pick it the same way, a device asked for by name and not there refused (exit 2)."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Device:
    """Where torch arithmetic runs (the weight planner's, the torch engine's): the torch device, its
    name for a record, and whether the weights stay on it once read (they fit) or are streamed a layer at a time."""

    torch_device: str
    label: str
    hold: bool


def device_name(name: str) -> str:
    """``auto`` resolved (CUDA, then Apple's MPS, then the CPU); a device asked for by name that torch
    does not see is refused (exit 2), before any work."""
    import torch

    if name not in ("auto", "cpu", "cuda", "mps"):
        raise UsageError(f"--device must be auto, cpu, cuda or mps, got {name!r}")
    cuda = torch.cuda.is_available()
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "cuda" and not cuda:
        raise UsageError(f"--device cuda: torch {torch.__version__} sees no CUDA device here (--device auto picks what there is)")
    if name == "mps" and not mps:
        raise UsageError(f"--device mps: torch {torch.__version__} sees no Apple MPS device here (--device auto picks what there is)")
    return name if name != "auto" else ("cuda" if cuda else "mps" if mps else "cpu")


def pick_device(name: str, fp32_bytes: int) -> Device:
    """Where the arithmetic runs, and whether ``fp32_bytes`` of weights stay there. fp32 throughout:
    TF32 off, so every device computes what the CPU does up to rounding."""
    import torch

    chosen = device_name(name)
    if chosen == "cpu":
        return Device("cpu", "cpu", hold=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if chosen == "cuda":
        free, _total = torch.cuda.mem_get_info()
        label = f"cuda ({torch.cuda.get_device_name()})"
    else:
        free = int(torch.mps.recommended_max_memory()) - int(torch.mps.current_allocated_memory())
        label = "mps"
    return Device(chosen, label, hold=free > 1.5 * fp32_bytes)  # room for the activations, the dequantized layer, the head
