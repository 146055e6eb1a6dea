#!/bin/bash
# One device call (2026-11-29, one H200): the clock's table for this GPU kind (issue 55: scaletrain plan
# --calibrate), then every path beside its peer (issue 59: scripts/gpu_peers.py) until the budget ends.
# Each result lands in $OUT as it is measured. Run from the repository root with .whl carried:
#   bash docs/gpu/2026-11-29-h200/device_run.sh      (the device tool's run, timeout_s 600)
set -u
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
T0=$(date +%s)
END=$((T0 + ${BUDGET:-570}))
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/timeline.txt"; }
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" "${@:2}"; }
pipi /tmp/site .whl/*.whl || { el "scaletrain's wheels failed"; exit 1; }
# The peers' packages in folders of their own, after scaletrain's: their pins cannot replace ours.
pipi /tmp/peersite .whl/peer/*.whl || el "the HF peers' wheels failed (their rows fail, the rest goes on)"
ls .whl/titan/*.whl >/dev/null 2>&1 && { pipi /tmp/titansite .whl/titan/*.whl || el "torchtitan's wheels failed"; }
el installed
mkdir -p /tmp/logs
{ nvidia-smi; python3 -c "import torch,sys; print(sys.version, torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } > /tmp/logs/env.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
# 1. The clock's rates on this GPU: the presets' matmul shapes (1b, 8b, 70b) and the small preset's (most of
# the runs recorded in docs/gpu/), attention by length and head size, bandwidth, the host per operation.
timeout 150 python3 -m scaletrain plan --calibrate model.preset=small > "$OUT/calibrate.log" 2>&1
el "calibrate rc=$?"
# (its JSON line, not the last: NCCL's warning at exit about a process group left undestroyed can follow it)
table=$(grep '^{"kind"' "$OUT/calibrate.log" | tail -1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["path"])' 2>/dev/null) && cp "$table" "$OUT/clock-table.json"
# 2. The paths and their peers, as long as the budget lasts (each run's expected seconds must fit).
TITAN_SITE=/tmp/titansite PYTHONPATH=/tmp/site:/tmp/peersite:$PWD/src python3 scripts/gpu_peers.py "$OUT" --work /tmp/peers \
  --budget $((END - $(date +%s))) > "$OUT/peers.log" 2>&1
el "peers rc=$?"
cp -r /tmp/logs/env.txt /tmp/peers 2>/dev/null
tar czf "$OUT/logs.tgz" --exclude='*.pt' --exclude='*/checkpoints' --exclude='*/titan/data*' --exclude='*/titan/tokenizer*' -C /tmp peers 2>/dev/null
el done
