"""The `.nimble` artifact: a zip of JSON and safetensors members, never pickle or code.

`write_artifact` writes one atomically and reproducibly; `read_artifact` validates everything
before it allocates a tensor and raises `ArtifactError` with one line for any defect.
"""

from .artifact import Artifact, plan_digest, read_artifact, write_artifact
from .spec import FORMAT_VERSION

__all__ = ["Artifact", "FORMAT_VERSION", "plan_digest", "read_artifact", "write_artifact"]
