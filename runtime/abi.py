"""The megakernel's launch ABI: the single source of truth for the kernel parameters, the control
words and the watchdog records. The code generator imports this module (never the reverse), and
every artifact's manifest repeats it so a loader can check that it packs what the kernel expects.
"""

from __future__ import annotations

from dataclasses import dataclass

ABI_VERSION = 1


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "ptr" (a u64 global pointer) or "i32"
    dtype: str = ""  # element type of a pointer (torch dtype name)
    align: int = 0  # alignment the kernel assumes, bytes

    @property
    def cute_dtype(self) -> str:
        return {"int32": "Int32", "int64": "Int64", "uint8": "Uint8"}[self.dtype]

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype, "align": self.align}


# Order = the kernel's parameter order (.param 0..8 in the PTX).
PARAMS: tuple[Param, ...] = (
    Param("lists", "ptr", "int32", 4),  # task table device part + 4 * lists_offset
    Param("tasks", "ptr", "int32", 16),  # task table device part + 4 * tasks_offset
    Param("events", "ptr", "int64", 8),  # int64[num_events], monotonic counters
    Param("control", "ptr", "int64", 8),  # int64[CONTROL_WORDS]
    Param("arena", "ptr", "uint8", 16),  # activation arena
    Param("weights", "ptr", "int64", 8),  # int64[num_weights]: device pointers
    Param("debug", "ptr", "int64", 8),  # int64[num_ctas * DEBUG_WORDS] watchdog records
    Param("num_ctas", "i32"),  # grid size = number of task lists
    Param("watchdog_us", "i32"),  # debug builds: a wait longer than this aborts the step
)

CONTROL_WORDS = 8
C_EPOCH = 0  # completed steps; the kernel runs step C_EPOCH + 1
C_EXITS = 1  # CTA exits ever (last-CTA-out: exits == num_ctas * step advances C_EPOCH)
C_ABORT = 2  # number of watchdogs fired (debug builds)

DEBUG_WORDS = 8  # per CTA: status, smid, task index in list, event, target, counter, epoch, opcode
DEBUG_FIELDS = ("status", "smid", "task", "event", "target", "counter", "epoch", "opcode")
STATUS_TIMED_OUT = 1  # this CTA's wait exceeded watchdog_us
STATUS_ABORTED = 2  # this CTA stopped because another's watchdog fired
STATUS_RING_TIMED_OUT = 3  # a wait of this CTA's streaming ring (a fill, a free slot, a record) exceeded watchdog_us

# MXFP4 experts: the largest UE8M0 scale byte the decode takes (2^9): it applies a group's scale as one bf16
# multiply by 2^(s - 9) (codegen/templates/mxfp4_dot.py.j2), which is not a bf16 past s = 136
MXFP4_MAX_SCALE = 136
MXFP4_SCALE_SUFFIX = ".weight_scale"  # the canonical names of MXFP4 scale tensors (compiler/weights.py)

# Profile builds (KernelConfig.profile): the SAME parameters, but the `debug` buffer continues after the
# watchdog records with PROFILE_RING_STEPS slots of int64[num_tasks][PROFILE_WORDS], one record per task
# indexed by its global task index (list offset + position); step e writes slot (e - 1) % PROFILE_RING_STEPS.
# Consumer thread 0 writes the %globaltimer (ns) at: the task's start (before its wait for the waiter warp's
# `ready`), its waits satisfied (`ready` complete), its op body done (after the consumer barrier, just before
# the arrive that hands the release to the signaller warp); then %smid and the
# step, last. The producer warp's lane 0 writes: when it began the task (before forwarding its record),
# when it had issued the task's fills, the ns it waited for free ring slots meanwhile, and the bytes its
# bulk copies brought (what the producer actually issued, not the cost model's count). Inside a streaming op's
# body thread 0 (consumer warp 0, lane 0) also writes: when the op's input was staged (its prologue done: gemv
# and expert_gated), when its first ring fill was there (its first acquire returned), and when it released its
# last fill; 0 where not taken; and the ns its warp (consumer warp 0) waited for its fills to land (all its
# acquires: fills that came late, not consumers that were slow).
PROFILE_WORDS = 13
PROFILE_FIELDS = ("start", "wait_done", "body_end", "smid", "epoch", "produce_start", "produce_end", "ring_wait", "issued_bytes",
                  "staged", "first_fill", "last_release", "fill_wait")  # fmt: skip
PROFILE_RING_STEPS = 4
# A profile build's manifest says this instead of ABI_VERSION, so that a runtime which does not know the
# longer `debug` buffer refuses the artifact instead of letting the kernel write past its allocation.
PROFILE_ABI_VERSION = f"{ABI_VERSION}+profile"


def profile_words(num_tasks: int) -> int:
    """int64 words of the profile records after the watchdog records (profile builds)."""
    return PROFILE_RING_STEPS * num_tasks * PROFILE_WORDS


def params_json() -> list[dict]:
    return [p.to_json() for p in PARAMS]
