"""Building a generated kernel's binary with Triton for a named GPU architecture, with no GPU
(prototype)."""

from __future__ import annotations


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
