"""CuTe DSL source generation (jinja2 templates, one op template per file) and the build step that
compiles it for a target arch into an artifact directory.

    emit.py            task table variants -> kernel source (templates/megakernel.py.j2 + one per op)
    ops.py             per op kind: template, smem need, checks; KernelConfig; tuning records
    build.py           source -> cubin (subprocess per arch, cached) -> artifact dir + manifest.json
    compile_worker.py  the per-arch compile process
    testing.py         test mode: small op graphs -> task tables + reference outputs

docs/megakernel.md describes the kernel, its ABI and the artifact; docs/task_table.md the table.
"""
