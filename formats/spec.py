"""Every constant of the `.nimble` format, in one place. Bump FORMAT_VERSION on any change a
reader of the previous version could misread."""

FORMAT_VERSION = 3  # 3: several batch sizes (manifest `batch_sizes`, members under batch/<b>/)
ONE_BATCH_VERSION = 2  # 2: fused ops (`nimble::fused`, with `local` arguments in their bodies); an
# artifact of one batch size says 2, so that readers of version 2 still read it

MANIFEST = "manifest.json"
GRAPH = "graph.json"
SCHEDULE = "schedule.json"
MEMORY = "memory.json"
WEIGHTS = "weights.safetensors"
SAMPLE_INPUTS = "sample/inputs.safetensors"
SAMPLE_OUTPUTS = "sample/outputs.safetensors"
MEMBERS = (MANIFEST, GRAPH, SCHEDULE, MEMORY, WEIGHTS, SAMPLE_INPUTS, SAMPLE_OUTPUTS)
PLAN_MEMBERS = (GRAPH, SCHEDULE, MEMORY)  # one set per batch size: the first batch size's at the top,
BATCH_MEMBER = "batch/{}/{}"  # each other's under batch/<b>/ (the weights and sample I/O are shared)
MAX_BATCH_SIZES = 16


def batch_members(batch_sizes) -> list[str]:
    """The members of the batch sizes after the first, in the order they are written."""
    return [BATCH_MEMBER.format(b, m) for b in list(batch_sizes)[1:] for m in PLAN_MEMBERS]

ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps make the bytes reproducible

# Caps on what a file may declare, checked before anything is allocated. The byte caps can be
# raised for one process through the environment variables named beside them.
MAX_MANIFEST_BYTES = 2**20
MAX_JSON_BYTES = 64 * 2**20  # NIMBLE_MAX_JSON_BYTES: graph, schedule and memory members
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the cap safetensors itself applies
MAX_STRING = 4096  # characters in any name, target, source line or version
MAX_DIMS = 16
MAX_TENSOR_BYTES = 2**36  # NIMBLE_MAX_TENSOR_BYTES: storage one value spans (64 GiB)
MAX_ARENA_BYTES = 2**38  # NIMBLE_MAX_ARENA_BYTES: the activation arena (256 GiB)
MAX_BODY_NODES = 2**16  # NIMBLE_MAX_BODY_NODES: nodes in all fused bodies together (each body holds 64 at most)


def limit(name: str) -> int:
    """A cap, raised (or lowered) by the environment variable NIMBLE_<name> if set."""
    import os

    default = globals()[name]
    text = os.environ.get(f"NIMBLE_{name}")
    return int(text) if text and text.isdecimal() else default

SAMPLE_INPUT_KEY = "input{}"
SAMPLE_OUTPUT_KEY = "output{}"
