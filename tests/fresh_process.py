"""Runs Python code in a fresh interpreter where `import triton` raises ImportError, as on a deployment machine
without Triton: the package, its ops and everything saved from it must work there."""
import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))

# A None entry in sys.modules makes both `import triton` and importlib's find_spec report it missing.
NO_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None
""")


def run_fresh(code, env=None, timeout=300, triton=False):
    """Runs `code` (dedented) after NO_TRITON, in tests/ (so `from reference import ...` works); returns the
    CompletedProcess with text stdout/stderr. triton=True: Triton stays importable and TRITON_INTERPRET is removed,
    for code that compiles with Triton (inductor, AOTInductor on CUDA): a pytest process that ran the interpreter
    tests has Triton's own jit functions created in interpreter mode, and inductor's CUDA kernels cannot be compiled
    there."""
    full_env = dict(os.environ, **(env or {}))
    prefix = NO_TRITON
    if triton:
        full_env.pop("TRITON_INTERPRET", None)
        prefix = ""
    return subprocess.run([sys.executable, "-c", prefix + textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=TESTS, timeout=timeout)
