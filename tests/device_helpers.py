"""Helpers the op tests share for running on a device (CPU or CUDA)."""
import torch


def poison_allocator(device, nbytes):
    """Leaves a NaN-filled block of `nbytes` in the CUDA caching allocator, so an output that reuses it and is not
    fully written shows NaN. No-op on CPU."""
    if torch.device(device).type == "cuda" and nbytes > 0:
        junk = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=device)
        del junk


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
