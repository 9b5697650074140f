"""A faster Triton CPU interpreter for the suite: language modules swapped once a launch, dtypes memoised.

Triton 3.7's interpreter (TRITON_INTERPRET=1) swaps triton.language's builtins for interpreted
ones when a kernel launch starts and puts them back when it ends (`_patch_lang`, and the scope's
`restore`). It does the same again at every call of a `@triton.jit` helper inside the kernel, for
every program of the grid: `inspect.getmembers` over four modules, ~0.4 ms a call (2.3 ms under
cProfile). A helper that sees the same modules as its kernel finds every builtin already swapped
(the launch did it, and nothing restores it before the launch ends), so the repeat changes nothing;
one from triton.language's standard library (tl.sum, tl.zeros) also sees triton.language.core,
which its first call swaps (and Triton never restores) and its later calls find swapped.

`install()` marks each launch (`GridExecutor.__call__`) and, inside one, makes a call for modules
already swapped in that launch a no-op; outside a launch Triton's function runs as shipped. It also
keeps each module's list of builtins (found with `inspect.getmembers` on the module as shipped, at a
launch's own swap) for the launches after, which then only set the attributes. The triton vendor's
prefill and decode attention checks (719 cases) took 121-130 s as shipped and 104-108 s with it
(Zen 1 VM, one process, alternated). And it answers the interpreter's `_get_np_dtype` from a memo
(`_memoised_np_dtype`): 19 attention and W4 checks 37-40 s -> 31-35 s, four rounds alternated in
one process. Only on the Triton version it was read against (interpreter
internals change between releases): elsewhere it does nothing.
"""

from __future__ import annotations

import inspect

CHECKED_VERSION = "3.7."


def install() -> bool:
    """Wrap the interpreter's launches and `_patch_lang` (once per process); False where it is left alone."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except Exception:  # noqa: BLE001  (a Triton that does not import: its tests say so, not the suite's set-up)
        return False
    needed = ("_patch_lang", "_patch_builtin", "_patch_attr", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(interpreter, n) for n in needed) or not triton.__version__.startswith(CHECKED_VERSION):
        return False
    if getattr(interpreter._patch_lang, "dlinfer_patched_once", False):
        return True
    real_patch_lang, real_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches = []  # per launch in progress (one at a time): ids of the modules it has swapped
    builtins = {}  # id(module) -> [(name, builtin)], read on the module as shipped

    def lang_modules(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        if not launches:
            return real_patch_lang(fn)
        swapped, langs = launches[-1], lang_modules(fn)
        if swapped and langs and langs <= swapped:
            return interpreter._LangPatchScope()  # already swapped in this launch: nothing to restore
        scope = real_patch_lang(fn)  # the launch's own swap (restored when it ends), or a helper's
        swapped |= langs  # that sees more (the standard library's see triton.language.core, left swapped)
        return scope

    def patch_builtin(pkg, builder, scope):
        members = builtins.get(id(pkg))
        if members is None:
            members = [(name, m) for name, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            if launches and not launches[-1]:  # the launch's own swap: the modules as shipped
                builtins[id(pkg)] = members
        for name, member in members:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_lang.dlinfer_patched_once = True
    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_lang
    interpreter._patch_builtin = patch_builtin
    interpreter._get_np_dtype = _memoised_np_dtype(interpreter._get_np_dtype, tl)
    return True


def _memoised_np_dtype(real, tl):
    """The interpreter's `_get_np_dtype(tt_dtype)` (the numpy dtype that holds a Triton type's
    values) answered from a memo. As shipped it builds its 18-entry table on every call, about
    220,000 calls for 270 attention checks: a tenth of their interpreted time. The answer depends
    on the scalar type only (a block's is its element's, every pointer's is uint64), so each scalar
    type's answer is asked of the shipped function once; an unknown type raises as it does there."""
    import numpy as np

    pointer = np.dtype(np.uint64)
    memo = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = memo.get(tt_dtype)
        if found is None:
            found = memo[tt_dtype] = real(tt_dtype)
        return found

    np_dtype.shipped = real
    return np_dtype
