#!/usr/bin/env bash
# The GPU benchmarks in ONE device call, inside its 10-minute limit:
#
#   bash bench/gpu_all.sh            # results and logs under $OUT (default /tmp/voxgate-gpu)
#   PARTS="gpu_flow_profile gpu_cosyvoice_pipeline" bash bench/gpu_all.sh   # some of them
#   PROFILE_ARGS="--anchor-dit .anchor/flow_dit_before.py" PIPELINE_ARGS="--streams 32,64" bash bench/gpu_all.sh
#
# flow estimator (eager / CUDA graphs / TensorRT where installed), where a flow
# pass spends its time (kernels, attention masks, torch.compile), the LM decode
# steps, then the whole pipeline with whatever time is left (its --budget-s
# stops it cleanly). Each script rewrites its JSON after every case, so a run
# cut short still returns what it measured. At most six files come back (the
# device returns eight): gpu.txt (the machine), gpu.log (every script's output,
# in order) and a .json per script. Runs from the repository root with the
# machine's own python3 and torch; nothing is installed. SMOKE=1 runs each
# script's --smoke mode instead (tiny sizes on the CPU; tests/unit/bench/test_gpu_scripts.py).
set -u
OUT=${OUT:-/tmp/voxgate-gpu}
TOTAL_S=${TOTAL_S:-570}
PARTS=${PARTS:-gpu_flow_estimator gpu_flow_profile gpu_cosyvoice_lm gpu_cosyvoice_pipeline}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
    nproc
} >"$OUT/gpu.txt" 2>&1

run() {  # name, seconds, extra arguments
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name (at most $limit s)"
    echo "== $name (at most $limit s)" >>"$OUT/gpu.log"
    # shellcheck disable=SC2046
    timeout -k 10 "$limit" python3 -m "bench.$name" --json "$OUT/$name.json" "$@" \
        $([ "${SMOKE:-0}" = 1 ] && echo --smoke) >"$OUT/part.log" 2>&1
    echo "   exit $? after $(($(date +%s) - start)) s"
    cat "$OUT/part.log" >>"$OUT/gpu.log"
    tail -n 25 "$OUT/part.log"
    rm -f "$OUT/part.log"
}

# Each script's own --budget-s ends it cleanly inside its timeout (the flow bench's default
# budget, 270 s, used to outlive a 120 s timeout: killed, nothing printed). On the first H200
# run (no TensorRT there) the flow bench took 34 s and the LM bench 17 s, while the pipeline's
# load alone took 200 s of its share: the pipeline gets what the first two leave.
# Where TensorRT is installed, give the flow bench 210 s (its export and build take minutes).
# The profile (kernels per category, three attention mask forms, a static and a dynamic
# torch.compile of 50-100 s each on the H200) gets 200 s.
FLOW_S=90 PROFILE_S=200 LM_S=90
run gpu_flow_estimator $FLOW_S --budget-s $((FLOW_S - 30))
# shellcheck disable=SC2086
run gpu_flow_profile $PROFILE_S --budget-s $((PROFILE_S - 40)) ${PROFILE_ARGS:-}
run gpu_cosyvoice_lm $LM_S
left=$((TOTAL_S - ($(date +%s) - start)))
# shellcheck disable=SC2086
run gpu_cosyvoice_pipeline $((left > 60 ? left : 60)) --budget-s $((left > 90 ? left - 30 : 60)) ${PIPELINE_ARGS:-}
echo "== done in $(($(date +%s) - start)) s"
