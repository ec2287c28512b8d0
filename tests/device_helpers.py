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


def split_counts(kernel, M, cc, sms):
    """(c0, c1, N) for the persistent routed GEMM `kernel` at M rows, whose table config there has "split", such that
    its last partial round is split in column halves (kernels/gemm_tiles.py _split_tail): both experts' last row tiles
    partial (c0 + c1 = M rows), and N (its last column tile partial, a multiple of 32) such that the tile count T
    exceeds the SM count and leaves 0 < 2 (T mod SMs) <= SMs. None where the kernel does not serve M (not sm_90, or
    an "off" bucket)."""
    import fused_ops
    cfg = fused_ops.kernel_config(kernel, "half", M, cc)
    if cc // 10 != 9 or cfg == "off":
        return None
    assert cfg.endswith("_t"), f"{kernel} at m = {M}: the table's config {cfg} does not split its last round"
    bm, bn = (int(v) for v in cfg.split("_")[0].split("x")[:2])
    c0 = M // 2 - 10
    c1 = M - c0
    assert c0 % bm and c1 % bm, (c0, c1, bm)
    row_tiles = -(-c0 // bm) + -(-c1 // bm)
    cols = next(c for c in range(1, 1024) if row_tiles * c > sms and 0 < 2 * ((row_tiles * c) % sms) <= sms)
    return c0, c1, cols * bn - bn // 4
