"""A faster Triton CPU interpreter for the suite: each triton.language module patched once a launch.

Triton 3.7's interpreter (TRITON_INTERPRET=1) swaps triton.language's builtins for interpreted
ones when a kernel launch starts and puts them back when it ends (`_patch_lang`, and the scope's
`restore`). It does the same again at every call of a `@triton.jit` helper inside the kernel, for
every program of the grid: `inspect.getmembers` over four modules, ~0.4 ms a call (2.3 ms under
cProfile). A helper that sees the same modules as its kernel finds every builtin already swapped
(the launch did it, and nothing restores it before the launch ends), so the repeat changes nothing;
one from triton.language's standard library (tl.sum, tl.zeros) also sees triton.language.core,
which its first call swaps (and Triton never restores) and its later calls find swapped.

`install()` makes a call that comes during a launch, for modules already swapped in that launch,
a no-op, and keeps each module's list of builtins (found with `inspect.getmembers` on the module
as shipped, between launches) for the launches after, which then only set the attributes. The
triton vendor's prefill and decode attention checks (719 cases) took 121-130 s as shipped and
104-108 s with it (Zen 1 VM, one process, alternated). Only on the Triton version it was read
against (interpreter internals change between releases): elsewhere it does nothing.
"""

from __future__ import annotations

import inspect

CHECKED_VERSION = "3.7."


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` (once per process); False where it is left alone."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    real = getattr(interpreter, "_patch_lang", None)
    needed = ("_LangPatchScope", "_patch_builtin", "_patch_attr")
    if real is None or not all(hasattr(interpreter, n) for n in needed) or not triton.__version__.startswith(
            CHECKED_VERSION):
        return False
    if getattr(real, "dlinfer_patched_once", False):
        return True
    patched = []  # the language modules swapped in the launch in progress (at most one entry)
    builtins = {}  # id(module) -> [(name, builtin)], read between launches

    def patch_builtin(pkg, builder, scope):
        members = builtins.get(id(pkg))
        if members is None:
            members = [(name, m) for name, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
            if not patched:  # read on the module as shipped (during a launch it holds the swapped ones)
                builtins[id(pkg)] = members
        for name, member in members:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    def lang_modules(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        langs = lang_modules(fn)
        if patched and langs <= patched[0]:
            return interpreter._LangPatchScope()  # already swapped in this launch: nothing to restore
        scope = real(fn)
        if patched:  # a helper whose module sees more of triton.language (its standard library's
            patched[0] |= langs  # functions see triton.language.core): swapped now, for the launch's rest
        else:  # a launch: remember its modules until its scope restores them
            patched.append(set(langs))
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_lang.dlinfer_patched_once = True
    interpreter._patch_lang = patch_lang
    interpreter._patch_builtin = patch_builtin
    return True
