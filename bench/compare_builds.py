"""Several builds of ONE model (e.g. `--kernel-option` variants, or two commits' builds) on the same GPU weights: do they
compute the same step, and how fast is each?

    [K3MK_POSITION=P] [K3MK_REFERENCE=FILE] python bench/compare_builds.py OUT_JSON ARTIFACT_DIR [ARTIFACT_DIR ...]

All artifacts must be of the same model, batch and max context. Random weights are generated on the GPU
once (`random_weights(config, 0, bf16, "cuda")`) and bound by every build; each build runs STEPS steps
from zeroed decode state with the same token ids (the first build's greedy tokens fed back) at positions
P, P + 1, ... (K3MK_POSITION, default 0; at a long position the MLA chunks hold the zeroed cache's rows: a
timing of the attention's length, not of its values); the logits of every step are compared bit for bit
with the first build's (builds that differ only in how weights reach the SM, like ring and slot sizes, run
the same arithmetic in the same order). With K3MK_REFERENCE, the first build's tokens and logits go to FILE, or where
FILE exists they are the reference every build is compared with: builds of another runtime (an older commit's kernel
ABI) run in their own process, `PYTHONPATH` naming that commit's k3mk, against the same steps. Then the step time:
bench/timeline.py's step_time_us (the mean of 50 eager steps after 3 untimed, each request its own token: the greedy
tokens of random weights converge, and requests that all route alike would time the best case of the routed experts'
grouping by expert).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

STEPS = 8
POSITION = int(os.environ.get("K3MK_POSITION", "0"))


def run(art: Path, weights, tokens: list[torch.Tensor] | None):
    """(logits of every step, the tokens fed, mean step time in µs) of one build."""
    from k3mk.bench.timeline import step_time_us
    from k3mk.runtime.model import DecodeModel

    model = DecodeModel(art, weights)
    batch = model.batch
    tok = torch.arange(1, batch + 1, dtype=torch.int32, device="cuda") * 7
    fed, logits = [], []
    with torch.no_grad():
        for t in range(STEPS):
            tok = tokens[t] if tokens is not None else tok
            fed.append(tok.clone())
            next_tokens, out = model.step(tok, torch.full((batch,), POSITION + t, dtype=torch.int32, device="cuda"))
            logits.append(out.clone())
            tok = next_tokens.clone()
        us = step_time_us(model, tok, torch.full((batch,), POSITION + STEPS, dtype=torch.int32, device="cuda"))
    del model
    return logits, fed, us


def main(out: str, arts: list[str]) -> None:
    from k3mk.bench.timeline import TIMED_STEPS
    from k3mk.bench.model_configs import artifact_config
    from k3mk.compiler.random_weights import random_weights

    manifests = [json.loads((Path(a) / "manifest.json").read_text()) for a in arts]
    keys = {(m["model"], m["max_tokens"], m["max_context"]) for m in manifests}
    if len(keys) != 1:
        raise SystemExit(f"the artifacts are of different models / batches / contexts: {sorted(keys)}")
    weights = random_weights(artifact_config(manifests[0], arts[0]), 0, torch.bfloat16, device="cuda")
    rec = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": manifests[0]["model"],
           "batch": manifests[0]["max_tokens"], "position": POSITION, "steps_compared": STEPS, "timed_steps": TIMED_STEPS, "builds": []}  # fmt: skip
    first, tokens = None, None
    reference = Path(os.environ["K3MK_REFERENCE"]) if os.environ.get("K3MK_REFERENCE") else None
    if reference is not None and reference.exists():
        saved = torch.load(reference)
        first, tokens = [x.cuda() for x in saved["logits"]], [x.cuda() for x in saved["tokens"]]
        rec["reference"] = str(reference)
    for art in arts:
        logits, fed, us = run(Path(art), weights, tokens)
        if first is None:
            first, tokens = logits, fed
            if reference is not None:
                torch.save({"logits": [x.cpu() for x in logits], "tokens": [x.cpu() for x in fed]}, reference)
        differ = [t for t, (a, b) in enumerate(zip(first, logits)) if not torch.equal(a, b)]
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(first, logits))
        rec["builds"].append({"artifact": art, "step_us": us, "steps_with_different_logits": differ, "max_abs_logit_diff": worst})
        print(f"{art}: {us:9.1f} us/step, logits differ from the first build at steps {differ} (max |d| {worst:.3g})", flush=True)
    Path(out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
