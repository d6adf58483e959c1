"""Planning, in plain Python over the IR (no torch): the multi-stream schedule (`schedule`, with
`matching` for its chains, and `capped` for its candidates on fewer CUDA streams), the arena
memory plan (`memory`, with `flow` for its lower bound), the checks a loader runs on both
(`verify`), and the plan's outside views: the JSON plan document (`document`) and the Graphviz
picture (`dot`)."""
