#!/usr/bin/env bash
# scripts/gpu_checklist.sh: what scaletrain does on one NVIDIA GPU (H100/H200), in one go.
#
#   bash scripts/gpu_checklist.sh [OUT_DIR]          # default OUT_DIR: runs/gpu_checklist
#
# Run it from a checkout (it changes into the repository root itself). It uses the CLI as a
# user would (`scaletrain train`, `scaletrain plan --measure`) and reads what the runs write
# (metrics.jsonl, run.json, the JSON of --measure). Parts:
#   1. environment: nvidia-smi, python / torch / CUDA / NCCL / deepspeed versions, the device
#   2. every engine at world size 1 (ddp, fsdp, zero1-3, the offloads) in bf16 and fp16:
#      first and last loss, tokens/s, peak memory; FAIL when the loss is not finite or did not fall
#   3. the planner's predicted peak memory against the measured one (`plan --measure --json`)
#   4. MFU of the 1b preset (fsdp, bf16, seq 2048), eager and with train.compile=true, and
#      where the step's time goes (the telemetry's phases)
#   5. OUT_DIR/summary.md: the tables, for docs/gpu.md
# Each check prints one PASS/FAIL line with the exact command; a failure does not stop the
# others, and the script exits 1 at the end if anything failed. Logs: OUT_DIR/logs/.
# Without a CUDA device it runs quick CPU versions of parts 2 and 3 (tiny preset, fp32) and
# says "GPU parts skipped: no CUDA device"; it then exits 0 when those passed.
#
# Environment knobs (all optional):
#   SCALETRAIN        the CLI (default .venv/bin/scaletrain, then `scaletrain` on PATH, then
#                     "$PYTHON -m scaletrain"); may be several words, e.g. "python3 -m scaletrain"
#   PYTHON            the interpreter (default .venv/bin/python, then python3 on PATH)
#   STEP_TIMEOUT      seconds one command may run before it is killed (default 900)
#   ENGINE_STEPS      steps of each engine run in part 2 (default 20 on GPU, 10 on CPU)
#   MFU_STEPS         steps of each 1b run in part 4 (default 30)
#   MFU_MAX_MB        largest micro-batch part 4 tries (default 16)
#   DS_OPTIMIZER      auto | fused | torch: DeepSpeed's optimizer on GPU without offload. auto
#                     (default) keeps DeepSpeed's FusedAdam when nvcc is there to JIT-build it,
#                     and otherwise passes optimizer.params.torch_adam=true (torch's AdamW)
#   KEEP_CHECKPOINTS  1 keeps each run's final checkpoint (the 1b ones are ~15 GB each)
#   FORCE_CPU         1 runs the CPU mode even where a GPU is present
set -uo pipefail # no -e: a failing check is recorded and the next one runs

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_ARG=${1:-runs/gpu_checklist}
mkdir -p "$OUT_ARG" || exit 2
OUT=$(cd "$OUT_ARG" && pwd) # absolute before we change directory
cd "$ROOT" || exit 2

STEP_TIMEOUT=${STEP_TIMEOUT:-900}
MFU_STEPS=${MFU_STEPS:-30}
MFU_MAX_MB=${MFU_MAX_MB:-16}
DS_OPTIMIZER=${DS_OPTIMIZER:-auto}
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-0}
FORCE_CPU=${FORCE_CPU:-0}

FAILED=0
T_START=$(date +%s)

# ---------------------------------------------------------------------------------------
# Tools: the venv's when there is one, else what is on PATH (a `pip install --target DIR`
# with PYTHONPATH=DIR works too: nothing here unsets the environment).
# ---------------------------------------------------------------------------------------
if [[ -n ${PYTHON:-} ]]; then
    PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
elif command -v python3 >/dev/null 2>&1; then
    PY=python3
else
    PY=python
fi
if [[ -n ${SCALETRAIN:-} ]]; then
    read -r -a ST <<<"$SCALETRAIN"
elif [[ -x .venv/bin/scaletrain ]]; then
    ST=(.venv/bin/scaletrain)
elif command -v scaletrain >/dev/null 2>&1; then
    ST=(scaletrain)
else
    ST=("$PY" -m scaletrain)
fi
# timeout(1) keeps a hung run from eating the GPU budget; without it, commands run unbounded.
if command -v timeout >/dev/null 2>&1; then
    LIMIT=(timeout --kill-after=30 "$STEP_TIMEOUT")
else
    LIMIT=()
fi

mkdir -p "$OUT/logs" "$OUT/runs"
RESULTS=$OUT/results.jsonl
: >"$RESULTS"

# The Python that reads what the runs wrote and writes results.jsonl and summary.md.
HELPER=$ROOT/scripts/gpu_checklist.py

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
helper() { "$PY" "$HELPER" "$@"; }

# A command as one pasteable line: words that need it in single quotes.
show() {
    local out="" w
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then
            out+="$w "
        else
            out+="'${w//\'/\'\\\'\'}' "
        fi
    done
    printf '%s' "${out% }"
}

# report PART NAME STATUS DETAIL CMD [DATA_JSON]: one line on the terminal, one in results.jsonl.
report() {
    local part=$1 name=$2 status=$3 detail=$4 cmd=$5 data=${6:-}
    [[ $status == FAIL ]] && FAILED=$((FAILED + 1))
    printf '%-4s [%s] %s: %s\n' "$status" "$part" "$name" "$detail"
    [[ -n $cmd ]] && printf '       $ %s\n' "$cmd"
    helper record "$RESULTS" "$part" "$name" "$status" "$detail" "$cmd" "$data"
}

# run_logged LOG CMD...: CMD under the time limit, stdout+stderr into LOG; sets LAST_WALL.
run_logged() {
    local log=$1 t0 rc
    shift
    t0=$(date +%s)
    "${LIMIT[@]}" "$@" >"$log" 2>&1
    rc=$?
    LAST_WALL=$(($(date +%s) - t0))
    [[ $rc -eq 124 || $rc -eq 137 ]] && echo "checklist: killed after ${STEP_TIMEOUT} s (STEP_TIMEOUT)" >>"$log"
    return $rc
}

# The end of a failed command's log, indented, so the reason shows without opening the file.
tail_log() { tail -n "${2:-15}" "$1" | sed 's/^/       | /'; }

drop_checkpoints() { [[ $KEEP_CHECKPOINTS == 1 ]] || rm -rf "$1/checkpoints"; }

# train_check PART NAME EXPECT_STEPS OVERRIDE...: one `scaletrain train` run into
# OUT/runs/NAME (emptied first, and train.resume=never: a rerun must not resume a previous
# checklist's checkpoint and train zero steps), judged from its metrics.jsonl.
train_check() {
    local part=$1 name=$2 steps=$3
    shift 3
    local dir=$OUT/runs/$name log=$OUT/logs/$name.log detail
    rm -rf "$dir"
    local cmd=("${ST[@]}" train "$@" train.steps="$steps" checkpoint.every=0 train.resume=never run.dir="$dir")
    if run_logged "$log" "${cmd[@]}"; then
        if detail=$(helper metrics "$dir" "$steps" "$OUT/logs/$name.json"); then
            report "$part" "$name" PASS "$detail (${LAST_WALL} s)" "$(show "${cmd[@]}")" "$OUT/logs/$name.json"
            drop_checkpoints "$dir"
            return 0
        fi
        report "$part" "$name" FAIL "$detail (${LAST_WALL} s)" "$(show "${cmd[@]}")" "$OUT/logs/$name.json"
    else
        local rc=$?
        report "$part" "$name" FAIL "exit $rc after ${LAST_WALL} s, log $log" "$(show "${cmd[@]}")"
        tail_log "$log"
    fi
    drop_checkpoints "$dir"
    return 1
}

# measure_check PART NAME OVERRIDE...: `scaletrain plan --measure --json`. The error is
# reported, not judged (the planner's GPU accuracy is what this measures); it fails only
# when the command fails or prints no JSON. |error| > 15% (the CPU tests' bound) is marked.
measure_check() {
    local part=$1 name=$2 detail
    shift 2
    local log=$OUT/logs/measure-$name.log
    local cmd=("${ST[@]}" plan "$@" --measure --json) rc=0
    run_logged "$log" "${cmd[@]}" || rc=$?
    if [[ $rc -eq 0 ]] && detail=$(helper measure "$log" "$OUT/logs/measure-$name.json"); then
        if "$PY" - "$OUT/logs/measure-$name.json" <<'PYEOF'; then
import json, sys
d = json.load(open(sys.argv[1]))
errors = [abs(e) for e in (d["error"], d.get("error_cuda")) if e is not None]
sys.exit(0 if errors and max(errors) > 0.15 else 1)
PYEOF
            detail+=" [beyond 15%]"
        fi
        report "$part" "$name" PASS "$detail (${LAST_WALL} s)" "$(show "${cmd[@]}")" "$OUT/logs/measure-$name.json"
    else
        [[ $rc -ne 0 ]] && detail="exit $rc, log $log"
        report "$part" "$name" FAIL "$detail (${LAST_WALL} s)" "$(show "${cmd[@]}")"
        tail_log "$log"
    fi
}

is_oom() { grep -qiE 'out of memory|OutOfMemoryError' "$1"; }

# ---------------------------------------------------------------------------------------
# Part 1: environment
# ---------------------------------------------------------------------------------------
part1_environment() {
    echo "== 1. environment (results in $OUT)"
    local smi_gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        local q=(nvidia-smi "--query-gpu=name,driver_version,memory.total,compute_cap" "--format=csv,noheader")
        if "${q[@]}" >"$OUT/logs/nvidia-smi.txt" 2>&1; then
            smi_gpus=$(grep -c . "$OUT/logs/nvidia-smi.txt")
            report 1 nvidia-smi PASS "$(head -n 1 "$OUT/logs/nvidia-smi.txt") ($smi_gpus GPU(s))" "$(show "${q[@]}")"
        else
            report 1 nvidia-smi FAIL "$(head -n 1 "$OUT/logs/nvidia-smi.txt")" "$(show "${q[@]}")"
        fi
        nvidia-smi >>"$OUT/logs/nvidia-smi.txt" 2>&1
    else
        report 1 nvidia-smi SKIP "nvidia-smi not found" ""
    fi

    local ver cmd=("${ST[@]}" --version)
    ver=$("${cmd[@]}" 2>&1)
    local rc=$?
    ver=${ver%%$'\n'*} # its first line
    if [[ $rc -eq 0 ]]; then
        report 1 "scaletrain CLI" PASS "$ver" "$(show "${cmd[@]}")"
    else
        report 1 "scaletrain CLI" FAIL "$ver" "$(show "${cmd[@]}")"
    fi

    if helper env >"$OUT/env.json" 2>"$OUT/logs/env.log"; then
        HAVE_CUDA=$(helper get "$OUT/env.json" cuda_available)
        local detail
        detail=$("$PY" - "$OUT/env.json" <<'PYEOF'
import json, sys
e = json.load(open(sys.argv[1]))
line = f"python {e['python']}, torch {e['torch']} (CUDA {e['torch_cuda']}), deepspeed {e['deepspeed']}, cuda available: {e['cuda_available']}"
if e["cuda_available"]:
    line += f", {e['device_name']} (sm {e['capability']}, {e['device_memory'] / 2**30:.1f} GiB, bf16 {e['bf16']}, NCCL {e['nccl']}, {e['device_count']} device(s))"
print(line)
PYEOF
        )
        local status=PASS
        if [[ $(helper get "$OUT/env.json" deepspeed) == "" ]]; then
            status=FAIL detail+="; deepspeed is not installed"
        fi
        if [[ $smi_gpus -gt 0 && $HAVE_CUDA != true ]]; then
            # nvidia-smi sees a GPU that torch cannot use: a CPU wheel, or a driver too old for it.
            status=FAIL detail+="; nvidia-smi lists a GPU but torch.cuda.is_available() is False"
        fi
        report 1 "python/torch/deepspeed" "$status" "$detail" "$(show "$PY" "$HELPER" env)"
    else
        HAVE_CUDA=false
        report 1 "python/torch/deepspeed" FAIL "$(tail -n 1 "$OUT/logs/env.log")" "$(show "$PY" "$HELPER" env)"
    fi
    [[ $FORCE_CPU == 1 ]] && HAVE_CUDA=false

    # DeepSpeed builds FusedAdam (its optimizer on GPU without offload) with nvcc at the first
    # ZeRO run; pip's torch wheels bring no nvcc. Without it, DS_OPTIMIZER=auto switches the
    # ZeRO runs to torch's AdamW (optimizer.params.torch_adam) so that the rest still runs.
    DS_EXTRA=()
    if [[ $HAVE_CUDA == true ]]; then
        local nvcc
        nvcc=$(helper get "$OUT/env.json" nvcc)
        if [[ $DS_OPTIMIZER == torch || ($DS_OPTIMIZER == auto && -z $nvcc) ]]; then
            DS_EXTRA=('parallel.deepspeed_extra={optimizer: {params: {torch_adam: true}}}')
            report 1 "DeepSpeed optimizer" WARN "no nvcc (CUDA_HOME) to build FusedAdam: the ZeRO runs without offload use torch AdamW (DS_OPTIMIZER=$DS_OPTIMIZER)" ""
        else
            report 1 "DeepSpeed optimizer" PASS "FusedAdam, built by DeepSpeed with ${nvcc:-nvcc} on first use (DS_OPTIMIZER=$DS_OPTIMIZER)" ""
        fi
    fi
}

# ---------------------------------------------------------------------------------------
# Part 2: every engine, world size 1. The small preset (CPU-sized, vocabulary of the
# locally trained tokenizer): this is a check that each engine trains on the GPU, not a
# speed figure; part 4 is the speed figure. ddp at world 1 runs without a process group
# (one process, no DDP wrapper); fsdp and ZeRO make a group of one, NCCL on CUDA.
# ---------------------------------------------------------------------------------------
part2_engines_gpu() {
    echo "== 2. engines at world size 1 on CUDA (small preset)"
    local steps=${ENGINE_STEPS:-20} precision engine
    local common=(model.preset=small run.device=cuda train.log_every=5)
    for precision in bf16 fp16; do
        train_check 2 "ddp-$precision" "$steps" "${common[@]}" parallel.strategy=ddp precision=$precision
        train_check 2 "fsdp-$precision" "$steps" "${common[@]}" parallel.strategy=fsdp precision=$precision
        for engine in zero1 zero2 zero3; do
            train_check 2 "$engine-$precision" "$steps" "${common[@]}" parallel.strategy=$engine precision=$precision "${DS_EXTRA[@]}"
        done
        # CPU offload: DeepSpeedCPUAdam (a C++ op DeepSpeed builds with the host compiler) and
        # FSDP2's CPUOffloadPolicy.
        train_check 2 "zero3-offload-$precision" "$steps" "${common[@]}" parallel.strategy=zero3 precision=$precision \
            parallel.offload_optimizer=cpu parallel.offload_params=cpu
        train_check 2 "fsdp-offload-$precision" "$steps" "${common[@]}" parallel.strategy=fsdp precision=$precision \
            parallel.offload_params=cpu
    done
}

part2_engines_cpu() {
    echo "== 2. engines at world size 1 on CPU (tiny preset, fp32; the CPU stand-in for the GPU part)"
    local steps=${ENGINE_STEPS:-10}
    local common=(model.preset=tiny run.device=cpu precision=fp32 train.log_every=5)
    train_check 2 ddp-cpu "$steps" "${common[@]}" parallel.strategy=ddp
    train_check 2 fsdp-cpu "$steps" "${common[@]}" parallel.strategy=fsdp
    # DeepSpeed's default bucket (5e7 elements, 191 MiB) made each tiny zero2 step take 4.4 s
    # on a 2-core CPU instead of 0.25 s; a 2e6-element bucket keeps this smoke test quick.
    train_check 2 zero2-cpu "$steps" "${common[@]}" parallel.strategy=zero2 parallel.bucket_size=2000000
}

# ---------------------------------------------------------------------------------------
# Part 3: the planner's peak against a measured one (3 real steps under torch's MemTracker;
# on CUDA also torch.cuda.max_memory_allocated).
# ---------------------------------------------------------------------------------------
part3_planner_gpu() {
    echo "== 3. planner: predicted vs measured peak on CUDA"
    local small=(model.preset=small data.seq_len=256 train.micro_batch=8 run.device=cuda)
    # The 1b preset at its published vocabulary (Llama 3.2 1B, 1.24B parameters); --measure
    # feeds random tokens, so no tokenizer is involved.
    local big=(model.preset=1b model.vocab_size=128256 data.seq_len=2048 precision=bf16 run.device=cuda)
    measure_check 3 small-ddp-fp32 "${small[@]}" parallel.strategy=ddp precision=fp32
    measure_check 3 small-fsdp-bf16 "${small[@]}" parallel.strategy=fsdp precision=bf16
    measure_check 3 small-zero2-bf16 "${small[@]}" parallel.strategy=zero2 precision=bf16 "${DS_EXTRA[@]}"
    measure_check 3 small-zero3-bf16 "${small[@]}" parallel.strategy=zero3 precision=bf16 "${DS_EXTRA[@]}"
    measure_check 3 1b-fsdp-bf16-AC-mb4 "${big[@]}" parallel.strategy=fsdp parallel.activation_checkpointing=true train.micro_batch=4
    measure_check 3 1b-fsdp-bf16-mb2 "${big[@]}" parallel.strategy=fsdp train.micro_batch=2
    measure_check 3 1b-zero3-bf16-AC-mb4 "${big[@]}" parallel.strategy=zero3 parallel.activation_checkpointing=true train.micro_batch=4 "${DS_EXTRA[@]}"
}

part3_planner_cpu() {
    echo "== 3. planner: predicted vs measured peak on CPU (tiny preset, fp32)"
    local tiny=(model.preset=tiny run.device=cpu precision=fp32)
    # One torch engine and one DeepSpeed engine (~20 s each here, mostly start-up).
    measure_check 3 tiny-ddp-cpu "${tiny[@]}" parallel.strategy=ddp
    measure_check 3 tiny-zero2-cpu "${tiny[@]}" parallel.strategy=zero2
}

# ---------------------------------------------------------------------------------------
# Part 4: MFU of the 1b preset, fsdp, bf16, seq 2048, one GPU.
# Vocabulary: a builtin preset takes the tokenizer's vocabulary unless model.vocab_size is
# set (models/presets.py resolve_shape), and the embedded corpus is tokenized with a BPE of
# data.vocab_size=4096 trained here; the 1b run would then be a 0.98B model with a 4096-entry
# head, while the planner (no tokenizer) plans 128256. model.vocab_size=128256 (>= the
# tokenizer's, which is allowed: ids past 4096 are simply never seen) gives the published
# Llama 3.2 1B shape, comparable with torchtitan / llm-foundry, and the plan and the run agree.
# ---------------------------------------------------------------------------------------
part4_mfu_gpu() {
    echo "== 4. MFU: 1b preset, fsdp, bf16, seq 2048, one GPU"
    # (the runs themselves: mfu_run, with the same settings)
    local base=(model.preset=1b model.vocab_size=128256 data.seq_len=2048 precision=bf16 parallel.strategy=fsdp)
    local mem gpu_kind dev_name
    mem=$(helper get "$OUT/env.json" device_memory)
    dev_name=$(helper get "$OUT/env.json" device_name)
    case $dev_name in
    *H200*) gpu_kind=h200 ;;
    *A100*) gpu_kind=a100 ;;
    *) gpu_kind=h100 ;;
    esac

    # The largest micro-batch the planner says fits this device (its memory as torch reports
    # it, 10% headroom), without and with activation checkpointing.
    local ac mb peak mb_noac=0 mb_ac=0 peak_noac=- peak_ac=- out
    for ac in false true; do
        local pcmd=("${ST[@]}" plan "${base[@]}" "parallel.activation_checkpointing=$ac" train.micro_batch=1
            --gpus-per-node 1 --gpu "$gpu_kind" --gpu-memory "${mem}B" --configured-only --json)
        if "${pcmd[@]}" >"$OUT/logs/plan-1b-ac-$ac.json" 2>"$OUT/logs/plan-1b-ac-$ac.log" &&
            out=$(helper plan-mb "$OUT/logs/plan-1b-ac-$ac.json"); then
            read -r mb peak <<<"$out"
            if [[ $ac == false ]]; then mb_noac=$mb peak_noac=$peak; else mb_ac=$mb peak_ac=$peak; fi
            report 4 "plan 1b AC=$ac" PASS "largest micro-batch that fits: $mb (peak at micro-batch 1: $peak GiB)" "$(show "${pcmd[@]}")"
        else
            report 4 "plan 1b AC=$ac" FAIL "see $OUT/logs/plan-1b-ac-$ac.log" "$(show "${pcmd[@]}")"
            tail_log "$OUT/logs/plan-1b-ac-$ac.log" 5
        fi
    done

    # Activation checkpointing only if nothing fits without it (it costs a recompute of each
    # block's forward). The micro-batch: the largest power of two within the planner's limit
    # and MFU_MAX_MB, halved on an out-of-memory error (the planner's error bound is ~15%).
    local use_ac=false limit=$mb_noac
    if [[ $mb_noac -lt 1 ]]; then use_ac=true limit=$mb_ac; fi
    [[ $limit -gt $MFU_MAX_MB ]] && limit=$MFU_MAX_MB
    mb=1
    while [[ $((mb * 2)) -le $limit ]]; do mb=$((mb * 2)); done
    if [[ $limit -lt 1 ]]; then
        report 4 "MFU 1b" FAIL "the planner finds no micro-batch that fits (peak at 1: $peak_noac / $peak_ac GiB with AC)" ""
        return
    fi
    echo "     micro-batch $mb x 2048 tokens, activation checkpointing $use_ac (planner: up to $mb_noac without AC, $mb_ac with)"

    mfu_run eager false "$use_ac" "$mb"
    mfu_run compiled true "$use_ac" "$mb"
    # What activation checkpointing costs, when the runs above went without it.
    if [[ $use_ac == false ]]; then mfu_run eager false true "$mb"; fi
}

# mfu_run VARIANT COMPILE AC MB: one 1b run; on an out-of-memory error again at MB/2 (down to 1).
mfu_run() {
    local variant=$1 compile=$2 ac=$3 mb=$4
    local name="1b-$variant-mb$mb"
    [[ $ac == true ]] && name+="-AC"
    if ! train_check 4 "$name" "$MFU_STEPS" model.preset=1b model.vocab_size=128256 data.seq_len=2048 \
        precision=bf16 parallel.strategy=fsdp parallel.activation_checkpointing="$ac" train.compile="$compile" \
        train.micro_batch="$mb" train.log_every=5 run.device=cuda; then
        if is_oom "$OUT/logs/$name.log" && [[ $mb -gt 1 ]]; then
            echo "     out of memory at micro-batch $mb: once more at $((mb / 2))"
            mfu_run "$variant" "$compile" "$ac" $((mb / 2))
        fi
    fi
}

# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
part1_environment
if [[ $HAVE_CUDA == true ]]; then
    MODE=GPU
    part2_engines_gpu
    part3_planner_gpu
    part4_mfu_gpu
else
    MODE=CPU
    part2_engines_cpu
    part3_planner_cpu
    echo "GPU parts skipped: no CUDA device"
    report 4 "GPU parts (engines and planner on CUDA, 1b MFU)" SKIP "GPU parts skipped: no CUDA device" ""
fi

WALL=$(($(date +%s) - T_START))
helper summary "$RESULTS" "$OUT/env.json" "$OUT/summary.md" "$MODE" "$WALL"
echo "== 5. summary: $OUT/summary.md ($MODE mode, ${WALL} s, $FAILED failed)"
if [[ $FAILED -gt 0 ]]; then
    echo "FAIL: $FAILED check(s) failed"
    exit 1
fi
echo "PASS: every check passed"
exit 0
