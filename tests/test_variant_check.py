"""The build's variant check (csrc/ops/variant_check.cpp, run by setup.py after the build): every variant the C++
launchers can ask for, formed by their own key functions from their flag lists over every dtype, precision, token
count and built architecture, is compiled into this build; and the launchers' list and aot/manifest.py agree in both
directions (a compiled variant no launcher can ask for is dead weight in the library). No GPU needed."""
import collections
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import fused_ops  # noqa: E402,F401  (loads the library)
from aot import manifest  # noqa: E402


def _parse(entries):
    """"sm_90 kernel: key" -> {(arch, kernel, key)}"""
    out = set()
    for e in entries:
        arch, rest = e.split(" ", 1)
        kernel, key = rest.split(": ", 1)
        out.add((int(arch[len("sm_"):]), kernel, key))
    return out


def _built_archs():
    return sorted({arch for arch, _, _ in _parse(torch.ops.fused._requestable_variants())})


def _compiled(archs):
    return {(arch, v.name, v.key_str) for v in manifest.variants() for arch in v.archs if arch in archs}


def test_every_requestable_variant_is_compiled():
    assert torch.ops.fused._missing_variants() == []


def test_requests_cover_every_launched_kernel_and_its_configs():
    asked = _parse(torch.ops.fused._requestable_variants())
    assert not [a for a in asked if a[2].startswith("no config")], "a launcher would find no config"
    per_kernel = collections.Counter(k for _, k, _ in asked)
    # every kernel the manifest compiles is one a launcher asks for, and asks for in more than one key where the
    # manifest compiles several (dtypes, flags, configs)
    compiled = _compiled(_built_archs())
    assert set(per_kernel) == {k for _, k, _ in compiled}
    compiled_keys = collections.Counter(k for _, k, _ in compiled)
    for kernel in per_kernel:
        assert per_kernel[kernel] >= min(2, compiled_keys[kernel]), kernel


def test_manifest_compiles_nothing_no_launcher_asks_for():
    """The other direction: a (kernel, key) compiled for an architecture that no launcher can ask for there. The
    manifest compiles each key with and without its alignment assumptions (aot/manifest.py _both), so keys, not
    variants, are compared."""
    archs = _built_archs()
    asked = _parse(torch.ops.fused._requestable_variants())
    unused = sorted(_compiled(archs) - asked)
    assert not unused, f"{len(unused)} compiled variants no launcher asks for, e.g. {unused[:5]}"


def test_cpp_check_agrees_with_the_manifest():
    """The C++ comparison (has_variant over the compiled table) against the same comparison done here from
    aot/manifest.py: the same gaps (none, in a sound build)."""
    archs = _built_archs()
    asked = _parse(torch.ops.fused._requestable_variants())
    assert _parse(torch.ops.fused._missing_variants()) == asked - _compiled(archs)
