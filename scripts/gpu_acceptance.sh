#!/usr/bin/env bash
# tunegrid's GPU acceptance run (scripts/gpu/acceptance.py; docs/gpu.md says how a lent GPU machine gets the
# kit and in which calls). From the project root, on the GPU machine:
#   bash scripts/gpu_acceptance.sh [--receive .gpu-kit/load-N] [--only S,..] [--skip S,..] [--out DIR]
# and here, the same sections at tiny sizes on the CPU (what the suite runs):
#   bash scripts/gpu_acceptance.sh --cpu --out DIR
# --receive first keeps that carried load's pieces on the machine and unpacks the archives it completes; the
# kit's packages then come first on the path (the pinned transformers, peft, bitsandbytes, mlflow, snakemake
# and the real-weights packages over whatever the machine has). Figures and logs go to --out ($OUT there).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
args=()
while (($#)); do
  case $1 in
    --receive) "$python" scripts/gpu/kit.py receive "$2" || exit $?; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
site=$("$python" scripts/gpu/kit.py site 2>/dev/null || true)
if [[ -n $site ]]; then
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
fi
export PYTHONUNBUFFERED=1 PYTHON=$python
exec "$python" scripts/gpu/acceptance.py "${args[@]}"
