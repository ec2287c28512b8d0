"""Self-checks of tests/reference.py against differently written formulations (CPU only, no fused_ops needed)."""
import math

import pytest
import torch

from reference import local_positions, rope_reference


def _rand_freqs(n, d2):
    """Random angles: the two members of every pair differ, so a wrong pairing is caught."""
    return (torch.rand(n, 1, 1, d2, dtype=torch.float32) * 2 - 1) * 4


def _te_freqs(n, d2, interleaved, base=10000.0, dtype=torch.float32):
    """Angles as TE's RotaryPositionEmbedding lays them out (both members of a pair share an angle)."""
    inv = 1.0 / base ** (torch.arange(0, d2, 2, dtype=torch.float64) / d2)
    f = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    f = torch.stack((f, f), -1).reshape(n, d2) if interleaved else torch.cat((f, f), -1)
    return f.to(dtype).reshape(n, 1, 1, d2)


def _chunk_position(s, L, start, cp_size, cp_rank):
    """Position from the load-balanced CP layout: the full sequence (L*cp_size) is cut into 2*cp_size chunks of
    L/2; rank r holds chunk r then chunk 2*cp_size-1-r."""
    if cp_size == 1:
        return s + start
    half = L // 2
    chunk = cp_rank if s < half else 2 * cp_size - 1 - cp_rank
    return start + chunk * half + s % half


def _scalar_rope(t, freqs, fmt, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward):
    """Element-by-element, TE-kernel style: out[d] = x[d] cos f[d] + rot(x)[d] sin f[d] (small inputs only)."""
    x = t.double().tolist()
    f = freqs.double().reshape(freqs.shape[0], -1).tolist()
    d2 = len(f[0])
    half = d2 // 2
    out = t.double().clone()
    if fmt == "thd":
        rows = []
        for i in range(len(cu_seqlens) - 1):
            r0, r1 = cu_seqlens[i] // cp_size, cu_seqlens[i + 1] // cp_size
            rows += [(r, r - r0, r1 - r0, i) for r in range(r0, r1)]
    else:
        S, B = (t.shape[0], t.shape[1]) if fmt == "sbhd" else (t.shape[1], t.shape[0])
        rows = [((s, b) if fmt == "sbhd" else (b, s), s, S, b) for s in range(S) for b in range(B)]
    for idx, s, L, b in rows:
        st = start_positions[b] if start_positions is not None else 0
        p = _chunk_position(s, L, st, cp_size, cp_rank)
        if isinstance(idx, tuple):
            xr = x[idx[0]][idx[1]]
        else:
            xr = x[idx]
        for h, v in enumerate(xr):
            for dd in range(d2):
                if interleaved:
                    partner, first = (dd + 1, True) if dd % 2 == 0 else (dd - 1, False)
                else:
                    partner, first = (dd + half, True) if dd < half else (dd - half, False)
                if not backward:
                    rot = -v[partner] if first else v[partner]
                    val = v[dd] * math.cos(f[p][dd]) + rot * math.sin(f[p][dd])
                else:  # transpose: the partner's sine
                    sp = math.sin(f[p][partner])
                    val = v[dd] * math.cos(f[p][dd]) + (v[partner] * sp if first else -v[partner] * sp)
                if isinstance(idx, tuple):
                    out[idx[0], idx[1], h, dd] = val
                else:
                    out[idx, h, dd] = val
    return out


CASES = [
    # fmt, shape, d2, cu_seqlens, start_positions, cp_size, cp_rank
    ("sbhd", (5, 2, 3, 8), 8, None, None, 1, 0),
    ("sbhd", (6, 3, 2, 10), 6, None, [0, 3, 1], 1, 0),
    ("bshd", (2, 7, 3, 12), 8, None, [2, 0], 1, 0),
    ("sbhd", (4, 2, 2, 8), 8, None, None, 2, 0),
    ("bshd", (2, 4, 2, 8), 4, None, None, 2, 1),
    ("sbhd", (6, 1, 2, 8), 8, None, [1], 3, 2),
    ("thd", (11, 3, 8), 8, [0, 4, 5, 11], None, 1, 0),
    ("thd", (11, 2, 10), 6, [0, 4, 5, 11], [3, 0, 1], 1, 0),
    ("thd", (10, 2, 8), 8, [0, 8, 12, 20], None, 2, 0),
    ("thd", (10, 2, 8), 4, [0, 8, 12, 20], None, 2, 1),
]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_scalar_formulation(case, interleaved, backward):
    fmt, shape, d2, cu, sp, cp, rank = case
    t = torch.randn(shape, dtype=torch.float32)
    smax = 40
    freqs = _rand_freqs(smax, d2)
    ref = rope_reference(t, freqs, fmt, interleaved, cu, sp, cp, rank, backward=backward)
    alt = _scalar_rope(t, freqs, fmt, interleaved, cu, sp, cp, rank, backward)
    assert ref.dtype == torch.float64 and ref.shape == t.shape
    torch.testing.assert_close(ref, alt, rtol=1e-12, atol=1e-12)
    assert torch.equal(ref[..., d2:], t[..., d2:].double())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_complex_multiplication(case, interleaved):
    """With TE-style freqs (pair members share one angle) RoPE is z * exp(i*theta) on complex pairs."""
    fmt, shape, d2, cu, sp, cp, rank = case
    t = torch.randn(shape, dtype=torch.float64)
    smax = 40
    freqs = _te_freqs(smax, d2, interleaved)
    ref = rope_reference(t, freqs, fmt, interleaved, cu, sp, cp, rank)
    # positions of every row, laid out like t's leading dims
    if fmt == "thd":
        pos = torch.empty(shape[0], dtype=torch.int64)
        for i in range(len(cu) - 1):
            r0, r1 = cu[i] // cp, cu[i + 1] // cp
            pos[r0:r1] = local_positions(r1 - r0, sp[i] if sp else 0, cp, rank)
    else:
        B, S = (shape[1], shape[0]) if fmt == "sbhd" else (shape[0], shape[1])
        pos_bs = torch.stack([local_positions(S, sp[b] if sp else 0, cp, rank) for b in range(B)])
        pos = pos_bs.t() if fmt == "sbhd" else pos_bs
    f = freqs.double().reshape(smax, d2)
    theta = f[pos][..., None, 0::2] if interleaved else f[pos][..., None, : d2 // 2]  # [..., 1, d2/2]
    rot = t[..., :d2]
    if interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], d2 // 2, 2).contiguous())
    else:
        z = torch.complex(rot[..., : d2 // 2], rot[..., d2 // 2:])
    w = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        alt_rot = torch.view_as_real(w).reshape(rot.shape)
    else:
        alt_rot = torch.cat((w.real, w.imag), -1)
    alt = torch.cat((alt_rot, t[..., d2:]), -1)
    torch.testing.assert_close(ref, alt, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_backward_is_transpose(case, interleaved):
    """<fwd(x), g> == <x, bwd(g)> for random (unequal-pair) freqs, and bwd == J^T via autograd of a
    differentiable rotate-half formulation."""
    fmt, shape, d2, cu, sp, cp, rank = case
    freqs = _rand_freqs(40, d2)
    x = torch.randn(shape, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    lhs = (rope_reference(x, freqs, fmt, interleaved, cu, sp, cp, rank) * g).sum()
    rhs = (x * rope_reference(g, freqs, fmt, interleaved, cu, sp, cp, rank, backward=True)).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-12, atol=1e-12)

    # J^T g through autograd of an independent per-channel formulation
    xr = x.clone().requires_grad_(True)
    ang = _angles_per_row(shape, fmt, freqs, cu, sp, cp, rank)  # [..., 1, d2]
    rot = xr[..., :d2]
    if interleaved:
        pairs = rot.reshape(*rot.shape[:-1], d2 // 2, 2)
        rh = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).reshape(rot.shape)
    else:
        rh = torch.cat((-rot[..., d2 // 2:], rot[..., : d2 // 2]), -1)
    y = torch.cat((rot * torch.cos(ang) + rh * torch.sin(ang), xr[..., d2:]), -1)
    torch.testing.assert_close(y.detach(), rope_reference(x, freqs, fmt, interleaved, cu, sp, cp, rank),
                               rtol=1e-12, atol=1e-12)
    (vjp,) = torch.autograd.grad(y, xr, g)
    torch.testing.assert_close(vjp, rope_reference(g, freqs, fmt, interleaved, cu, sp, cp, rank, backward=True),
                               rtol=1e-12, atol=1e-12)


def _angles_per_row(shape, fmt, freqs, cu, sp, cp, rank):
    f = freqs.double().reshape(freqs.shape[0], -1)
    if fmt == "thd":
        rows = []
        for i in range(len(cu) - 1):
            r0, r1 = cu[i] // cp, cu[i + 1] // cp
            rows += [_chunk_position(s, r1 - r0, sp[i] if sp else 0, cp, rank) for s in range(r1 - r0)]
        return f[torch.tensor(rows, dtype=torch.int64)][:, None, :]
    S, B = (shape[0], shape[1]) if fmt == "sbhd" else (shape[1], shape[0])
    pos = torch.tensor([[_chunk_position(s, S, sp[b] if sp else 0, cp, rank) for s in range(S)] for b in range(B)])
    if fmt == "sbhd":
        pos = pos.t()
    return f[pos][..., None, :]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_is_orthogonal_with_shared_angles(interleaved):
    """With TE-style freqs every pair is a plain rotation, so bwd(fwd(x)) == x and norms are kept."""
    x = torch.randn(9, 2, 3, 16, dtype=torch.float64)
    freqs = _te_freqs(9, 12, interleaved)
    y = rope_reference(x, freqs, interleaved=interleaved)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rope_reference(y, freqs, interleaved=interleaved, backward=True), x,
                               rtol=1e-12, atol=1e-12)


def test_relative_position_property():
    """<rope(q)@m, rope(k)@n> depends on m - n only (TE-style freqs, kept in float64 so angles add exactly)."""
    d = 16
    freqs = _te_freqs(32, d, False, dtype=torch.float64)
    q = torch.randn(1, 1, 1, d, dtype=torch.float64).expand(32, 1, 1, d)
    k = torch.randn(1, 1, 1, d, dtype=torch.float64).expand(32, 1, 1, d)
    rq, rk = rope_reference(q, freqs), rope_reference(k, freqs)
    dots = torch.einsum("mbhd,nbhd->mn", rq, rk)
    for delta in (0, 3, -5):
        diag = torch.diagonal(dots, offset=delta)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)


def test_thd_single_sequence_matches_sbhd_and_cp_ranks_tile_the_sequence():
    """A thd batch of one sequence is sbhd with b=1; under CP the ranks' positions tile 0..N-1 exactly once."""
    x = torch.randn(12, 2, 8, dtype=torch.float64)
    freqs = _rand_freqs(12, 8)
    a = rope_reference(x, freqs, "thd", cu_seqlens=[0, 12])
    b = rope_reference(x[:, None], freqs, "sbhd")[:, 0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for cp in (2, 3):
        L = 12 // cp
        allpos = torch.cat([local_positions(L, 0, cp, r) for r in range(cp)])
        assert sorted(allpos.tolist()) == list(range(12))


def test_empty_and_strided_inputs():
    freqs = _rand_freqs(8, 4)
    for shape, fmt, cu in (((0, 2, 3, 8), "sbhd", None), ((2, 0, 3, 8), "bshd", None), ((0, 3, 8), "thd", [0])):
        out = rope_reference(torch.empty(shape), freqs, fmt, cu_seqlens=cu)
        assert out.shape == shape and out.dtype == torch.float64
    base = torch.randn(6, 2, 3, 24)
    view = base[..., 8:16]  # strided view
    torch.testing.assert_close(rope_reference(view, freqs), rope_reference(view.contiguous(), freqs), rtol=0, atol=0)


def test_reference_refuses_inconsistent_arguments():
    x = torch.randn(6, 2, 3, 8)
    with pytest.raises(ValueError, match="positions"):
        rope_reference(x, _rand_freqs(5, 8))
    with pytest.raises(ValueError, match="positions"):
        rope_reference(x, _rand_freqs(6, 8), start_positions=[0, 1])
    with pytest.raises(ValueError, match="even"):
        rope_reference(x[:5], _rand_freqs(20, 8), cp_size=2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rope_reference(x[:, 0], _rand_freqs(20, 8), "thd", cu_seqlens=[0, 3, 5])


def test_te_shape_is_fast_enough():
    """The reference must handle TE's largest test shape (s=4096, b=2, h=64, d=256) in a few seconds."""
    import time

    x = torch.randn(4096, 2, 64, 256, dtype=torch.bfloat16)
    freqs = _te_freqs(4096, 128, False)
    t0 = time.perf_counter()
    out = rope_reference(x, freqs)
    dt = time.perf_counter() - t0
    assert out.shape == x.shape
    assert dt < 30, f"reference took {dt:.1f}s"  # loose bound for a 2-core CI box; typically a few seconds
