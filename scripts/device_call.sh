#!/bin/bash
# One lent GPU's call (docs/gpu.md, Part B, "The next lent GPU"): the clock's table for this GPU kind
# first (scaletrain plan --calibrate: matmuls, attention to 131k tokens, bandwidth, AdamW, the host per
# operation, each engine's own host work), the clock against every run recorded in docs/gpu/ with it,
# then the named rows of scripts/gpu_peers.py in its order, as long as the budget lasts. Each result
# lands in $OUT as soon as it is measured. From the repository root, with .whl carried
# (scripts/device_wheels.sh, then the peers' wheels into .whl/peer and .whl/titan):
#   BUDGET=540 bash scripts/device_call.sh torchtitan-compiled scaletrain-moe ...   (timeout_s 600)
#   bash scripts/device_call.sh --no-calibrate scaletrain-zero2 ...                  (a second call)
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
T0=$(date +%s)
END=$((T0 + ${BUDGET:-540}))
CALIBRATE=1
[ "${1:-}" = "--no-calibrate" ] && { CALIBRATE=0; shift; }
el() { echo "[t=$(($(date +%s) - T0))s] $*" | tee -a "$OUT/timeline.txt"; }
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
pipi /tmp/site .whl/*.whl || { el "scaletrain's wheels failed"; exit 1; }
# The peers' packages in folders of their own, after scaletrain's: their pins cannot replace ours.
ls .whl/peer/*.whl >/dev/null 2>&1 && { pipi /tmp/peersite .whl/peer/*.whl || el "the HF peers' wheels failed (their rows fail, the rest goes on)"; }
ls .whl/titan/*.whl >/dev/null 2>&1 && { pipi /tmp/titansite .whl/titan/*.whl || el "torchtitan's wheels failed (its row fails)"; }
el installed
{ nvidia-smi; python3 -c "import torch,sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
if [ $CALIBRATE = 1 ]; then
  # 1. The rates; the small preset's shapes beside the presets' (most runs recorded in docs/gpu/ are small).
  timeout 240 python3 -m scaletrain plan --calibrate model.preset=small > "$OUT/calibrate.log" 2>&1
  el "calibrate rc=$?"
  # its JSON line, not the last: NCCL's warning at exit about a process group left undestroyed can follow it
  table=$(grep '^{"kind"' "$OUT/calibrate.log" | tail -1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])' 2>/dev/null)
  if [ -n "$table" ]; then
    cp "$table" "$OUT/clock-table.json"
    kind=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["kind"])' "$table")
    # 2. The clock against every recorded run, with the table just measured in the package's place.
    cp "$table" "$PWD/src/scaletrain/planning/clock/tables/$kind.json"
    timeout 120 python3 -m scaletrain bench --suite clock-gpu > "$OUT/clock-gpu.md" 2>&1
    el "clock-gpu rc=$?"
  fi
  # Which attention kernel a step runs with each first in SDPA's priority, eager and compiled (~30 s).
  timeout 90 python3 scripts/attention_kernel_check.py "$OUT" > "$OUT/attention-kernels.log" 2>&1
  el "attention kernels rc=$?"
fi
# 3. The named paths and their peers (all of them where none is named), while the budget lasts.
only=()
for name in "$@"; do only+=(--only "$name"); done
TITAN_SITE=/tmp/titansite PYTHONPATH=/tmp/site:/tmp/peersite:$PWD/src python3 scripts/gpu_peers.py "$OUT" --work /tmp/peers \
  --budget $((END - $(date +%s))) "${only[@]}" > "$OUT/peers.log" 2>&1
el "peers rc=$?"
tar czf "$OUT/logs.tgz" --exclude='*.pt' --exclude='*/checkpoints' --exclude='*/titan/data*' --exclude='*/titan/tokenizer*' -C /tmp peers 2>/dev/null
el done
