"""Loads a compiled artifact and runs it: manifest validation, module load and launch through
cuda-bindings, weight binding, decode state. Imports neither CuTe DSL nor the compiler packages."""
