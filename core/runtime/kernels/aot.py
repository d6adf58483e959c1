"""Generated kernels built with Triton for a named GPU architecture, many at once, with no GPU.

Triton compiles a kernel for the target it is given (`GPUTarget`) with the `ptxas` its wheel
ships; nothing in that needs a GPU. `build` specialises the kernel on the call's arguments as
Triton's own launch would (its binder: dtypes, 16-byte alignment, integer values, the launch
options), so the binary is the one a load would have had Triton build for the same call, and
`build_all` builds a set of them on several threads (Triton's passes and `ptxas` run outside
Python's lock): a prebuild's walk (`runtime/prebuild.py`) finds the set, a kernel pack
(`pack.py`) or the cache folder keeps what it builds.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...errors import UsageError, first_line

ARCH = re.compile(r"sm_?(\d{2,3})a?")
# the streaming multiprocessors of the common GPU of each architecture: a few kernels split their
# work by it (a pack built for another count is a miss for those, built at load)
MULTIPROCESSORS = {70: 80, 75: 40, 80: 108, 86: 84, 87: 16, 89: 128, 90: 132, 100: 148, 120: 170}


@dataclass(frozen=True)
class Target:
    """A GPU architecture kernels are built for: compute capability `arch` (90 for sm_90) and the
    multiprocessors its GPUs have."""

    arch: int
    multiprocessors: int

    @property
    def name(self) -> str:
        return f"sm_{self.arch}"

    @property
    def capability(self) -> tuple[int, int]:
        return divmod(self.arch, 10)


def targets(text: str) -> list[Target]:
    """The architectures `--gpu-arch` names: comma-separated `sm_90`, `sm_80`, ... (an optional
    `:N` gives the multiprocessor count, `sm_90:114` for an H100 PCIe)."""
    found = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, sms = part.partition(":")
        m = ARCH.fullmatch(name)
        if m is None or int(m[1]) not in MULTIPROCESSORS or (sms and not (sms.isdigit() and 0 < int(sms) < 1024)):
            raise UsageError(f"--gpu-arch {part!r} names no GPU architecture nimble builds for; give one or more of "
                             f"{', '.join(f'sm_{a}' for a in MULTIPROCESSORS)}, comma-separated (sm_90:114 sets the "
                             "multiprocessor count)")
        arch = int(m[1])
        found.append(Target(arch, int(sms) if sms else MULTIPROCESSORS[arch]))
    if not found:
        raise UsageError("--gpu-arch names no architecture; give one such as sm_90")
    return list(dict.fromkeys(found))


def build(kernel, args: tuple, constants: dict, arch: int):
    """Triton's CompiledKernel of `kernel` (a `generated.Generated`) for this call, for `arch`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.knobs import compilation, runtime
    from triton.runtime.jit import create_function_from_signature

    jit = kernel.jit()
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(constants, debug=runtime.debug, instrumentation_mode=compilation.instrumentation_mode)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)


_PARSING = threading.Lock()


def _parse_alone(jit) -> None:
    """Triton parses a kernel's text with `ast.parse` as it compiles it; CPython 3.11's parser is
    not safe on several threads at once ("AST constructor recursion depth mismatch", seen with
    Triton 3.8), so the kernels built here parse one at a time (the rest of a build runs in parallel)."""
    if getattr(jit, "_nimble_parse_alone", False):
        return
    parse = jit.parse

    def alone():
        with _PARSING:
            return parse()
    jit.parse, jit._nimble_parse_alone = alone, True


def workers() -> int:
    """Threads to build on: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def build_all(launches: list, arch: int, threads: int) -> tuple[list, list[str], float]:
    """Build every launch (kernel, args, constants) for `arch` on `threads` threads. Returns the
    built (launch, CompiledKernel) pairs, one line per launch that failed to build (it is then
    built at load, or falls back), and the seconds."""
    t = time.perf_counter()
    unread: dict[int, str] = {}
    for kernel, _, _ in launches:  # Triton reads each kernel's source once, in this thread
        try:
            _parse_alone(kernel.jit())
        except Exception as e:  # no Triton, or a text it cannot read: that kernel is not built here
            unread[id(kernel)] = f"kernel k{kernel.digest}: {type(e).__name__}: {first_line(e)}"

    def one(launch):
        kernel, args, constants = launch
        if id(kernel) in unread:
            return launch, unread[id(kernel)]
        try:
            compiled = build(kernel, args, constants, arch)
        except Exception as e:
            return launch, f"kernel k{kernel.digest}: {type(e).__name__}: {first_line(e)}"
        return launch, compiled

    with ThreadPoolExecutor(max(1, threads)) as pool:
        results = list(pool.map(one, launches))
    # a build that failed on a thread is tried once more alone (a Triton may keep state threads share)
    results = [one(launch) if isinstance(got, str) and id(launch[0]) not in unread else (launch, got)
               for launch, got in results]
    built = [(launch, got) for launch, got in results if not isinstance(got, str)]
    failed = [got for _, got in results if isinstance(got, str)]
    return built, failed, time.perf_counter() - t
