"""Generated kernels built with Triton for a named GPU architecture, many at once, with no GPU.

Triton compiles a kernel for the target it is given (`GPUTarget`) with the `ptxas` its wheel
ships; nothing in that needs a GPU. `build` specialises the kernel on the call's arguments as
Triton's own launch would (its binder: dtypes, 16-byte alignment, integer values, the launch
options), so the binary is the one a load would have had Triton build for the same call, and
`build_all` builds a set of them on several threads (Triton's passes and `ptxas` run mostly
outside Python's lock), `build_described` on several processes where the set and the machine are
large: a prebuild's walk (`runtime/prebuild.py`) finds the set, a kernel pack (`pack.py`) or the
cache folder keeps what it builds.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ...errors import UsageError, first_line
from .builders import Builders

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


# A set this large is built in processes where the machine has this many cores: Triton holds
# Python's lock for part of each build, so threads scale only so far (on 2 cores, 2 threads built
# mobilenet's 59 kernels 1.78 times faster than 1; on 16, densenet121's 263 took 28 s, an
# estimated 3.3 times one thread's rate of 0.35 s a kernel), while a process starts in 2 to 3 s
# (torch's and Triton's imports)
PROCESSES_FROM_KERNELS, PROCESSES_FROM_CORES = 48, 8


def start_builders(threads: int) -> Builders | None:
    """As many build processes as a large set would get on `threads` cores (`builders.py`), none
    below PROCESSES_FROM_CORES, or None where processes cannot start here."""
    if threads < PROCESSES_FROM_CORES:
        return None
    try:
        return Builders(min(threads, 16))
    except OSError:  # `Builders` says so for every way a start can fail
        return None


def serve_builds() -> None:
    """A build process's loop (`builders.py`): the imports every build needs, then each job read
    from stdin built (`_build_one`) and its answer written to stdout, until stdin closes. What
    anything else prints goes to stderr, so stdout carries only answers."""
    from . import builders

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch  # noqa: F401
    import triton.compiler  # noqa: F401

    from . import binaries, generated  # noqa: F401

    while True:
        try:
            job = builders.receive(sys.stdin.buffer)
        except EOFError:
            return
        builders.send(out, _build_one(job))


def build_described(launches: list, arch: int, threads: int, processes: int | None = None,
                    builders: Builders | None = None) -> tuple[list, list[str], float]:
    """Build every launch (kernel, args, constants) for `arch`: on `builders` where given, else on
    `processes` processes where given, else on that many where the set and the machine are
    large (see above), else on `threads` threads. Returns (launch, (record, binary) as
    `binaries.describe` gives them, or None where the static launcher cannot run it) per built
    launch, one line per launch that failed to build, and the seconds. A pool that breaks leaves
    its launches to the threads."""
    from . import binaries

    t = time.perf_counter()
    if builders is None and processes is None:  # at most 16 (each holds torch and Triton: about 0.5 GiB), at least 4 kernels each
        processes = min(threads, 16, len(launches) // 4) \
            if len(launches) >= PROCESSES_FROM_KERNELS and threads >= PROCESSES_FROM_CORES else 0
    done: list = []
    failed: list[str] = []
    rest = launches
    if launches and (builders is not None or processes > 1):
        done, failed, rest = _in_processes(launches, arch, processes, builders)
    if rest:
        built, more, _ = build_all(rest, arch, threads)
        failed += more
        for (kernel, args, constants), compiled in built:
            try:
                described = binaries.describe(compiled, args, constants, list(kernel.jit().arg_names))
            except Exception:  # a Triton whose compiled kernels look otherwise
                described = None
            done.append(((kernel, args, constants), described))
    return done, failed, time.perf_counter() - t


def _in_processes(launches: list, arch: int, processes: int | None,
                  builders: Builders | None = None) -> tuple[list, list[str], list]:
    """`build_described` on `builders`, or on `processes` build processes started for it (`builders.py`).
    Each gets the kernel's text and the call as plain values (`_call_of`). Returns the
    described launches, the failures, and the launches no process got to."""
    jobs = [(kernel.source, _call_of(args), dict(constants), arch) for kernel, args, constants in launches]
    own = None
    if builders is None:
        try:
            builders = own = Builders(min(processes, len(jobs)))
        except OSError:  # no processes here: the threads build them all
            return [], [], list(launches)
    try:
        answers = builders.run(jobs)
    finally:
        if own is not None:
            own.close()
    done, failed, rest = [], [], []
    for launch, got in zip(launches, answers):
        if got is None:
            rest.append(launch)
        elif isinstance(got, str):
            failed.append(f"kernel k{launch[0].digest}: {got}")
        else:
            done.append((launch, got))
    return done, failed, rest


def _call_of(args: tuple) -> tuple:
    """A call's arguments as a process can be sent them: each tensor as its dtype and its
    address modulo 16 (all that Triton specialises a pointer on), every other value as is."""
    import torch

    return tuple(("tensor", str(a.dtype).removeprefix("torch."), a.data_ptr() % 16) if isinstance(a, torch.Tensor)
                 else ("value", a) for a in args)


def _build_one(job: tuple):
    """In a pool's process: the kernel of `job`'s text built for its call, described
    (`binaries.describe`); a line saying why where it fails."""
    source, call, constants, arch = job
    try:
        import torch

        from . import binaries, generated

        args = []
        for kind, *rest in call:
            if kind == "tensor":  # a meta tensor at that offset: data_ptr() is its offset in bytes
                dtype, misaligned = getattr(torch, rest[0]), rest[1]
                size = torch.empty(0, dtype=dtype).element_size()
                args.append(torch.empty(16, dtype=dtype, device="meta")[misaligned // size:])
            else:
                args.append(rest[0])
        kernel = generated.define(source)
        compiled = build(kernel, tuple(args), constants, arch)
        return binaries.describe(compiled, tuple(args), constants, list(kernel.jit().arg_names))
    except Exception as e:
        return f"{type(e).__name__}: {first_line(e)}"
