"""The telemetry.profile_steps window: a torch.profiler trace of a few optimizer steps per
rank, and what `diagnose` reads from it (exposed communication, the costliest operators).

Recording. `ProfileWindow` starts torch.profiler (CPU activity, plus CUDA on a GPU; no
shapes, stacks, memory or FLOP counting, which multiply its cost) at the first step of the
window and stops it after the last, writing `<out_dir>/rank<k>.trace.json` (Chrome trace
format). Every profiled step is a `ProfilerStep#<n>` range, the name torch's own schedule
gives steps, so other tools recognise them; `phase(name)` adds `scaletrain:<name>` ranges.

Exposed communication, as measured here (torch 2.13, gloo, world 2, tiny Llama, CPU):

* Where the events are. Collectives run on gloo's worker threads, one event per collective
  there: `gloo:all_reduce`, `gloo:all_gather`, `gloo:broadcast` (user annotations). The
  training thread shows only the enqueueing op, a `c10d::*` cpu_op (`c10d::allreduce_`,
  `c10d::broadcast_`, `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`), which
  returns before the collective ends, except gloo's `_reduce_scatter_base_` (an all-reduce
  plus a copy, as it has no reduce-scatter: its op lasted ~1 ms per call).
* The waits carry no event at all. DDP waits for its buckets at the end of backward in an
  autograd callback (no record_function in reducer.cpp); FSDP2's synchronous all-gather and
  reduce-scatter (on CPU the streams are no-ops) wait inside `FSDP::all_gather (<fqn>)` and
  `FSDP::post_backward_reduce (<fqn>)`, ranges that also hold local packing
  (`fsdp::all_gather_copy_in`, `fsdp::chunk_cat`) and so cannot be counted whole;
  DeepSpeed ZeRO-2 has no events of its own: torch.distributed's (`c10d::allreduce_` of
  the gradient buckets after `aten::flatten_dense_tensors` at the end of backward, small
  ones for the norm and overflow check in its step, `c10d::_allgather_base_` of the updated
  partitions; `gloo:all_reduce` / `gloo:all_gather` on the workers), waited on unnamed too.
  What a wait looks like: the training thread runs no operator while a `gloo:*` event of
  the same process is in flight. FSDP's one explicit wait range on CPU,
  `FSDP::post_backward_rs_wait`, measures ~0 (nothing is left to wait for after a
  synchronous reduce-scatter); `FSDP::all_gather_copy_out` is the copy out of the
  gathered buffer there, local work, so it does not count.

* Whose collectives. Only threads the profiler follows record anything: collectives that
  another Python thread enqueues on a side group (an async checkpoint's writer, a watchdog)
  leave no event at all, neither their c10d op nor their gloo worker's (checked: a thread
  all-reducing on a new_group beside the profiled loop showed nothing), so every `gloo:*`
  event in a trace belongs to the training thread's collectives.

So on CPU the exposed communication of the training thread (the one holding the
ProfilerStep ranges) is the union, within the profiled steps, of
  (a) its `c10d::*` / `_c10d_functional::*` operators and explicit wait ranges, and
  (b) its idle time while a collective (`gloo:*`, `nccl:*`) of this process is in flight
      on another thread; idle: in no leaf cpu_op (one with no operator inside) for at least
      50 us. Leaf, because Python hooks, waits included, run in the self time of enclosing
      ops (RegisterPostBackwardFunctionBackward, autograd nodes); 50 us, because backward
      leaves hundreds of 2-20 us gaps between operators (autograd's engine) while DDP's
      buckets are in flight, which are overhead, not waiting,
merged so that nothing is counted twice. (b) also counts interpreter time between
operators that happens to overlap a collective, and a peer's lateness (a straggler
upstream) counts as this rank's exposed communication, which is what it costs this rank.

On CUDA (kernel events present; not testable on this machine) the rule is the GPU's:
the time NCCL kernels (names containing "nccl") run while no other kernel runs, within the
span of the profiled steps (the window synchronizes the device before closing its last
step so that their kernels fall inside it).
"""

from __future__ import annotations

import bisect
import importlib
import json
import os
import warnings
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# torch warns at each profiler start after the first in a process that "Profiler clears
# events at the end of each cycle": true, and each window or sample here is one cycle.
warnings.filterwarnings("ignore", message=".*Profiler clears events")

PHASES = ("data", "forward_backward", "optimizer")  # the phases the trainer marks
STEP_PREFIX = "ProfilerStep#"
# Operators on the training thread that are communication calls (the enqueue, or all of a
# synchronous collective), and ranges that exist only to wait for one.
COMM_OP_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
WAIT_RANGES = ("FSDP::post_backward_rs_wait", "_c10d_functional::wait_tensor")
# A collective in flight on a communication thread (gloo's workers) or enqueued (nccl).
COLLECTIVE_PREFIXES = ("gloo:", "nccl:")
TOP_N = 10
MIN_IDLE_US = 50.0

_OFF: AbstractContextManager[Any] = nullcontext()  # stateless, so one instance serves every call


def prepare_profiler() -> None:
    """Pay torch.profiler's one-time start cost now (call at setup when profiling will follow).

    Its first start in a process imports torch._inductor (`hasattr(torch, "_inductor")` in
    prepare_trace): 1.2-1.8 s on this machine. Inside a traced step every rank pays it at
    its own speed and the first collective makes the faster ranks wait for the slower:
    exposed communication that is the profiler's own (seen: 41 ms of "communication" in a
    63 ms two-step DDP window). Idempotent; a no-op once imported.
    """
    importlib.import_module("torch._inductor.config")


class ProfileWindow:
    """Trace optimizer steps [first, last] (1-based, inclusive) of this rank; `steps=[]`: off.

    The trainer calls `before_step(n)` before step n's data is fetched, `after_step(n)`
    after its optimizer step, wraps the phases in `phase(name)`, and calls `close()` at the
    end of the run (a `finally`), which writes the trace if the run stopped inside the window.
    """

    def __init__(self, steps: list[int], out_dir: Path, rank: int, device: torch.device):
        if steps and not (len(steps) == 2 and 1 <= steps[0] <= steps[1]):
            raise ValueError(f"profile steps {steps}: expected [] or [first, last] with 1 <= first <= last")
        self.first, self.last = (steps[0], steps[1]) if steps else (0, -1)
        if steps:
            prepare_profiler()
        self.path = Path(out_dir) / f"rank{rank}.trace.json"
        self.device = device
        self.written: Path | None = None  # the trace, once written
        self.steps_recorded: list[int] = []
        self._prof: profile | None = None
        self._step_range: record_function | None = None
        self._done = not steps

    @property
    def active(self) -> bool:
        return self._prof is not None

    def before_step(self, step: int) -> None:
        if self._prof is None:
            # A resumed run may start inside the window: it traces what is left of it.
            if self._done or not self.first <= step <= self.last:
                return
            self._start()
        self._end_step()  # a step whose after_step never came (rolled back): close its range
        self._step_range = record_function(f"{STEP_PREFIX}{step}")
        self._step_range.__enter__()
        self.steps_recorded.append(step)

    def after_step(self, step: int) -> None:
        if self._prof is None:
            return
        if step >= self.last:
            self._finish()
        else:
            self._end_step()

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """`with window.phase("forward_backward"):` marks a phase inside the window; outside it, nothing."""
        if self._prof is None:
            return _OFF
        return record_function(f"scaletrain:{name}")

    def close(self) -> None:
        """Write the trace now if the window is still open (the run ended inside it)."""
        if self._prof is not None:
            self._finish()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False, with_flops=False)
        self._prof.start()

    def _end_step(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _finish(self) -> None:
        assert self._prof is not None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels end inside its range
        self._end_step()
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        prof.export_chrome_trace(str(tmp))  # kineto's C++ writer; the Python event tree is never built
        os.replace(tmp, self.path)  # diagnose never reads half a trace
        self.written = self.path


# ---------------------------------------------------------------------------- analysis

Interval = tuple[float, float]


def analyze_trace(path: Path) -> dict[str, Any]:
    """Exposed communication and the costliest operators of one rank's trace (see the module doc).

    Returns total_s (the profiled steps on the training thread), comm_s, compute_s,
    comm_share, steps (how many), method ("cpu" or "cuda"), top_ops (CPU operators by self
    time: name, self_s, count) and top_kernels (the same for CUDA kernels; [] on CPU); on
    CUDA also kernel_s (seconds of device work in the steps by KERNEL_KINDS, overlaps
    counted once per kind) and gpu_idle_s (the steps' span with nothing on the device: the
    host not keeping up, or a wait).
    """
    raw = json.loads(Path(path).read_text())
    gpu = {"kernel", "gpu_memcpy", "gpu_memset"}  # kineto's categories of what runs on the device
    events = [e for e in raw.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and e.get("cat") != "Trace"]
    step_events = [e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)]
    if step_events:
        main_tid = step_events[0]["tid"]
        steps = _merge((e["ts"], e["ts"] + e["dur"]) for e in step_events if e["tid"] == main_tid)
    else:  # a trace not written by ProfileWindow: the busiest thread, from its first to its last event
        main_tid = _busiest_thread(events)
        mine = [e for e in events if e["tid"] == main_tid]
        steps = [(min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine))] if mine else []
    total = _length(steps)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        span = [(steps[0][0], steps[-1][1])] if steps else []
        nccl = _merge((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower())
        compute = _merge((e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower())
        comm = _intersect(_subtract(nccl, compute), span)
        method = "cuda"
        device_work = [e for e in events if e.get("cat") in gpu]
        busy = _intersect(_merge((e["ts"], e["ts"] + e["dur"]) for e in device_work), span)
        by_kind: dict[str, list[Interval]] = defaultdict(list)
        for e in device_work:
            by_kind[kernel_kind(e["name"], e["cat"])].append((e["ts"], e["ts"] + e["dur"]))
        in_span = {k: _length(_intersect(_merge(v), span)) / 1e6 for k, v in sorted(by_kind.items())}
        cuda_extra = {
            "kernel_s": {k: s for k, s in in_span.items() if s > 0},
            "gpu_idle_s": (_length(span) - _length(busy)) / 1e6,
        }
    else:
        comm = _intersect(_cpu_comm(events, main_tid, steps), steps)
        method = "cpu"
        cuda_extra = {}
    comm_s = _length(comm) / 1e6
    total_s = total / 1e6
    starts = [a for a, _ in steps]
    # Operators that began inside a profiled step (not in the trainer's work between steps).
    in_steps = [e for e in events if (i := bisect.bisect_right(starts, e["ts"]) - 1) >= 0 and e["ts"] < steps[i][1]]
    return {
        "total_s": total_s,
        "comm_s": comm_s,
        "compute_s": total_s - comm_s,
        "comm_share": comm_s / total_s if total_s > 0 else 0.0,
        "steps": len(step_events),
        "method": method,
        "top_ops": _top_by_self_time([e for e in in_steps if e.get("cat") == "cpu_op"]),
        "top_kernels": _top_by_self_time([e for e in in_steps if e.get("cat") == "kernel"], nested=False),
        **cuda_extra,
    }


# What a device kernel does, from its name: the first kind whose words it contains (lower
# case). The names as CUDA 13's libraries and torch 2.11 give them: cuBLAS's Hopper GEMMs are
# `nvjet_*` or `sm90_xmma_gemm_*`, CUTLASS's `cutlass*`, inductor's matmul templates
# `triton_tem_*`; FlashAttention `pytorch_flash::flash_fwd_kernel`, cuDNN's attention
# `cudnn_generated_fort_native_sdpa_*`, the memory-efficient one `fmha_*`; torchao's float8
# casts are inductor kernels; everything else inductor fused is `triton_*`; aten's own
# pointwise and reduction kernels `at::native::*elementwise*` / `*reduce_kernel*`.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "triton_tem", "wgmma", "_mm_", "matmul")),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("fused (inductor)", ("triton_",)),
    ("elementwise, reductions (aten)", ("elementwise", "reduce", "vectorized", "unrolled", "softmax", "loss", "index")),
)


def kernel_kind(name: str, cat: str = "kernel") -> str:
    """One of KERNEL_KINDS' names, "copies" (memcpy, memset), or "other"."""
    if cat != "kernel":
        return "copies"
    lower = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in lower for w in words)), "other")


def _cpu_comm(events: list[dict[str, Any]], main_tid: Any, steps: list[Interval]) -> list[Interval]:
    main = [e for e in events if e["tid"] == main_tid]
    explicit = _merge(
        (e["ts"], e["ts"] + e["dur"]) for e in main if e["name"].startswith(COMM_OP_PREFIXES) or e["name"].startswith(WAIT_RANGES)
    )
    # Busy: inside an operator that computes, i.e. one with no operator nested in it. The self
    # time of an enclosing one (RegisterPostBackwardFunctionBackward, an autograd node) is
    # where Python hooks run, FSDP's and DeepSpeed's reduce-and-wait among them.
    busy = _merge((e["ts"], e["ts"] + e["dur"]) for e in _leaves([e for e in main if e.get("cat") == "cpu_op"]))
    in_flight = _merge(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] != main_tid and e["name"].startswith(COLLECTIVE_PREFIXES)
    )
    # Idle: no operator for at least MIN_IDLE_US. Shorter gaps are the dispatcher and the
    # autograd engine between operators (hundreds of 2-20 us gaps per backward), not waits.
    idle = [(a, b) for a, b in _subtract(steps, busy) if b - a >= MIN_IDLE_US]
    return _merge(explicit + _intersect(idle, in_flight))


def _leaves(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operators of one thread that contain no other."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    parents: set[int] = set()
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            parents.add(stack[-1])
        stack.append(i)
    return [e for i, e in enumerate(ops) if i not in parents]


def _busiest_thread(events: list[dict[str, Any]]) -> Any:
    per: dict[Any, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "cpu_op":
            per[e["tid"]] += e["dur"]
    return max(per, key=lambda t: per[t]) if per else None


def _top_by_self_time(events: list[dict[str, Any]], nested: bool = True) -> list[dict[str, Any]]:
    """Self time: an event's duration less its direct children's (same thread, nested); for
    kernels (`nested=False`), which never nest, the duration."""
    self_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e["tid"])].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack and nested:
                self_us[stack[-1]["name"]] -= min(e["dur"], stack[-1]["ts"] + stack[-1]["dur"] - e["ts"])
            self_us[e["name"]] += e["dur"]
            count[e["name"]] += 1
            stack.append(e)
    top = sorted(self_us, key=lambda n: -self_us[n])[:TOP_N]
    return [{"name": n, "self_s": self_us[n] / 1e6, "count": count[n]} for n in top]


def _merge(intervals: Any) -> list[Interval]:
    """Sorted, disjoint union of (start, end) pairs."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersect(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """Intersection of two merged lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(x: list[Interval], y: list[Interval]) -> list[Interval]:
    """x minus y, both merged."""
    out, j = [], 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def _length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in intervals)
