"""Graph-to-graph and graph-to-schedule transformations, one per file, run in order by a small pass
manager that verifies (and can dump) the IR after every pass."""
