"""Decode attention against a KV cache (flash-decoding), with the new tokens' keys and values written into the cache
in the same launch (issue #56: generate at the HBM bandwidth floor).

What one call computes (the contract: csrc/torch_bindings.cpp `decode_attention`): for every sequence b, T (1-16) new
query tokens q[b, t] attend the cache positions 0 .. L-1 (L = cache_lens[b], ragged) and the new tokens 0 .. t
(causal among the new tokens, whose keys and values come from k_new / v_new, not from the cache); the new keys and
values are stored at cache positions L .. L+T-1. Grouped-query attention: query head h reads KV head h // G.

A decode step reads the whole cache once and computes little: it is bound by HBM bandwidth. So:
* One program reads each KV head's cache for all G·T query rows of that head (G query heads x T tokens, padded to
  BLOCK_M >= 16 rows for tl.dot): the cache is read once, not G times. Where G·T exceeds the config's BLOCK_M, a third
  grid dimension takes the rows BLOCK_M at a time (each chunk reads the KV again; only very wide groups with many
  tokens get there).
* Flash-decoding: where B·Hkv programs cannot fill the GPU (batch 1: 8 KV heads on 132 SMs), the cache length is split
  over n_split programs per head (grid dimension 1). The split count is a host value that depends on the cache's
  capacity S, the grid and the SM count, never on cache_lens (device data: reading it would sync the host, and a CUDA
  graph replays with other lengths). Split s takes key blocks s, s + n_split, s + 2 n_split, ... (BLOCK_N positions
  each) of its sequence's L + T keys: cyclic rather than contiguous ranges, so that a sequence much shorter than the
  cache still spreads over every split (a contiguous partition of S would leave all but its first programs idle), and
  a split whose first block lies past the sequence's end exits at once. Every block but the last one or two lies
  wholly below L: those are read from the cache with no masks and no causal test (the main loop); the tail (the
  blocks that reach L, at most two since BLOCK_N >= 16 >= T) merges cache rows (< L) with k_new / v_new rows and
  applies the causal mask.
* Each split keeps an online softmax in fp32 (running max m, sum l, accumulator acc, base-2 exponentials with the
  scale folded in after the fp32 QK product). One split (n_split = 1, a batch that fills the GPU): the program writes
  out itself. Several: each writes its (m, l, acc) partial to a workspace (fp32, torch-allocated by the op:
  graph-safe), a split whose first block lies past its sequence's end an empty one (m = -inf, weight 0), and
  decode_attention_combine_kernel merges them (a second launch, only where n_split > 1). The combine reads no
  cache_lens, so its loads start at once, and it loads every split's partial of a row at once (one memory latency,
  not n_split in a row), merged in a fixed order: deterministic, no atomics. A separate combine beats the
  last-arriving program merging: that needs a zeroed arrival counter (a memset node per call in a CUDA graph, as
  costly as a launch), and one program merging serially pays a memory latency per row. On sm_90 both kernels are
  launched with programmatic dependent launch (kernels/pdl.py), so the combine's launch overlaps the attention's
  tail.
* The cache write: program (s = 0, chunk 0) of each (b, KV head) stores k_new / v_new rows at L .. L+T-1 (the only
  writer). No program reads a cache position >= L (the tail takes those keys from k_new / v_new), so nothing reads a
  slot while it is written.
* Lengths past the cache (L < 0 or L + T > S): checking them on the host would sync it, so the kernel guards itself:
  such a sequence reads nothing, writes nothing into the cache and gets NaN outputs (split 0 writes l = NaN, which
  the combine carries into every output of the sequence).

Argument contract (csrc/ops/decode_attention_cuda.cpp and tests/decode_attention_interp_launch.py pack it the same):
  q_ptr       [B, T, Hq, D], strides sq_b, sq_t, sq_h (elements), last dim contiguous
  k_new_ptr, v_new_ptr  [B, T, Hkv, D], strides skn_* / svn_*
  k_cache_ptr, v_cache_ptr  [B, Hkv, S, D], strides skc_* / svc_* (b, h, s)
  lens_ptr    int32 [B], cache_lens
  out_ptr     [B, T, Hq, D] contiguous, q's dtype
  ws_ptr      fp32 [B * Hkv, n_split, G * T, D] partial accumulators (only read / written when n_split > 1)
  ml_ptr      fp32 [B * Hkv, n_split, G * T, 2] partial (m, l)
  T, HKV, G, S, n_split; scale (fp32): softmax scale (1/sqrt(D) by default)
  grid (B * Hkv, n_split, cdiv(G * T, BLOCK_M)); HEAD_D, BLOCK_M, BLOCK_N constexpr; T <= MAX_T.
"""
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.pdl import grid_dependency_sync

MAX_T = tl.constexpr(16)  # new tokens per sequence and call (the cache write's row block); MAX_T.value in Python
# The combine kernel: all splits of a row loaded at once, COMBINE_COLS channels of it per program.
COMBINE_MAX_SPLITS = 64
COMBINE_COLS = 64
# The split rule (decode_attention_split; csrc/ops/decode_attention_meta.cpp computes the same): enough splits that
# the grid holds about SPLIT_CTAS_PER_SM programs per SM, each split at least SPLIT_MIN_BLOCKS key blocks of the
# cache's capacity, at most COMBINE_MAX_SPLITS.
SPLIT_CTAS_PER_SM = 2
SPLIT_MIN_BLOCKS = 2


def decode_attention_split(programs, S, block_n, sms):
    """n_split for a grid of `programs` (B * Hkv * row chunks) programs over a cache of capacity S, key blocks of
    block_n, on a device with `sms` SMs. Host values only (no cache_lens): the same for every length,
    as a CUDA graph needs."""
    blocks = triton.cdiv(S, block_n)
    want = triton.cdiv(SPLIT_CTAS_PER_SM * sms, max(programs, 1))
    return max(1, min(want, triton.cdiv(blocks, SPLIT_MIN_BLOCKS), COMBINE_MAX_SPLITS))


@triton.jit
def _attend(q, k, v, m_i, l_i, acc, qk_scale, p_ok, limit, MASKED: tl.constexpr):
    """One key block into the online softmax. q [BLOCK_M, D], k / v [BLOCK_N, D] (q's dtype); m_i / l_i [BLOCK_M]
    (base-2 running max and sum), acc [BLOCK_M, D] fp32. MASKED: key position p_ok[None, :] <= limit[:, None] only
    (the causal tail); else every key counts."""
    qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if MASKED:
        qk = tl.where(p_ok[None, :] <= limit[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # m_i starts finite (-1e30): a fully masked row gives p = 0, no NaN
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def decode_attention_kernel(q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, lens_ptr, out_ptr, ws_ptr, ml_ptr,
                            T, HKV, G, S, n_split, scale,
                            sq_b, sq_t, sq_h, skn_b, skn_t, skn_h, svn_b, svn_t, svn_h,
                            skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
                            HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            PDL: tl.constexpr = False):
    if PDL:  # first: no memory access before the kernel ahead in the stream has finished (kernels/pdl.py)
        gdc_wait()
    pid = tl.program_id(0)
    s = tl.program_id(1)
    chunk = tl.program_id(2)
    b = pid // HKV
    kvh = pid % HKV
    b64 = b.to(tl.int64)
    R = G * T
    offs_d = tl.arange(0, HEAD_D)
    rows = chunk * BLOCK_M + tl.arange(0, BLOCK_M)  # query row r = t * G + g: token t, query head kvh * G + g
    row_ok = rows < R
    t = rows // G
    h = kvh * G + rows % G
    # q is loaded before anything waits for cache_lens: the two loads' latencies overlap (a decode step is short,
    # and every dependent memory round trip is a visible part of it).
    L = tl.load(lens_ptr + b)
    q = tl.load(q_ptr + b64 * sq_b + t.to(tl.int64)[:, None] * sq_t + h.to(tl.int64)[:, None] * sq_h
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    good = (L >= 0) & (L <= S - T)  # else it would read or write outside the cache: NaN out, nothing touched
    n_keys = L + T
    nb = tl.where(good, tl.cdiv(n_keys, BLOCK_N), 1)  # key blocks of the sequence
    part = (pid * n_split + s).to(tl.int64) * R + rows.to(tl.int64)  # [BLOCK_M] this split's partial rows
    if s < nb:  # split s holds block s first, and then every n_split-th
        kn_base = k_new_ptr + b64 * skn_b + kvh.to(tl.int64) * skn_h
        vn_base = v_new_ptr + b64 * svn_b + kvh.to(tl.int64) * svn_h
        kc_base = k_cache_ptr + b64 * skc_b + kvh.to(tl.int64) * skc_h
        vc_base = v_cache_ptr + b64 * svc_b + kvh.to(tl.int64) * svc_h
        if (s == 0) & (chunk == 0) & good:
            # The cache write: this program alone stores the T new rows at L .. L+T-1 (no program reads them there).
            tn = tl.arange(0, MAX_T)
            tn_ok = (tn < T)[:, None]
            pos = (L + tn).to(tl.int64)[:, None]
            kn = tl.load(kn_base + tn.to(tl.int64)[:, None] * skn_t + offs_d[None, :], mask=tn_ok)
            vn = tl.load(vn_base + tn.to(tl.int64)[:, None] * svn_t + offs_d[None, :], mask=tn_ok)
            tl.store(kc_base + pos * skc_s + offs_d[None, :], kn, mask=tn_ok)
            tl.store(vc_base + pos * svc_s + offs_d[None, :], vn, mask=tn_ok)

        qk_scale = scale * 1.4426950408889634  # base-2 exponentials
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        if good:
            n_full = L // BLOCK_N  # blocks wholly below L: cache rows only, every query sees every key
            for j in tl.range(s, n_full, n_split):
                p = (j * BLOCK_N + offs_n).to(tl.int64)[:, None]
                k = tl.load(kc_base + p * skc_s + offs_d[None, :])
                v = tl.load(vc_base + p * svc_s + offs_d[None, :])
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, offs_n, t, False)
            # The tail: blocks n_full .. nb-1 (at most two), this split's of them. Positions < L from the cache, L ..
            # L+T-1 from k_new / v_new; query t sees positions <= L + t.
            first = s + tl.cdiv(tl.maximum(n_full - s, 0), n_split) * n_split
            for j in tl.range(first, nb, n_split, num_stages=1):  # (pipelining it would only add buffers)
                p = j * BLOCK_N + offs_n
                in_cache = (p < L)[:, None]
                is_new = ((p >= L) & (p < n_keys))[:, None]
                p64 = p.to(tl.int64)[:, None]
                tnew = (p - L).to(tl.int64)[:, None]
                k = tl.load(kc_base + p64 * skc_s + offs_d[None, :], mask=in_cache, other=0.0)
                k = tl.where(is_new, tl.load(kn_base + tnew * skn_t + offs_d[None, :], mask=is_new, other=0.0), k)
                v = tl.load(vc_base + p64 * svc_s + offs_d[None, :], mask=in_cache, other=0.0)
                v = tl.where(is_new, tl.load(vn_base + tnew * svn_t + offs_d[None, :], mask=is_new, other=0.0), v)
                m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, p, L + t, True)
        else:
            l_i = tl.full([BLOCK_M], float("nan"), dtype=tl.float32)  # past the cache: NaN out (combined or not)
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32)

        if n_split == 1:
            # The only split: the output directly. Row t, head h of out [B, T, Hq, D] (contiguous).
            out_off = ((b64 * T + t.to(tl.int64)) * (HKV * G) + h.to(tl.int64))[:, None] * HEAD_D + offs_d[None, :]
            tl.store(out_ptr + out_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(ws_ptr + part[:, None] * HEAD_D + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        # A split past the sequence's last block: an empty partial (m = -inf, weight 0; its acc is not written and
        # the combine does not read it), so that the combine needs no cache_lens and no test of its own.
        tl.store(ml_ptr + part * 2, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=row_ok)
        tl.store(ml_ptr + part * 2 + 1, tl.zeros([BLOCK_M], dtype=tl.float32), mask=row_ok)
    if PDL:
        # The next kernel (the combine) may launch once every program got here: late, unlike the routed GEMMs
        # (kernels/pdl.py), so that its programs do not wait on the SMs while this kernel streams the cache (on an
        # H200 an early trigger cost up to a fifth of batch 16's time); its launch still overlaps this one's end.
        gdc_launch_dependents()


@triton.jit
def decode_attention_combine_kernel(ws_ptr, ml_ptr, out_ptr, T, HKV, G, D, n_split,
                                    MAX_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """out for query row r of (b, KV head) from the n_split partials of decode_attention_kernel, channels
    [c * BLOCK_D, (c + 1) * BLOCK_D); grid (B * Hkv, G * T, D / BLOCK_D). All splits are loaded at once (one memory
    latency) and merged by one weighted sum in the compiled order: the same bits on every run. Empty splits have
    m = -inf (weight 0, their unwritten acc ignored); a sequence past the cache has l = NaN in split 0: NaN out."""
    grid_dependency_sync(PDL)  # first: see kernels/pdl.py
    pid = tl.program_id(0)
    r = tl.program_id(1)
    c = tl.program_id(2)
    kvh = pid % HKV
    splits = tl.arange(0, MAX_SPLITS)
    ok = splits < n_split
    part = (pid * n_split + splits).to(tl.int64) * (G * T) + r  # [MAX_SPLITS]
    offs_d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    m = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
    acc = tl.load(ws_ptr + part[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, axis=0))  # split 0 always holds block 0, which every query row sees: a finite max
    used = w > 0
    o = tl.sum(tl.where(used[:, None], acc, 0.0) * w[:, None], axis=0) / tl.sum(tl.where(used, w * l, 0.0), axis=0)
    t = r // G
    h = kvh * G + r % G
    out_off = (((pid // HKV).to(tl.int64) * T + t) * (HKV * G) + h) * D + offs_d
    tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty))
