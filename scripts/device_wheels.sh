#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (docs/gpu.md, "Part B: the device command"), into .whl/.
#
#     bash scripts/device_wheels.sh          # from anywhere; writes <repo>/.whl/ (ignored by git)
#
# That machine has Python 3.12 and torch 2.11 with most of scaletrain's dependencies, and no
# network; these travel with the working tree (64 MiB a call, the repository included) and are
# installed there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`:
#   deepspeed          published only as an sdist: built here into a pure-Python wheel (its C++ and
#                      CUDA ops are JIT-built there on first use, by the nvcc it has)
#   pydantic           with pydantic-core (the version pydantic's metadata names: a cp312 manylinux
#                      binary), annotated-types and typing-inspection (its Requires-Dist)
#   typing-extensions  there, at a version nobody has read; pydantic-core needs >= 4.14.1, and this
#                      one (pure Python, ~45 kB) comes first on PYTHONPATH
#   hjson              DeepSpeed's one requirement the image lacks (einops, msgpack, ninja, numpy,
#                      packaging, psutil, py-cpuinfo and tqdm are there)
#   torchao            train.float8 (the float8 extra)
# Exact pins from pyproject.toml where it has them; the others below. It prints each wheel's size
# and the total with the repository's files, and fails over the limit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.whl
LIMIT_MIB=60 # of the 64 MiB a call carries: 4 MiB of headroom for files added after this ran
# The versions this project's own environment runs (make setup), where pyproject.toml pins none.
OTHERS=(annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 hjson==3.1.0)

pin() { # NAME [EXTRA]: NAME==VERSION as pyproject.toml pins it (in dependencies, or in that optional extra)
  "$PY" - "$@" <<'PYTHON'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
name, extra = (sys.argv[1:] + [None])[:2]
reqs = [r.split(";")[0].strip() for r in (project["optional-dependencies"].get(extra, []) if extra else project["dependencies"])]
pins = [r for r in reqs if re.fullmatch(rf"{name}==\S+", r, re.IGNORECASE)]
print(pins[0]) if pins else sys.exit(f"device_wheels: no exact pin of {name} in pyproject.toml ({extra or 'dependencies'})")
PYTHON
}

requires() { # WHEEL NAME: NAME's requirement in WHEEL's metadata (Requires-Dist), e.g. pydantic-core==2.46.4
  "$PY" - "$@" <<'PYTHON'
import re, sys, zipfile
wheel, name = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
found = [r.split(";")[0].replace(" ", "") for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.MULTILINE)
         if re.match(rf"{name}\b", r, re.IGNORECASE) and "extra ==" not in r]
print(found[0]) if found else sys.exit(f"device_wheels: {wheel} does not require {name}")
PYTHON
}

download() { # NAME==VERSION ...: wheels for CPython 3.12 on manylinux x86-64 (pure-Python ones match too)
  local platforms=() n
  for n in 28 27 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "$@"
}

mib() { awk -v b="$1" 'BEGIN {printf "%9.2f MiB", b / 1048576}'; }

deepspeed=$(pin deepspeed)
pydantic=$(pin pydantic)
torchao=$(pin torchao float8)
rm -rf "$DEST" && mkdir "$DEST"
download "$pydantic" "$torchao" "${OTHERS[@]}"
download "$(requires "$DEST"/pydantic-[0-9]*.whl pydantic-core)"
# No build isolation: DeepSpeed's setup.py imports torch (this environment's); only its Python
# files go into the wheel.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$deepspeed"

# One version of each package, or the install there stops.
dupes=$(ls "$DEST" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "device_wheels: two versions of: $dupes" >&2; exit 1; }
for f in "$DEST"/*.whl; do echo "$(mib "$(stat -c %s "$f")")  $(basename "$f")"; done
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
repo=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
total=$((wheels + repo))
echo "$(mib "$wheels")  the wheels ($(ls "$DEST"/*.whl | wc -l) files)"
echo "$(mib "$repo")  the repository (tracked and untracked-not-ignored files)"
echo "$(mib "$total")  in all; allowed here: $LIMIT_MIB MiB (a call carries 64 MiB)"
[ "$total" -le $((LIMIT_MIB * 1048576)) ] || { echo "device_wheels: over $LIMIT_MIB MiB" >&2; exit 1; }
