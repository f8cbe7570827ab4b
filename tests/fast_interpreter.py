"""Three costs of Triton's interpreter (triton 3.7) that compute nothing, taken out for the test suite: together
over half the interpreted time of an engine step on the CPU (a uniform-4 gate run: 10.9 s -> 4.9 s).

- Every call of a @triton.jit helper from inside a kernel (online_softmax_step, rope_kv's _rope_heads, tl.sum's
  combine function, ...) patches triton.language again: inspect.getmembers over five modules and classes, some
  2 ms each time, and the patch is never undone. The kernel being interpreted has already patched those modules
  (GridExecutor.__call__ does, for the kernel's run), so the helper's patch replaces nothing.
- Every integer add, sub and mul runs an overflow check (binary_op_sanitize_overflow_impl): the operation again in
  int64 and two comparisons, handed to device_assert, which under the interpreter returns at once (its options'
  debug is always off), so the check can never fire. It is skipped where device_assert would skip it.
- _get_np_dtype, called for most tensor operations, builds a dict of 19 entries each time to look one up.

What the kernels compute, and every check the interpreter does make (types, shapes, pointers, bounds), is
unchanged. install() replaces a function only if it is the one read here; another Triton keeps its own, slower,
interpreter (with a warning).
"""
from __future__ import annotations

import inspect
import os
import textwrap
import warnings

# The bodies replaced, as triton 3.7's interpreter has them.
_DEVICE_CALL = '''
def __call__(self, *args, **kwargs):
    # This is a device function call
    _patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e
'''


def _source(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn)).strip()


def install() -> bool:
    """Patch the interpreter in this process; False where it is not on, or not the one read here."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_servecap_fast", False):
        return True
    semantic = interp.interpreter_semantic
    if _source(interp.InterpretedFunction.__call__) != _DEVICE_CALL.strip() or \
            "np_types = {" not in _source(interp._get_np_dtype) or \
            not _source(type(semantic).binary_op_sanitize_overflow_impl).endswith(
                "self.device_assert(cond, msg, None)") or \
            "if not self.builder.options.debug:\n        return\n" not in _source(type(semantic).device_assert):
        warnings.warn("tests/fast_interpreter.py: this Triton's interpreter is not the one it was written for; "
                      "the kernels run under its own, slower")
        return False

    # What _patch_lang(fn) runs _patch_builtin on, for each triton.language module in fn's globals; and one builtin
    # of each, read before anything is patched: _patch_builtin replaces all of one's builtins at once, so while
    # this one is replaced, all of them are.
    def patched_by(lang) -> list:
        return [lang, lang.tensor] + ([tl.math] if lang is tl else [])

    packages = [tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base]
    sentinel = {id(p): next(name for name, m in inspect.getmembers(p) if tl.core.is_builtin(m)) for p in packages}
    needs: dict = {}  # a helper's function -> what _patch_lang would patch for it

    def patched(fn) -> bool:
        if fn not in needs:
            langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
            needs[fn] = [tl.core.tensor_descriptor_base] + [p for lang in langs for p in patched_by(lang)] \
                if langs else None
        return needs[fn] is not None and not any(tl.core.is_builtin(getattr(p, sentinel[id(p)])) for p in needs[fn])

    def device_call(self, *args, **kwargs):
        if not patched(self.fn):
            interp._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    def sanitize_overflow(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:  # device_assert, where the check ends, returns at once then
            return
        return type(semantic).binary_op_sanitize_overflow_impl(semantic, lhs, rhs, binary_op)

    np_dtype, memo = interp._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        # A block's is its element's, and a pointer's uint64, as in the original; the rest are looked up by name,
        # as the original's dict does.
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return np_dtype(key)
        try:
            return memo[key]
        except KeyError:
            memo[key] = found = np_dtype(key)
            return found

    interp.InterpretedFunction.__call__ = device_call
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow  # this instance only: the compiler has its own
    interp._get_np_dtype = get_np_dtype
    interp._servecap_fast = True
    return True
