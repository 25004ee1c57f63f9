"""bench/code_size.py: PTX instructions attributed to the megakernel.py function their last `.loc` names."""

from __future__ import annotations

import random

from k3mk.bench.code_size import instructions_per_function, main

SOURCE = "import x\n\n\ndef op1_gemv_run(a):\n    y = a\n    return y\n\n\ndef megakernel(b):\n    op1_gemv_run(b)\n"


def test_instructions_count_for_the_function_of_their_last_loc():
    rng = random.Random()
    want = {"op1_gemv_run": rng.randint(1, 9), "megakernel": rng.randint(1, 9), "(module)": rng.randint(1, 9)}
    lines = [".version 8.8", ".file 1 \"megakernel.py\"", ".file 2 \"cutlass.py\"", "{"]
    for name, line in (("(module)", 1), ("op1_gemv_run", 5), ("megakernel", 10)):
        lines.append(f"\t.loc 1 {line} 4")
        for i in range(want[name]):
            lines += [f"$L__BB0_{name[:3]}{i}:", f"\tadd.s32 %r{i}, %r{i}, 1;", "\t// a comment"]
    lines += ["\t.loc 2 7 1", "\tmov.u32 %r1, %r2;", "\t.loc 1 6 4", "\tret;", "}"]  # another file's line counts for none
    got = instructions_per_function(SOURCE, "\n".join(lines))
    want["op1_gemv_run"] += 1
    assert got == want


def test_an_artifact_without_line_info_is_refused(tmp_path, capsys):
    (tmp_path / "megakernel.py").write_text(SOURCE)
    (tmp_path / "megakernel.sm_90a.ptx").write_text(".version 8.8\n{\n\tret;\n}\n")
    assert main([str(tmp_path)]) == 2
    assert "CUTE_DSL_LINEINFO=1" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
