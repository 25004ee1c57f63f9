"""CuTe DSL source generation (jinja2 templates, one op template per file) and the build step that
compiles it for a target arch into an artifact directory."""
