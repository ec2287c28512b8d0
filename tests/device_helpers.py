"""Helpers the op tests share for running on a device (CPU or CUDA)."""
import torch


def poison_allocator(device, nbytes):
    """Leaves a NaN-filled block of `nbytes` in the CUDA caching allocator, so an output that reuses it and is not
    fully written shows NaN. No-op on CPU."""
    if torch.device(device).type == "cuda" and nbytes > 0:
        junk = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=device)
        del junk


def requested_bytes(device, stat="current"):
    """The bytes callers of torch's caching allocator asked for (`requested_bytes.all.<stat>`, "current" or "peak"
    since reset_peak_memory_stats): the memory an op allocates. memory_allocated counts blocks instead, and a request
    served whole by a larger cached block (the allocator does not split one when less than 1 MiB would remain) counts
    as that block: an earlier test's free 3 MiB block made a 3.07 MB h count 3.15 MB."""
    return torch.cuda.memory_stats(device)[f"requested_bytes.all.{stat}"]


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def tail_of(cfg):
    """(split, stream_k) of a config string such as fused_ops.kernel_config returns: the column slices of its last
    round and the rounds it shares out by K steps, 0 for none (its suffix: aot/config_table.py SPLIT_SUFFIX,
    STREAM_K_SUFFIX)."""
    from aot import config_table as ct
    suffix = cfg[cfg.rfind("_"):]
    split = {s: parts for parts, s in ct.SPLIT_SUFFIX.items()}.get(suffix, 0)
    stream_k = {s: rounds for rounds, s in ct.STREAM_K_SUFFIX.items()}.get(suffix, 0)
    return split, stream_k


def block_of(cfg):
    """(BLOCK_M, BLOCK_N) of a config string such as fused_ops.kernel_config returns ("128x256x64_g8_w8_s3_sk")."""
    bm, bn = (int(v) for v in cfg.split("_")[0].split("x")[:2])
    return bm, bn


def split_counts(kernel, M, K, cc, sms, wt=None):
    """(c0, c1, N) for the persistent routed GEMM `kernel` at M rows and reduction K (wt: its orientation, for
    routed_linear_tma_kernel), such that the table's config for that GEMM (its shape class included) shares out a last
    partial round: "split" (in S column slices, kernels/gemm_tiles.py _split_tail) or "stream_k" (by K steps,
    _sk_share). Both experts' last row tiles partial (c0 + c1 = M rows), N's last column tile partial (N a multiple
    of 32), the tile count T above the SM count and its last round one the config shares out (split:
    0 < S (T mod SMs) <= SMs; stream-K: 0 < 2 (T mod SMs) <= SMs, _sk_share's rule). None where no N gives that (not
    sm_90, an "off" bucket, or no such config at M)."""
    import fused_ops
    if cc // 10 != 9:
        return None
    for N in range(64, 16384 + 1, 32):
        cfg = fused_ops.kernel_config(kernel, "half", M, cc, N, K, wt)
        split, stream_k = tail_of(cfg)
        if not (stream_k or split):
            continue
        bm, bn = block_of(cfg)
        c0 = M // 2 - 10
        c1 = M - c0
        if N % bn == 0 or c0 % bm == 0 or c1 % bm == 0:
            continue
        tiles = (-(-c0 // bm) + -(-c1 // bm)) * -(-N // bn)
        r = tiles % sms
        if tiles > sms and 0 < (split or 2) * r <= sms:
            return c0, c1, N
    return None
