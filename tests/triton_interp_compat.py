"""Gives older Triton interpreters (3.6) two fixes that Triton 3.8's has; imported by the interpreter-tier tests only.

1. numpy >= 2.5: the interpreter holds a kernel's scalars (arguments, tl.program_id, reductions) as 1-element 1-D
   numpy arrays, and a loop `for i in range(lo, hi, step)` (or tl.range, which the interpreter maps to Python's range)
   with runtime bounds converts them through the `tl.tensor.__index__` that the interpreter installs at each launch.
   Up to Triton 3.6 that is `int(self.handle.data)`, and numpy 2.5 removed int() of arrays with ndim > 0 (deprecated
   since 1.25): "TypeError: only 0-dimensional arrays can be converted to Python scalars". Triton 3.8 squeezes first.
2. A Python bool passed to a non-constexpr kernel argument (an int1 scalar): Triton 3.6 stores it as int32 and rejects
   that ("numpy data itemsize (32 bits) exceeds dtype primitive_bitwidth (1 bits)"); Triton 3.8 stores a bool.

The kernels cannot avoid 1 (every runtime-bounded loop goes through that conversion in the interpreter). Both change
only the interpreter's Python side, the same as the newer Triton does; compiled kernels are untouched.
"""
import functools

try:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as _interpreter
except ImportError:  # no triton (the interpreter tests skip themselves)
    _interpreter = None


def _index(self):
    """tl.tensor.__index__ under the interpreter: a scalar's 1-element array as a Python int (Triton 3.8's own)."""
    return int(self.handle.data.squeeze())


def _wrap(name, make):
    original = getattr(_interpreter, name, None)
    if original is None or getattr(original, "_interp_compat", False):
        return  # a Triton without that hook (it patches differently), or wrapped already
    wrapper = functools.wraps(original)(make(original))
    wrapper._interp_compat = True
    setattr(_interpreter, name, wrapper)


def _patch_lang_tensor(original):
    def patch_lang_tensor(tensor, *args, **kwargs):
        result = original(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None:  # undone with the launch's other patches
            scope.set_attr(tensor, "__index__", _index)
        else:
            tensor.__index__ = _index
        return result
    return patch_lang_tensor


def _implicit_cvt(original):
    def implicit_cvt(arg):
        if isinstance(arg, bool):
            return tl.tensor(_interpreter.TensorHandle(np.array([arg], dtype=np.bool_), tl.int1), tl.int1)
        return original(arg)
    return implicit_cvt


if _interpreter is not None:
    _wrap("_patch_lang_tensor", _patch_lang_tensor)
    _wrap("_implicit_cvt", _implicit_cvt)
