"""What an op is, shared by every stage: the allowlist of device ops (`allowlist`, plain data), op
targets and their torch operators (`targets`), IR dtypes and enums as torch objects (`types`), IR
arguments as torch arguments (`arguments`), shape rules (`shapes`), fused bodies as data
(`fusion`) and their interpreter (`interpret`), and the one loop every executor issues an op
list through (`execute`)."""
