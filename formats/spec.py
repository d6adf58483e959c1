"""Every constant of the `.nimble` format, in one place. Bump FORMAT_VERSION on any change a
reader of the previous version could misread."""

FORMAT_VERSION = 1

MANIFEST = "manifest.json"
GRAPH = "graph.json"
SCHEDULE = "schedule.json"
MEMORY = "memory.json"
WEIGHTS = "weights.safetensors"
SAMPLE_INPUTS = "sample/inputs.safetensors"
SAMPLE_OUTPUTS = "sample/outputs.safetensors"
MEMBERS = (MANIFEST, GRAPH, SCHEDULE, MEMORY, WEIGHTS, SAMPLE_INPUTS, SAMPLE_OUTPUTS)

ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps make the bytes reproducible
MAX_JSON_BYTES = 256 * 2**20  # a JSON member larger than this is refused before parsing
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the cap safetensors itself applies

SAMPLE_INPUT_KEY = "input{}"
SAMPLE_OUTPUT_KEY = "output{}"
