"""What an op is, shared by every stage: the allowlist of device ops (`allowlist`, plain data) and
the bridge between IR constants and torch objects (`bridge`: dtypes, enums, op targets,
argument values)."""
