# Sourced by scripts/test.sh and scripts/run.sh: makes $VENV (default .venv) with what the project needs, builds
# and installs the package into it, and exports VPY (its python). Works offline when torch is already importable
# (the venv then reuses it through --system-site-packages); otherwise installs torch==2.14.1 (CUDA build; its
# triton is what the AOT step compiles with).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="${FUSED_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  if "$PY" -c "import torch, triton" >/dev/null 2>&1; then
    # Reuse the importable torch: a .pth file puts $PY's site-packages behind the venv's own (this works also
    # when $PY is itself a venv, where --system-site-packages would reach only the base interpreter's).
    echo "[setup] reusing torch $("$PY" -c 'import torch; print(torch.__version__)') from $PY"
    site_dir="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$PY" -c 'import site, sys; print("\n".join(p for p in site.getsitepackages() + [site.getusersitepackages()]))' \
      > "$site_dir/_fused_reuse_torch.pth"
  fi
fi
VPY="$VENV/bin/python"
export VPY
if ! "$VPY" -c "import torch, triton" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.14.1 (brings triton)"
  "$VPY" -m pip install -q torch==2.14.1
fi
for mod in pytest setuptools wheel ninja numpy; do
  "$VPY" -c "import $mod" >/dev/null 2>&1 || "$VPY" -m pip install -q "$mod"
done
# transformers is optional (fused_ops.hf, tested by tests/test_hf_patch.py): installed when missing, never fatal.
# A machine without a package index gets a warning, and those tests then show as skipped with the reason.
if ! "$VPY" -c "import transformers" >/dev/null 2>&1; then
  echo "[setup] installing transformers (optional dependency of fused_ops.hf)"
  "$VPY" -m pip install -q --retries 1 --timeout 20 "transformers>=5" \
    || echo "[setup] WARNING: could not install transformers; the fused_ops.hf tests will be skipped"
fi
# onnx, onnxscript and onnxruntime are optional (fused_ops.onnx, tested by tests/test_onnx.py): installed when missing,
# never fatal. A machine without a package index gets a warning, and those tests then show as skipped with the reason.
if ! "$VPY" -c "import onnx, onnxscript, onnxruntime" >/dev/null 2>&1; then
  echo "[setup] installing onnx, onnxscript, onnxruntime (optional dependencies of fused_ops.onnx)"
  "$VPY" -m pip install -q --retries 1 --timeout 20 onnx onnxscript onnxruntime \
    || echo "[setup] WARNING: could not install onnx/onnxscript/onnxruntime; the fused_ops.onnx tests will be skipped"
fi
echo "[setup] building fused_ops: AOT-compiling the Triton kernels (FUSED_ARCHS=${FUSED_ARCHS:-auto}), then the C++ op library"
# The AOT step first, in the foreground, so that its progress shows (pip -q hides a build's output); the pip build
# then finds every image in the cache. FUSED_BUILD_VERBOSE=1 shows every image and every compiler and linker command.
t0=$SECONDS
( cd "$ROOT" && "$VPY" -m aot.compile --out "$ROOT/build/aot" )
t1=$SECONDS
( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VPY" -m pip install --no-build-isolation --no-deps \
    "$([ -n "${FUSED_BUILD_VERBOSE:-}" ] && echo -v || echo -q)" . )
echo "[setup] build times: AOT step $((t1 - t0)) s, C++ library and install $((SECONDS - t1)) s"
"$VPY" -c "import fused_ops; print('[setup] fused_ops built for', fused_ops.built_archs())"
