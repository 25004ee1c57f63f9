"""The decode-step benchmark (BENCHMARKS.md, DESIGN.md "Benchmark method"): per model, batch and context,
in ONE run on one GPU, the megakernel, the CUDA-graph baseline (bench/baseline.py) and the roofline.

    python bench/decode_bench.py --artifacts artifacts_dev/bench --out $OUT/decode_bench.json   # GPU
    python bench/decode_bench.py --rooflines-only                                              # CPU, before
    python bench/decode_bench.py --table decode_bench.json                                     # Markdown rows

Per model: random bf16 weights generated on the GPU once (`random_weights(config, 0, bf16, "cuda")`),
shared by the reference DecodeStep, the baseline and the megakernel (never copied). Per batch: the
baseline against the reference for CHECK_STEPS teacher-forced steps on a CHECK_CONTEXT-row cache.
Per (batch, context): the megakernel from the artifact of that model and batch with the SMALLEST max
context >= the context (so an 8192 artifact may serve context 1024: the row says which); both decode
states filled with the same random values (never zeros); CHECK_STEPS eager steps comparing the
megakernel's tokens with the baseline's where the baseline's top-1 / top-2 logit gap is clear (clear_mask); then
each step captured in a CUDA graph (the next tokens fed back inside the graph; every request at position
context - 1, so it attends to `context` cache rows) and the two graphs replayed interleaved, one CUDA
event pair around each replay: median and p90 per step.

Roofline = bytes that must move in the step / the device-to-device copy bandwidth measured at the start
of the run (bench/megakernel_framework.copy_bandwidth: read + written counted). The bytes are the
compiler's count (passes/schedule.py roofline_bytes on the captured step at this batch and context):
every non-expert weight once at its stored width (lm_head whole, one embedding row per request), the
routed experts at the DISTINCT experts the baseline's routers chose per layer (mean over 8 timed steps;
the uniform-routing expectation is recorded too), the KDA conv and recurrent states read and written,
the latent cache read over `context` rows plus the new row written; no activations. The captures are
cached in a JSON file keyed by model, config hash, batch, context and the counting code's hash, so a
CPU run of --rooflines-only spares the GPU machine their ~1 s each.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from k3mk.compiler.generate import clear_mask, top2_gap

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("kimi-linear-48b-a3b", "k3-proxy-16l", "k3-proxy-16l-bf16")
BATCHES = (1, 2, 4, 8, 16)
CONTEXTS = (1024, 8192, 32768)
SEED = 0
CHECK_STEPS = 3
CHECK_CONTEXT = 64  # rows of the reference check's cache: its naive MLA up-projects every row each step
ROUTED_SAMPLES = 8  # baseline replays whose router ids give the distinct-expert count
DEFAULT_ROOFLINE_CACHE = ROOT / "artifacts_dev" / "bench" / "rooflines.json"


# --- roofline -------------------------------------------------------------------------------------------


def _counting_code_hash() -> str:
    """The code the byte count depends on: the reference step (what is captured) and the counter."""
    text = "".join((ROOT / p).read_text() for p in ("compiler/reference.py", "compiler/weights.py", "compiler/capture.py", "passes/schedule.py"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def roofline_terms(config, batch: int, context: int) -> dict[str, float]:
    """passes/schedule.py roofline_bytes of the step captured at (batch, context) bf16, plus what turns its
    expected-expert term into a measured one: the bytes of ONE expert of ONE layer."""
    from k3mk.compiler.capture import capture
    from k3mk.passes.schedule import expected_distinct_experts, roofline_bytes

    terms = roofline_bytes(capture(config, batch, context, torch.bfloat16))
    moe = config.moe
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    expected = expected_distinct_experts(moe.num_experts, moe.top_k, batch)
    return {**terms, "expected_distinct_experts": expected, "moe_layers": moe_layers,
            "expert_bytes": terms["experts"] / (expected * moe_layers)}  # fmt: skip


def step_bytes(terms: dict[str, float], distinct_experts: float) -> float:
    """Bytes of one step whose routers chose `distinct_experts` distinct experts, summed over the layers."""
    return terms["weights"] + terms["state"] + terms["expert_bytes"] * distinct_experts


class RooflineCache:
    """roofline_terms, cached in a JSON file (module docstring)."""

    def __init__(self, path: Path):
        self.path, self.code = path, _counting_code_hash()
        self.entries = json.loads(path.read_text()) if path.is_file() else {}

    def terms(self, config, batch: int, context: int) -> dict[str, float]:
        key = f"{config.name}:{config.hash()}:{self.code}:b{batch}:t{context}"
        if key not in self.entries:
            self.entries[key] = roofline_terms(config, batch, context)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries, indent=1))
        return self.entries[key]


# --- artifacts ------------------------------------------------------------------------------------------


def artifact_index(root: Path) -> dict[tuple[str, int], list[tuple[int, Path]]]:
    """(config hash, batch) -> [(max_context, artifact dir)] ascending, for every whole-model TP1 release
    artifact under root (op-test, debug and profiling builds left out; a config built in code under a
    preset's name has another hash)."""
    index: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    for manifest in sorted(root.rglob("manifest.json")) if root.is_dir() else []:
        m = json.loads(manifest.read_text())
        if m.get("config_hash") and m.get("tp", 1) == 1 and not m.get("debug") and not m.get("profile"):
            index.setdefault((m["config_hash"], m["max_tokens"]), []).append((m["max_context"], manifest.parent))
    return {k: sorted(v) for k, v in index.items()}


def pick_artifact(index, config, batch: int, context: int) -> tuple[int, Path] | None:
    """The artifact of this config and batch with the smallest max context that holds `context` rows."""
    return next(((t, p) for t, p in index.get((config.hash(), batch), []) if t >= context), None)


# --- measuring ------------------------------------------------------------------------------------------


def fill_random_(states: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """Decode state as after a long context, in place: never zeros (METHOD.md); the recurrent state small
    enough that the delta rule keeps it bounded."""
    for name, t in states.items():
        t.normal_(0.0, 0.1 if name.endswith("recurrent_state") else 1.0, generator=gen)


def compare_tokens(tokens: torch.Tensor, ref_logits: torch.Tensor, record: dict) -> None:
    """Count, per request, tokens equal to the reference's greedy token where its top-2 gap is clear; record
    every flip (request, the reference's gap, both paths' logits of the two tokens)."""
    from k3mk.ir import semantics

    clear = clear_mask(ref_logits).cpu()
    want = semantics.argmax(ref_logits).long().cpu()
    differ = tokens.long().cpu() != want
    record["clear"] = record.get("clear", 0) + int(clear.sum())
    record["near_tie"] = record.get("near_tie", 0) + int((~clear).sum())
    record["mismatch_clear"] = record.get("mismatch_clear", 0) + int((differ & clear).sum())
    gaps = top2_gap(ref_logits).cpu()
    for b in differ.nonzero().flatten().tolist():
        pair = [int(want[b]), int(tokens[b])]
        record.setdefault("flips", []).append({"request": b, "clear": bool(clear[b]), "ref_gap": float(gaps[b]),
                                               "ref": [float(ref_logits[b, t]) for t in pair]})  # fmt: skip


def _logit_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def time_graphs(graphs: dict[str, torch.cuda.CUDAGraph], replays: int, warmup: int) -> dict[str, list[float]]:
    """Microseconds of each replay, the graphs interleaved replay by replay, a CUDA event pair around each."""
    for _ in range(warmup):
        for g in graphs.values():
            g.replay()
    events = {n: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)] for n in graphs}
    for i in range(replays):
        for name, g in graphs.items():
            start, end = events[name][i]
            start.record()
            g.replay()
            end.record()
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) * 1e3 for a, b in pairs] for n, pairs in events.items()}


def median_p90(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


class Bench:
    """One run: the device facts, the results so far (written after every cell) and the progress lines."""

    def __init__(self, args):
        self.args, self.start = args, time.perf_counter()
        self.result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": args.commit or _commit(),
                       "gpu": torch.cuda.get_device_name(), "driver": _driver(), "torch": torch.__version__, "triton": _version("triton"),
                       "fla": _version("fla"), "rows": [], "reference_checks": [], "failures": []}  # fmt: skip
        self.roofline = RooflineCache(args.roofline_cache)

    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {line}", flush=True)

    def out_of_time(self) -> bool:
        return self.args.deadline_s is not None and time.perf_counter() - self.start > self.args.deadline_s

    def save(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.result, indent=1))

    def fail(self, message: str) -> None:
        self.result["failures"].append(message)
        self.say(f"CHECK FAILED: {message}")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        return head + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (pass --commit)"


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True,
                              check=True).stdout.split()[0]  # fmt: skip
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --- the runs -------------------------------------------------------------------------------------------


def check_reference(bench: Bench, config, reference, baseline, batch: int) -> None:
    """The baseline against the reference DecodeStep: CHECK_STEPS steps teacher-forced with the
    reference's tokens, requests staggered by one position."""
    from k3mk.ir import semantics

    gen = torch.Generator(device="cuda").manual_seed(SEED + batch)
    state = reference.new_state(batch, CHECK_CONTEXT)
    fill_random_(state, gen)
    own = {n: t.clone() for n, t in state.items()}
    baseline.attention_window = CHECK_CONTEXT
    tokens = torch.randint(config.vocab_size, (batch,), generator=gen, device="cuda")
    record: dict = {"model": config.name, "batch": batch, "steps": CHECK_STEPS, "logit_rel": []}
    for t in range(CHECK_STEPS):
        positions = CHECK_CONTEXT - CHECK_STEPS + t - torch.arange(batch, device="cuda")
        ref_logits, state = reference(tokens, positions, state)
        logits, _ = baseline(tokens, positions, own)
        compare_tokens(semantics.argmax(logits), ref_logits, record)
        record["logit_rel"].append(_logit_rel(logits, ref_logits))
        tokens = semantics.argmax(ref_logits).long()
    bench.result["reference_checks"].append(record)
    bench.say(f"{config.name} b{batch}: baseline vs reference: {record['mismatch_clear']} of {record['clear']} clear tokens differ "
              f"({record['near_tie']} near ties), logits rel max {max(record['logit_rel']):.2e}")  # fmt: skip
    if record["mismatch_clear"]:
        bench.fail(f"{config.name} b{batch}: baseline tokens differ from the reference at clear steps")


@functools.lru_cache(maxsize=4)
def _build(artifact: Path):
    from k3mk.bench.calibrate import Build

    return Build.load(artifact)


def predicted_us(artifact: Path, context: int) -> float | None:
    """The replay of the build at the cell's context (ir/replay.py, the compiler's constants; the MLA chunks as
    long as the run makes them), or None for an artifact built before every build wrote its task bytes."""
    from k3mk.ir.replay import H200_2026_12_03

    if not (artifact / "task_bytes.json").exists():
        return None
    return _build(artifact).replay(H200_2026_12_03, context).step_s * 1e6


def run_cell(bench: Bench, config, baseline, model, artifact: tuple[int, Path] | None, batch: int, context: int, bandwidth: float) -> dict:
    """One (model, batch, context): states, the megakernel-vs-baseline token check, graphs, timing, roofline."""
    from k3mk.bench.megakernel_framework import graph_of
    from k3mk.compiler.weights import state_specs
    from k3mk.ir import semantics

    gen = torch.Generator(device="cuda").manual_seed(SEED + 1000 * batch + context)
    if model is not None:
        states = model.states  # bound to the kernel, updated in place by it
    else:
        states = {s.name: torch.empty(s.shape, dtype=s.torch_dtype(torch.bfloat16), device="cuda") for s in state_specs(config, batch, context)}
    fill_random_(states, gen)
    own = {n: t.clone() for n, t in states.items()}  # the baseline's copy: same values, same layout
    baseline.attention_window = context
    row: dict = {"model": config.name, "config_hash": config.hash(), "batch": batch, "context": context,
                 "artifact_max_context": artifact and artifact[0], "artifact": artifact and artifact[1].name}  # fmt: skip
    tokens = torch.randint(config.vocab_size, (batch,), generator=gen, device="cuda")
    with torch.no_grad():
        if model is not None:  # eager steps, teacher-forced with the baseline's tokens
            check: dict = {"logit_rel": []}
            for t in range(CHECK_STEPS):
                positions = torch.full((batch,), context - CHECK_STEPS + t, device="cuda")
                logits, _ = baseline(tokens, positions, own)
                kernel_tokens, kernel_logits = model.step(tokens.to(torch.int32), positions.to(torch.int32))
                compare_tokens(kernel_tokens, logits, check)
                check["logit_rel"].append(_logit_rel(kernel_logits, logits))
                tokens = semantics.argmax(logits).long()
            row["megakernel_vs_baseline"] = check
            if check["mismatch_clear"]:
                bench.fail(f"{config.name} b{batch} t{context}: megakernel tokens differ from the baseline's at clear steps")
        graphs = {}
        bl_tokens, bl_positions = tokens.clone(), torch.full((batch,), context - 1, device="cuda")
        graphs["baseline"] = graph_of(lambda: bl_tokens.copy_(semantics.argmax(baseline(bl_tokens, bl_positions, own)[0])))
        if model is not None:
            token_input, next_tokens = model.buffer("token_ids"), model.buffer("next_tokens")
            token_input.copy_(tokens)
            model.buffer("positions").fill_(context - 1)

            def kernel_step():
                model.mk.step()
                token_input.copy_(next_tokens)

            graphs["megakernel"] = graph_of(kernel_step)
        t0 = time.perf_counter()
        time_graphs(graphs, 3, 0)
        per_round = (time.perf_counter() - t0) / 3
        replays = max(bench.args.min_replays, min(bench.args.max_replays, int(bench.args.seconds_per_cell / per_round)))
        samples = time_graphs(graphs, replays, bench.args.warmup)
        routed = []
        for _ in range(ROUTED_SAMPLES):
            graphs["baseline"].replay()
            routed.append(torch.stack([baseline.routed_ids[i] for i in sorted(baseline.routed_ids)]).clone())
        distinct = statistics.mean(sum(len(torch.unique(layer)) for layer in ids) for ids in torch.stack(routed).cpu())
        del graphs
    terms = bench.roofline.terms(config, batch, context)
    nbytes = step_bytes(terms, distinct)
    roofline_us = nbytes / (bandwidth * 1e12) * 1e6
    row.update(replays=replays, distinct_experts=distinct, expected_distinct_experts=terms["expected_distinct_experts"] * terms["moe_layers"],
               roofline_bytes=nbytes, roofline_bytes_expected_routing=terms["total"], roofline_us=roofline_us)  # fmt: skip
    for name, values in samples.items():
        med, p90 = median_p90(values)
        row[f"{name}_median_us"], row[f"{name}_p90_us"], row[f"{name}_fraction_of_roofline"] = med, p90, roofline_us / med
    if model is not None:
        row["speedup"] = row["baseline_median_us"] / row["megakernel_median_us"]
        row["megakernel_predicted_us"] = predicted_us(artifact[1], context)
    mk = f"megakernel {row['megakernel_median_us']:.0f} us ({row['megakernel_fraction_of_roofline']:.0%}), " if model is not None else ""
    if row.get("megakernel_predicted_us"):
        mk += f"predicted {row['megakernel_predicted_us']:.0f} us, "
    bench.say(f"{config.name} b{batch} t{context}: {mk}baseline {row['baseline_median_us']:.0f} us "
              f"({row['baseline_fraction_of_roofline']:.0%}), roofline {roofline_us:.0f} us; {replays} replays")  # fmt: skip
    return row


def run_model(bench: Bench, name: str, index, bandwidth: float) -> None:
    from k3mk.bench.baseline import build_baseline_step
    from k3mk.compiler.config import load_config
    from k3mk.compiler.generate import build_decode_step
    from k3mk.compiler.random_weights import random_weights
    from k3mk.runtime.manifest import ArtifactError
    from k3mk.runtime.model import DecodeModel

    config = load_config(name)
    weights = random_weights(config, SEED, torch.bfloat16, device="cuda")
    bench.say(f"{name}: {sum(w.numel() * w.element_size() for w in weights.values()) / 1e9:.1f} GB of random weights on the GPU")
    reference = build_decode_step(config, weights, torch.bfloat16)
    baseline = build_baseline_step(config, weights)
    for batch in bench.args.batches:
        plan: dict = {}  # artifact -> contexts it serves
        for context in bench.args.contexts:
            chosen = pick_artifact(index, config, batch, context)
            if chosen is None and not bench.args.include_missing:
                bench.say(f"{name} b{batch} t{context}: no artifact with max context >= {context}: skipped")
                continue
            plan.setdefault(chosen, []).append(context)
        if not plan:
            continue
        with torch.no_grad():
            check_reference(bench, config, reference, baseline, batch)
        _free()
        for chosen, contexts in plan.items():
            try:
                model = DecodeModel(chosen[1], weights) if chosen else None
            except ArtifactError as e:  # e.g. built by an older k3mk: say so, time the rest
                bench.fail(f"{chosen[1]}: {e}")
                continue
            for context in contexts:
                if bench.out_of_time():
                    bench.say(f"{name} b{batch} t{context}: skipped (past --deadline-s)")
                    continue
                bench.result["rows"].append(run_cell(bench, config, baseline, model, chosen, batch, context, bandwidth))
                bench.save()
                _free()
            del model
            _free()
    del reference, baseline, weights
    _free()
    bench.say(f"{name}: done; {torch.cuda.memory_allocated() / 1e9:.1f} GB still allocated")


# --- the table ------------------------------------------------------------------------------------------


def markdown_rows(result: dict) -> list[str]:
    """The results table (BENCHMARKS.md): one line per (model, batch, context)."""

    def us(row, name):
        med = row.get(f"{name}_median_us")
        return "—" if med is None else f"{med:,.0f} / {row[f'{name}_p90_us']:,.0f}"

    def pct(row, name):
        frac = row.get(f"{name}_fraction_of_roofline")
        return "—" if frac is None else f"{frac:.0%}"

    lines = [
        "| model | batch | context | artifact max context | megakernel median / p90 (µs) | baseline median / p90 (µs) | roofline (µs) "
        "| megakernel % of roofline | baseline % of roofline | speedup (baseline / megakernel) | distinct experts per step "
        "| replay's prediction (µs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "—"
        predicted = f"{r['megakernel_predicted_us']:,.0f}" if r.get("megakernel_predicted_us") else "—"
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['artifact_max_context'] or '—'} | {us(r, 'megakernel')} "
                     f"| {us(r, 'baseline')} | {r['roofline_us']:,.0f} | {pct(r, 'megakernel')} | {pct(r, 'baseline')} | {speedup} "
                     f"| {r['distinct_experts']:.0f} | {predicted} |")  # fmt: skip
    return lines


def _positive_ints(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, found {value}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts_dev" / "bench", help="directory of artifact directories (k3mk compile --out)")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=_positive_ints, default=list(BATCHES))
    ap.add_argument("--contexts", nargs="+", type=_positive_ints, default=list(CONTEXTS))
    ap.add_argument("--include-missing", action="store_true", help="time the baseline alone where no artifact holds the context")
    ap.add_argument("--seconds-per-cell", type=float, default=1.5, help="replay time per (model, batch, context), both graphs")
    ap.add_argument("--min-replays", type=int, default=30)
    ap.add_argument("--max-replays", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, help="start no new cell after this many seconds (the rest is reported skipped)")
    ap.add_argument("--roofline-cache", type=Path, default=DEFAULT_ROOFLINE_CACHE)
    ap.add_argument("--commit", help="the commit measured (default: git rev-parse, where the tree has .git)")
    ap.add_argument("--out", type=Path, help="results JSON (written after every cell)")
    ap.add_argument("--rooflines-only", action="store_true", help="CPU: fill the roofline cache for the grid, then exit")
    ap.add_argument("--table", type=Path, metavar="JSON", help="print the Markdown table of a results file, then exit")
    args = ap.parse_args(argv)
    if args.table:
        print("\n".join(markdown_rows(json.loads(args.table.read_text()))))
        return 0
    if args.rooflines_only:
        from k3mk.compiler.config import load_config

        cache = RooflineCache(args.roofline_cache)
        for name in args.models:
            for batch in args.batches:
                for context in args.contexts:
                    t = cache.terms(load_config(name), batch, context)
                    print(f"{name} b{batch} t{context}: {t['total'] / 1e9:.3f} GB (expected routing)", flush=True)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("decode_bench: no CUDA GPU (use --rooflines-only or --table on a CPU machine)")
    from k3mk.bench.megakernel_framework import copy_bandwidth

    bench = Bench(args)
    index = artifact_index(args.artifacts)
    bench.say(f"{bench.result['gpu']}, torch {bench.result['torch']}, triton {bench.result['triton']}, fla {bench.result['fla']}; "
              f"{sum(len(v) for v in index.values())} artifacts under {args.artifacts}")  # fmt: skip
    bandwidth = copy_bandwidth()
    _free()
    bench.result["copy_bandwidth_tbps"] = bandwidth
    bench.say(f"device-to-device copy: {bandwidth:.2f} TB/s (read + written)")
    for name in args.models:
        run_model(bench, name, index, bandwidth)
    bench.save()
    print("\n".join(markdown_rows(bench.result)))
    for failure in bench.result["failures"]:
        print(f"CHECK FAILED: {failure}")
    return 1 if bench.result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
