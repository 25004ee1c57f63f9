"""The driver: CLI, model configs and presets, the reference decode step, checkpoint I/O, graph
capture, the compile pipeline and the artifact cache."""
