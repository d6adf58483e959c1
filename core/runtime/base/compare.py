"""Output comparison in Polygraphy's manner: the errors, a verdict, and the tolerance that would pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import MismatchError  # noqa: F401  (raised by callers of compare)


CPU_TOLERANCE = (1e-4, 1e-5)  # (rtol, atol) for fp32 numerics
CUDA_TOLERANCE = (1e-2, 1e-3)  # convolutions run in TF32 on the GPU by default
# A reduced-precision artifact is held to the relative L2 error of each output against float32:
# float16 keeps 11 bits of mantissa, bfloat16 8, so a deep net's rounding adds up to about this much.
L2_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2}


def default_tolerance(device) -> tuple[float, float]:
    return CPU_TOLERANCE if str(device).startswith("cpu") else CUDA_TOLERANCE


def l2_tolerance(artifact, rtol: float | None = None) -> float | None:
    """The relative L2 error a reduced-precision artifact's outputs are held to: `rtol` where the
    user gave one, else the one it was compiled with; None for a float32 artifact (rtol and atol
    apply)."""
    record = artifact.precision
    if record is None:
        return None
    return rtol if rtol is not None else record["tolerance"]


def relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; infinite where out is not finite but ref is."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if ref.is_complex() or out.is_complex():
        out, ref = torch.view_as_real(out.to(torch.complex128)), torch.view_as_real(ref.to(torch.complex128))
    finite = torch.isfinite(ref)
    if not torch.isfinite(out[finite]).all():
        return math.inf
    diff = torch.where(finite, out - ref, 0.0)
    norm = ref[finite].norm().item() if ref.numel() else 0.0
    gap = diff.norm().item()
    return gap / norm if norm > 0 else (0.0 if gap == 0 else math.inf)


@dataclass(frozen=True)
class Comparison:
    max_abs: float  # largest |out - ref| over all outputs
    max_rel: float  # largest |out - ref| / max|ref|, per output, over all outputs
    rtol: float
    atol: float
    rel_l2: tuple[float, ...] = ()  # per output: ||out - ref|| / ||ref|| (0 where both are 0)
    tiny: tuple[int, ...] = ()  # outputs whose every reference value is below atol in magnitude
    l2: float | None = None  # reduced precision: every output within this relative L2 error instead

    @property
    def passed(self) -> bool:
        """Within atol or within rtol; and an output too small for atol to tell anything (random
        weights can make one 1e-9) must also be within rtol by its relative L2 error. With `l2`
        (a reduced-precision artifact), every output's relative L2 error is at most `l2`."""
        if self.l2 is not None:
            return all(e <= self.l2 for e in self.rel_l2)
        if any(not self.rel_l2[k] <= self.rtol for k in self.tiny):
            return False
        return self.max_abs <= self.atol or self.max_rel <= self.rtol

    def document(self) -> dict:
        """The comparison as `compile --json` and `run --json` print it."""
        return {"passed": self.passed, "max_abs": self.max_abs, "max_rel": self.max_rel, "rtol": self.rtol,
                "atol": self.atol, "rel_l2": list(self.rel_l2), "tiny_outputs": list(self.tiny),
                "rel_l2_tolerance": self.l2}

    @property
    def passing_rtol(self) -> str:
        """The smallest one-digit rtol that would have passed (with `l2`: the relative L2 error)."""
        if self.l2 is not None:
            return _ceil(max(self.rel_l2, default=0.0))
        return _ceil(max([self.max_rel, *(self.rel_l2[k] for k in self.tiny)]))

    def describe(self) -> str:
        verdict = "ok" if self.passed else "MISMATCH"
        if self.l2 is not None:
            errors = ", ".join(f"{e:.3g}" for e in self.rel_l2)
            return (f"{verdict}: relative L2 error per output {errors} (tolerance {self.l2:g}; "
                    f"{self.passing_rtol} would pass); max abs error {self.max_abs:.3g}")
        text = (f"{verdict}: max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g} "
                f"(rtol {self.rtol:g}, atol {self.atol:g}; rtol {self.passing_rtol} would pass)")
        if self.tiny:
            worst = max(self.rel_l2[k] for k in self.tiny)
            text += (f"; output(s) {', '.join(map(str, self.tiny))} are smaller than atol throughout, so they were "
                     f"compared by relative L2 error too (worst {worst:.3g})")
        return text


def compare(outputs: list[torch.Tensor], expected: list[torch.Tensor], rtol: float, atol: float,
            l2: float | None = None) -> Comparison:
    """Relative error is taken against each output's largest magnitude, so that entries near zero
    do not dominate; NaN or inf where the reference is finite counts as an infinite error. An
    output whose reference is below atol throughout is also held to rtol by relative L2 error.
    With `l2`, each output is held to that relative L2 error alone (reduced precision)."""
    if len(outputs) != len(expected):
        raise MismatchError(f"got {len(outputs)} outputs, expected {len(expected)}")
    max_abs = max_rel = 0.0
    rel_l2, tiny = [], []
    for k, (out, ref) in enumerate(zip(outputs, expected)):
        if tuple(out.shape) != tuple(ref.shape):
            raise MismatchError(f"output shape {list(out.shape)} differs from the reference's {list(ref.shape)}")
        if out.is_complex() or ref.is_complex():  # compare real and imaginary parts alike
            out, ref = torch.view_as_real(out.detach().cpu().to(torch.complex128)), \
                torch.view_as_real(ref.detach().cpu().to(torch.complex128))
        out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
        diff = (out - ref).abs()
        diff = torch.where(torch.isfinite(ref) & ~torch.isfinite(out), torch.inf, diff)
        diff = torch.where(torch.isnan(ref) & torch.isnan(out), 0.0, diff)
        err = diff.max().item() if diff.numel() else 0.0
        scale = ref[torch.isfinite(ref)].abs().max().item() if torch.isfinite(ref).any() else 1.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        rel_l2.append(relative_l2(out, ref))
        if ref.numel() and scale < atol:
            tiny.append(k)
    return Comparison(max_abs, max_rel, rtol, atol, tuple(rel_l2), tuple(tiny), l2)


def _ceil(x: float) -> str:
    """The smallest tolerance with one significant digit that is at least x."""
    if x == 0 or math.isinf(x) or math.isnan(x):
        return str(x)
    exp = math.floor(math.log10(x))
    mantissa = math.ceil(x / 10**exp - 1e-9)
    if mantissa == 10:
        mantissa, exp = 1, exp + 1
    return f"{mantissa}e{exp}"
