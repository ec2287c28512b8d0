"""The build's variant check: fails if a C++ launcher can ask for a variant that aot/manifest.py did not compile for
a built architecture (csrc/ops/variant_check.cpp), so that "no compiled variant" at run time only ever means an
unbuilt GPU. setup.py runs it after building the extension, CMake after linking the library:

    python -m aot.check_variants path/to/library.so

Loads the library in a fresh interpreter (torch needed, no GPU)."""
import subprocess
import sys


def check(library: str) -> None:
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "print('\\n'.join(torch.ops.fused._missing_variants()))")
    res = subprocess.run([sys.executable, "-c", code, library], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"fused_ops: the variant check could not load {library}:\n{res.stderr}")
    if res.stdout.strip():
        raise RuntimeError("fused_ops: the C++ launchers can ask for variants that aot/manifest.py does not compile "
                           "(their config tables or FLAG_SETS lack them):\n" + res.stdout)


if __name__ == "__main__":
    try:
        check(sys.argv[1])
    except RuntimeError as e:
        sys.exit(str(e))
    print(f"[aot] variant check passed: {sys.argv[1]}")
