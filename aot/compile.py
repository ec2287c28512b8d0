"""Ahead-of-time compiler driver: Triton kernels -> cubins + PTX + a C++ table, with no GPU.

    python -m aot.compile --out build/aot [--archs auto|all|80,89,90] [--jobs N]

For every variant in aot/manifest.py and every architecture, `triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))` produces a cubin. The PTX is kept only where it is a real fallback: for the
lowest built architecture when that is below sm_90, so that a newer GPU (sm_100, sm_120) can JIT the kernels that
exist for it through the driver. sm_90 code is sm_90a (wgmma, TMA), whose PTX no other architecture can compile.

Which architectures (resolve_archs): `auto`, the default, builds for the GPUs this machine has (nvidia-smi, else
torch.cuda), and where none is visible for every supported GPU (manifest.PORTABLE_ARCHS: sm_80 cubins and PTX, sm_90
cubins; a wheel, CI); `all` builds every architecture that has a table (manifest.ARCHS, sm_89 too); or a list such as
`80,90`. FUSED_ARCHS sets the same for setup.py and CMake.

Results are cached under `<out>/cache/` keyed by the kernel's source (its @triton.jit function and those it calls),
the Triton version, the target and the options, so a rebuild compiles only the images of the kernels that changed.
Compilation runs in a process pool on all cores and prints its progress (images done / total and an estimate of the
time left). The output is `<out>/kernels_gen.cpp`, the variant table that csrc/runtime/kernel_table.h declares, and
`<out>/kernel_decls.h`, each kernel's argument struct and the constants the launchers share (aot/cpp_decls.py). The
table holds every image zlib-compressed (`<out>/cache/<key>.*.z`; csrc/runtime/image.cpp inflates an image when a
device first loads it): cubins compress about 4x, and the library is what every install, wheel and container layer
carries.
"""
import argparse
import concurrent.futures as cf
import hashlib
import importlib
import json
import os
import subprocess
import sys
import time
import zlib

# The AOT step compiles; Triton's interpreter (TRITON_INTERPRET=1, e.g. inherited from the interpreter tests that
# spawn a CMake build) would turn every kernel into an InterpretedFunction that cannot be compiled.
os.environ.pop("TRITON_INTERPRET", None)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from aot import config_table, cpp_decls, manifest  # noqa: E402

# Argument type codes shared with csrc/runtime/kernel_table.h.
_TYPE_CODE = {"i1": "i", "i8": "i", "i16": "i", "i32": "i", "u32": "i", "i64": "l", "u64": "l", "fp32": "f"}


def _type_code(ty: str) -> str:
    if ty.startswith("*"):
        return "p"
    if ty.startswith("tensordesc"):
        return "t"
    return _TYPE_CODE[ty]


def _kernel_hash(kernel: str) -> str:
    """Triton's own cache key of a @triton.jit function: its source and that of every jit function it calls."""
    return _kernel_fn(kernel).cache_key


def _kernel_fn(kernel: str):
    mod_name, fn_name = kernel.split(":")
    return getattr(importlib.import_module(mod_name), fn_name)


def _meta(v: manifest.Variant, arch: int) -> dict:
    """v's constexpr meta-parameters for `arch`: the manifest's, plus PDL (kernels/pdl.py) for the kernels that take
    it, true where the architecture has programmatic dependent launch (sm_90 and later)."""
    meta = dict(v.meta)
    if "PDL" in _kernel_fn(v.kernel).arg_names:
        meta["PDL"] = arch >= 90
    return meta


def _job_key(v: manifest.Variant, arch: int, triton_version: str) -> str:
    desc = json.dumps({"kernel": v.kernel, "args": v.args, "meta": {k: str(x) for k, x in _meta(v, arch).items()},
                       "spec": {k: str(x) for k, x in v.spec.items()}, "warps": v.num_warps,
                       "stages": v.num_stages, "arch": arch, "src": _kernel_hash(v.kernel), "triton": triton_version},
                      sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:24]


def compile_variant(v: manifest.Variant, arch: int):
    """triton.compile of one variant for one architecture (no GPU needed): the CompiledKernel (asm, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_fn(v.kernel)
    names = list(fn.arg_names)
    signature, constexprs, attrs = {}, {}, {}
    for name, ty in v.args:
        spec = v.spec.get(name)
        if isinstance(spec, tuple) and spec[0] == "eq":
            signature[name] = "constexpr"
            constexprs[name] = spec[1]
        else:
            signature[name] = ty
            if spec == 16:
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    for name, value in _meta(v, arch).items():
        signature[name] = "constexpr"
        constexprs[name] = value
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"{v.kernel}: manifest gives no value for {missing}")
    src = ASTSource(fn, {n: signature[n] for n in names}, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": v.num_warps, "num_stages": v.num_stages})


def _visible_archs():
    """The build targets of the GPUs this machine has (compute capability -> the manifest architecture whose image it
    runs: sm_86/87 run sm_80 cubins, a GPU above sm_90 the sm_80 PTX), or () where none is visible."""
    caps = []
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        if res.returncode == 0:
            caps = [round(float(c) * 10) for c in res.stdout.split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    if not caps:
        try:
            import torch
            if torch.cuda.is_available():
                caps = [a * 10 + b for a, b in (torch.cuda.get_device_capability(i)
                                                for i in range(torch.cuda.device_count()))]
        except Exception:  # no torch, no driver: nothing visible
            caps = []
    out = set()
    for cc in caps:
        same_major = [a for a in manifest.ARCHS if a // 10 == cc // 10 and a <= cc]
        out.add(max(same_major) if same_major else min(manifest.ARCHS))
    return tuple(sorted(out))


def resolve_archs(spec=None):
    """The architectures to build: spec (else $FUSED_ARCHS, else "auto") as "auto", "all" or a list "80,89,90"
    (module doc)."""
    spec = (spec if spec is not None else os.environ.get("FUSED_ARCHS", "")).strip().replace(";", ",") or "auto"
    if spec == "all":
        return tuple(manifest.ARCHS)
    if spec == "auto":
        return _visible_archs() or tuple(manifest.PORTABLE_ARCHS)
    try:
        archs = tuple(sorted({int(a) for a in spec.split(",") if a.strip()}))
    except ValueError:
        raise ValueError(f"FUSED_ARCHS / --archs: expected auto, all or a list such as 80,90, got {spec!r}") from None
    bad = [a for a in archs if a not in manifest.ARCHS]
    if bad or not archs:
        raise ValueError(f"FUSED_ARCHS / --archs: {spec!r} names no architecture or ones the kernels are not built "
                         f"for ({bad}); supported: {', '.join(map(str, manifest.ARCHS))}")
    return archs


def _portable_ptx(arch: int) -> bool:
    """Whether arch's PTX can serve another GPU (below sm_90: sm_90 code is sm_90a). The cache keeps such PTX."""
    return arch < 90


def _keep_ptx(arch: int, archs) -> bool:
    """The PTX of the lowest built architecture, where it is portable."""
    return arch == min(archs) and _portable_ptx(arch)


def _compressed(path: str) -> str:
    """path's bytes zlib-compressed into path + ".z" (once: the cache keeps it), with a NUL after a PTX's text."""
    z = path + ".z"
    if not os.path.exists(z):
        with open(path, "rb") as f:
            data = f.read() + (b"\0" if path.endswith(".ptx") else b"")
        with open(z + ".tmp", "wb") as f:
            f.write(zlib.compress(data, 9))
        os.replace(z + ".tmp", z)
    return z


def write_if_changed(path: str, text: str) -> None:
    """Writes text to path unless the file holds it already: an unchanged generated source keeps its time stamp, so
    the C++ build does not compile it again (setup_env.sh runs the AOT step, then pip's build runs it once more)."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _compile_one(job):
    """Runs in a worker process: compiles one (variant, arch) and writes cubin/ptx/meta into the cache, each image
    compressed too (in the pool, not serially when the table is generated)."""
    v, arch, cache_dir, key = job
    t0 = time.time()
    k = compile_variant(v, arch)
    md = k.metadata
    meta = {"entry": md.name, "shared": md.shared, "num_warps": md.num_warps, "num_ctas": md.num_ctas,
            "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
            "tensordesc_meta": list(getattr(md, "tensordesc_meta", None) or []),
            "pdl": int(bool(_meta(v, arch).get("PDL", False))),
            "seconds": round(time.time() - t0, 2)}
    with open(os.path.join(cache_dir, key + ".cubin"), "wb") as f:
        f.write(k.asm["cubin"])
    _compressed(os.path.join(cache_dir, key + ".cubin"))
    if _portable_ptx(arch):  # kept whichever architectures this build embeds PTX for: the cache serves every build
        with open(os.path.join(cache_dir, key + ".ptx"), "w") as f:
            f.write(k.asm["ptx"])
        _compressed(os.path.join(cache_dir, key + ".ptx"))
    with open(os.path.join(cache_dir, key + ".json"), "w") as f:  # written last: marks the entry complete
        json.dump(meta, f)
    return key


def _incbin(sym: str, path: str) -> str:
    """Embeds a file as a read-only symbol: the assembler reads the bytes, so a large image costs no C++ parsing."""
    path = os.path.abspath(path).replace("\\", "/")
    return (f'extern "C" const unsigned char {sym}[];\n'
            f'__asm__(".section .rodata\\n.balign 16\\n.globl {sym}\\n.hidden {sym}\\n{sym}:\\n.incbin \\"{path}\\"\\n'
            '.previous\\n");')


# Triton's device-side TMA dtype enum differs from the driver's CUtensorMapDataType in three places.
_TMA_DTYPE_DEVICE_TO_HOST = {8: 10, 9: 8, 10: 9}


def _tma_row(m) -> str:
    box = list(m["block_size"])
    host_type = _TMA_DTYPE_DEVICE_TO_HOST.get(m["elem_type"], m["elem_type"])
    if m.get("fp4_padded"):
        raise NotImplementedError("fp4-padded tensor descriptors")
    return (f'{{{m["swizzle"]}, {m["elem_size"]}, {host_type}, {len(box)}, '
            f'{{{", ".join(str(b) for b in box + [0] * (5 - len(box)))}}}}}')


def _config_rows(archs) -> str:
    """The buckets (m range and shape class) of every kernel config table of the built architectures
    (csrc/runtime/kernel_table.h)."""
    rows = []
    for arch in archs:
        for kernel, fams in manifest.table(arch)["kernels"].items():
            for fam, buckets in fams.items():
                for e in buckets:  # an "off" bucket: cfg "off", zero sizes (the launchers check cfg first)
                    blk = ", ".join(str(b) for b in e.get("block", [0, 0, 0]))
                    wt = -1 if e.get("w_transposed") is None else int(e["w_transposed"])
                    rows.append(f'{{"{kernel}", "{fam}", {arch}, {e.get("max_m", -1)}, {e.get("max_n", -1)}, '
                                f'{e.get("max_k", -1)}, {wt}, {{{blk}}}, {e.get("group", 1)}, '
                                f'{e.get("warps", 0)}, {e.get("stages", 0)}, {int(e.get("stream_k", 0))}, '
                                f'"{config_table.cfg_str(e)}"}}')
    return ("const KernelConfig kConfigs[] = {\n  " + ",\n  ".join(rows) + "};\n"
            f"const size_t kNumConfigs = {len(rows)};\n"
            f"const int kArchs[] = {{{', '.join(str(a) for a in archs)}}};\n"
            f"const size_t kNumArchs = {len(archs)};")


def _flag_rows() -> str:
    """manifest.FLAG_SETS as kFlagSets (csrc/runtime/kernel_table.h): each combination an int, the first flag highest."""
    arrays, rows = [], []
    for i, (kernel, (names, combos)) in enumerate(manifest.FLAG_SETS.items()):
        ints = [int("".join(str(int(b)) for b in c), 2) for c in combos]
        arrays.append(f"const int kFlagCombos{i}[] = {{{', '.join(map(str, ints))}}};")
        rows.append(f'{{"{kernel}", {len(names)}, kFlagCombos{i}, {len(ints)}}}')
    return ("\n".join(arrays) + "\nconst FlagSet kFlagSets[] = {\n  " + ",\n  ".join(rows) + "};\n"
            f"const size_t kNumFlagSets = {len(rows)};")


def _check_shared(variants, archs, jobs_by_variant, cache_dir):
    """Every image must fit the shared memory of every device that runs it (manifest.SHARED_LIMIT)."""
    bad = []
    for vi, v in enumerate(variants):
        for arch in archs:
            if arch not in v.archs:
                continue
            with open(os.path.join(cache_dir, jobs_by_variant[(vi, arch)] + ".json")) as f:
                shared = json.load(f)["shared"]
            if shared > manifest.SHARED_LIMIT[arch]:
                bad.append(f"{v.name} {v.key_str} sm_{arch}: {shared} bytes > {manifest.SHARED_LIMIT[arch]}")
    if bad:
        raise RuntimeError("aot: configs that need more shared memory than their architecture allows (change them in "
                           "aot/configs/):\n  " + "\n  ".join(bad))


def _generate(variants, archs, jobs_by_variant, cache_dir, out_path):
    blobs = []  # incbin declarations, at file scope
    parts = []  # per-variant tables, inside namespace fused
    table = []
    for vi, v in enumerate(variants):
        images = []
        built = [a for a in archs if a in v.archs]
        for arch in built:
            key = jobs_by_variant[(vi, arch)]
            with open(os.path.join(cache_dir, key + ".json")) as f:
                md = json.load(f)
            cubin = os.path.join(cache_dir, key + ".cubin")
            n_desc = sum(1 for _, ty in v.args if ty.startswith("tensordesc"))
            if len(md["tensordesc_meta"]) != n_desc:
                raise RuntimeError(f"{v.name} sm_{arch}: {n_desc} tensor descriptor arguments but the compiler "
                                   f"reports {len(md['tensordesc_meta'])} lowered to TMA; only TMA lowering is supported")
            files = [(0, "sm", cubin)] + ([(1, "ptx", os.path.join(cache_dir, key + ".ptx"))]
                                          if _keep_ptx(arch, built) else [])
            for is_ptx, tag, path in files:
                z = _compressed(path)
                blobs.append(_incbin(f"fused_v{vi}_{tag}{arch}", z))
                images.append((arch, is_ptx, f"fused_v{vi}_{tag}{arch}", os.path.getsize(path) + is_ptx,
                               os.path.getsize(z), md))
        rows = []
        for ii, (arch, is_ptx, sym, size, stored, md) in enumerate(images):
            tma = "nullptr"
            if md["tensordesc_meta"]:
                tma = f"v{vi}_tma{ii}"
                parts.append(f"const TmaMeta {tma}[] = {{" + ", ".join(_tma_row(m) for m in md["tensordesc_meta"]) + "};")
            rows.append(f'{{{arch}, {is_ptx}, {sym}, {size}, {stored}, "{md["entry"]}", {md["shared"]}, '
                        f'{md["num_warps"]}, '
                        f'{md["num_ctas"]}, {md["global_scratch_size"]}, {md["global_scratch_align"]}, {tma}, '
                        f'{len(md["tensordesc_meta"])}, {md.get("pdl", 0)}}}')
        img_rows = ",\n  ".join(rows)
        parts.append(f"const KernelImage v{vi}_images[] = {{\n  {img_rows}}};")
        arg_rows = []
        for name, ty in v.args:
            spec = v.spec.get(name)
            if isinstance(spec, tuple) and spec[0] == "eq":
                arg_rows.append(f'{{"{name}", \'{_type_code(ty)}\', 1, 1, {int(spec[1])}}}')
            else:
                arg_rows.append(f'{{"{name}", \'{_type_code(ty)}\', 0, {16 if spec == 16 else 1}, 0}}')
        parts.append(f"const ArgSpec v{vi}_args[] = {{\n  " + ",\n  ".join(arg_rows) + "};")
        table.append(f'{{"{v.name}", "{v.key_str}", v{vi}_args, {len(v.args)}, v{vi}_images, {len(images)}}}')
    parts = (["// Generated by aot/compile.py: do not edit. The images are embedded from the AOT cache folder.",
              '#include "runtime/kernel_table.h"', ""] + blobs + ["", "namespace fused {", "namespace {"] + parts)
    parts += ["}  // namespace", "", "const KernelVariant kVariants[] = {\n  " + ",\n  ".join(table) + "};",
              f"const size_t kNumVariants = {len(table)};", "", _config_rows(archs),
              "const char* const kBuiltArchs = \"" + ", ".join(f"sm_{a}" for a in archs) +
              (f" (+PTX sm_{min(archs)})" if _keep_ptx(min(archs), archs) else "") + "\";", _flag_rows(),
              "}  // namespace fused", ""]
    write_if_changed(out_path, "\n".join(parts))


def build(out_dir: str, archs=None, jobs=None, quiet=False) -> str:
    """Compiles what the cache lacks for `archs` (resolve_archs: None = $FUSED_ARCHS or auto) and writes
    <out_dir>/kernels_gen.cpp; returns its path."""
    import triton

    archs = resolve_archs(None) if archs is None else tuple(sorted(set(archs)))

    os.makedirs(out_dir, exist_ok=True)
    cache_dir = os.path.join(out_dir, "cache")
    os.makedirs(cache_dir, exist_ok=True)
    variants = manifest.variants()
    todo, jobs_by_variant, total = [], {}, 0
    for vi, v in enumerate(variants):
        for arch in archs:
            if arch not in v.archs:
                continue
            key = _job_key(v, arch, triton.__version__)
            jobs_by_variant[(vi, arch)] = key
            total += 1
            # an entry made before its PTX was kept (an older cache) compiles again where this build embeds the PTX
            complete = os.path.exists(os.path.join(cache_dir, key + ".json")) and (
                not _portable_ptx(arch) or os.path.exists(os.path.join(cache_dir, key + ".ptx")))
            if not complete:
                todo.append((v, arch, cache_dir, key))
    done = total - len(todo)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    say(f"[aot] triton {triton.__version__}: {total} kernel images for {', '.join(f'sm_{a}' for a in archs)}; "
        f"{done} cached, {len(todo)} to compile")
    if todo:
        jobs = jobs or os.cpu_count() or 1
        t0 = last = time.time()
        verbose = bool(os.environ.get("FUSED_BUILD_VERBOSE"))
        with cf.ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_compile_one, j): j for j in todo}
            for n, fut in enumerate(cf.as_completed(futures), 1):
                v, arch = futures[fut][0], futures[fut][1]
                fut.result()  # re-raises a compile error with its traceback
                done += 1
                now = time.time()
                # a line per image when verbose, else one every 10 s (and the last): done / total, time, time left
                if verbose or now - last >= 10 or n == len(todo):
                    last = now
                    left = (now - t0) / n * (len(todo) - n)
                    say(f"[aot] [{done}/{total}] {now - t0:.0f}s, about {left:.0f}s left"
                        + (f" ({v.name} {v.key_str} sm_{arch})" if verbose else ""))
    _check_shared(variants, archs, jobs_by_variant, cache_dir)
    out_path = os.path.join(out_dir, "kernels_gen.cpp")
    _generate(variants, archs, jobs_by_variant, cache_dir, out_path)
    decls = os.path.join(out_dir, "kernel_decls.h")
    write_if_changed(decls, cpp_decls.header(variants, _type_code))
    say(f"[aot] wrote {out_path} and {decls}")
    return out_path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "build", "aot"))
    p.add_argument("--archs", default=None, help="auto: the visible GPUs, else sm_80 + sm_90 (which every supported "
                   "GPU runs); all: sm_89 too; or a list such as 80,90 (default: $FUSED_ARCHS, else auto)")
    p.add_argument("--jobs", type=int, default=None)
    a = p.parse_args()
    build(a.out, resolve_archs(a.archs), a.jobs)


if __name__ == "__main__":
    main()
