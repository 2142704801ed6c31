#!/usr/bin/env bash
# The GPU benchmarks in ONE device call, this build beside the build before, inside 570 s:
#
#   bash bench/gpu_prepare.sh     # HERE, once: .anchor/ (the build before) and .whl/ (gateway wheels)
#   run(command="bash bench/gpu_all.sh", carry=[".whl", ".anchor"], timeout_s=600)
#
#   PARTS="pipeline gateway" bash bench/gpu_all.sh           # some parts only
#   STREAMS=1,8,32 LEVELS=1,8 TOTAL_S=300 bash bench/gpu_all.sh
#   SMOKE=1 bash bench/gpu_all.sh                             # every part at tiny sizes on the CPU
#
# Parts, in this order, each under `timeout` and its own --budget-s (a script cut short still
# writes what it measured; each rewrites its JSON after every case):
#   flow             the flow's tick over its K/V cache against recomputation (FLOW_CACHE_ARGS)
#   lm               the LM step (sampling included) against the bare forward, per batch
#   pipeline         this build's whole backend at STREAMS streams: TTFA p50/p95, gaps, audio
#                    s per wall s, LM step p50/p99 and alone, cache GiB (it writes the random
#                    model at CosyVoice 3 sizes into $WORK, which the others reuse)
#   gateway          `voxgate serve --engine cosyvoice --workers $GATEWAY_WORKERS` on that model
#                    under the load tool: staggered talking sessions, several turns each, at
#                    LEVELS sessions
#   pipeline_before  the same pipeline bench over the build before (.anchor/: its engine on
#                    the path), with what time is left
#   gateway_before   the gateway over the build before (not in the default PARTS: no time)
#   profile          where a flow pass spends its time (bench/gpu_flow_profile.py; not default)
#
# At most 8 files come back from the device: gpu.txt (the machine), gpu.log (every part's output,
# in order) and one JSON per part, plus the gateway's server log (gateway_server.log).
# Runs from the repository root with the machine's python3 and torch; the wheels in .whl/ (PyAV,
# starlette, uvicorn, websockets) are installed with --target into $WORK/site when present.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/voxgate-gpu}
WORK=${WORK:-/tmp/voxgate-work}
TOTAL_S=${TOTAL_S:-570}
SMOKE=${SMOKE:-0}
ANCHOR=${ANCHOR:-.anchor}
PARTS=${PARTS:-flow lm pipeline gateway pipeline_before}
STREAMS=${STREAMS:-1,8,32,64,128,256}
LEVELS=${LEVELS:-1,8,32,64,128}
# The gateway: 15 s of turns per level and 8 s for the last ones to end (five levels and the
# load fit its share); LM positions 1,024 (the answers are short: half the LM graphs to capture).
# --max-contexts above the top level replaces the step-cost estimate (its 16-context floor is sized
# for a CPU); this build still never admits more than its sequence table holds (the LM's slots
# and the flow cache's streams, Backend.context_capacity). The build before takes the same
# arguments (ANCHOR_GATEWAY_ARGS, kept apart for builds whose options differ), less
# GATEWAY_WORKERS: this build serves with `voxgate serve --workers N` (one engine process, N gateway
# processes; docs/scaling.md, Workers), the build before has no such option.
GATEWAY_WORKERS=${GATEWAY_WORKERS:-4}
GATEWAY_ARGS=${GATEWAY_ARGS:---duration 15 --drain 8 --engine-option=max_len=1024 \
--server-arg=--max-contexts=256 --server-arg=--workers=$GATEWAY_WORKERS}
ANCHOR_GATEWAY_ARGS=${ANCHOR_GATEWAY_ARGS:---duration 15 --drain 8 --engine-option=max_len=1024 \
--server-arg=--max-contexts=256}
PIPELINE_ARGS=${PIPELINE_ARGS:-}
ANCHOR_PIPELINE_ARGS=${ANCHOR_PIPELINE_ARGS:-}
# >>> FLOW_CACHE_ARGS: the arguments of the flow's K/V cache bench (bench/gpu_flow_cache.py; its
# --json and --budget-s are added here). Where that bench is missing, the flow estimator bench runs.
FLOW_CACHE_ARGS=${FLOW_CACHE_ARGS:---streams 1,8,32,64,128,256 --steps 3 --warmup 1}
# <<< FLOW_CACHE_ARGS
FLOW_S=${FLOW_S:-70} LM_S=${LM_S:-45} PIPELINE_S=${PIPELINE_S:-170} GATEWAY_S=${GATEWAY_S:-185}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
start=$(date +%s)
smoke=()
if [ "$SMOKE" = 1 ]; then
    smoke=(--smoke)
    STREAMS=1,2 LEVELS=1,2
fi
left() { echo $((TOTAL_S - ($(date +%s) - start))); }

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null \
        || echo "no nvidia-smi"
    python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
    nproc
    echo "anchor: $(cat "$ANCHOR/REF" 2>/dev/null || echo none)"
} >"$OUT/gpu.txt" 2>&1

if [ "$SMOKE" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then  # a smoke run uses this machine's own
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl >>"$OUT/gpu.log" 2>&1 \
        && export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}" \
        || echo "== the wheels in .whl/ did not install: the gateway parts will fail" | tee -a "$OUT/gpu.log"
fi

# part NAME SECONDS COMMAND...: run COMMAND under `timeout SECONDS` (cut to what is left), its
# output appended to gpu.log and its last lines shown; skipped unless NAME is in PARTS. An
# argument @BUDGET@ becomes the part's own budget: 15 s inside its timeout, so it ends cleanly.
part() {
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    local room arg
    room=$(left)
    if [ "$limit" -gt "$room" ]; then limit=$room; fi
    if [ "$limit" -lt 30 ]; then
        echo "== $name skipped: $room s left" | tee -a "$OUT/gpu.log"
        return 0
    fi
    local command=()
    for arg in "$@"; do
        if [ "$arg" = @BUDGET@ ]; then command+=("$((limit - 15))"); else command+=("$arg"); fi
    done
    echo "== $name (at most $limit s)" | tee -a "$OUT/gpu.log"
    timeout -k 10 "$limit" "${command[@]}" >"$WORK/part.log" 2>&1
    echo "   exit $? after $(($(date +%s) - start)) s"
    cat "$WORK/part.log" >>"$OUT/gpu.log"
    tail -n 25 "$WORK/part.log"
}

MODEL="$WORK/cosyvoice3-random"
REFERENCE="$WORK/reference.wav"

if [ -f bench/gpu_flow_cache.py ]; then
    # shellcheck disable=SC2086
    part flow "$FLOW_S" python3 -m bench.gpu_flow_cache --json "$OUT/flow.json" --budget-s @BUDGET@ \
        $FLOW_CACHE_ARGS "${smoke[@]}"
else
    part flow "$FLOW_S" python3 -m bench.gpu_flow_estimator --json "$OUT/flow.json" --budget-s @BUDGET@ \
        "${smoke[@]}"
fi
part lm "$LM_S" python3 -m bench.gpu_cosyvoice_lm --json "$OUT/lm.json" --batches 1,8,64,256 \
    --modes cuda_graphs "${smoke[@]}"
# shellcheck disable=SC2086
part pipeline "$PIPELINE_S" python3 -m bench.gpu_cosyvoice_pipeline --label "this build" \
    --streams "$STREAMS" --workdir "$WORK" --model-dir "$MODEL" --json "$OUT/pipeline.json" \
    --budget-s @BUDGET@ $PIPELINE_ARGS "${smoke[@]}"
# shellcheck disable=SC2086
part gateway "$GATEWAY_S" python3 -m bench.gpu_gateway_load --label "this build" \
    --levels "$LEVELS" --model-dir "$MODEL" --reference "$REFERENCE" --workdir "$WORK/gateway" \
    --server-log "$OUT/gateway_server.log" --json "$OUT/gateway.json" --budget-s @BUDGET@ \
    $GATEWAY_ARGS "${smoke[@]}"
if [ -d "$ANCHOR/engine" ]; then
    anchor=$(cd "$ANCHOR" && pwd)
    # the build before's engine first on the path, this build's bench script driving it
    # shellcheck disable=SC2086
    part pipeline_before "$(left)" env PYTHONPATH="$anchor${PYTHONPATH:+:$PYTHONPATH}" \
        python3 "$REPO/bench/gpu_cosyvoice_pipeline.py" --label "build before" --streams "$STREAMS" \
        --workdir "$WORK" --model-dir "$MODEL" --json "$OUT/pipeline_before.json" --budget-s @BUDGET@ \
        $ANCHOR_PIPELINE_ARGS "${smoke[@]}"
    # shellcheck disable=SC2086
    part gateway_before "$(left)" python3 -m bench.gpu_gateway_load --label "build before" \
        --root "$anchor" --levels "$LEVELS" --model-dir "$MODEL" --reference "$REFERENCE" \
        --workdir "$WORK/gateway_before" --json "$OUT/gateway_before.json" --budget-s @BUDGET@ \
        $ANCHOR_GATEWAY_ARGS "${smoke[@]}"
else
    echo "== no build before in $ANCHOR/ (bash bench/gpu_prepare.sh makes it)" | tee -a "$OUT/gpu.log"
fi
# shellcheck disable=SC2086
part profile "${PROFILE_S:-200}" python3 -m bench.gpu_flow_profile --json "$OUT/profile.json" \
    --budget-s @BUDGET@ ${PROFILE_ARGS:-} "${smoke[@]}"
rm -f "$WORK/part.log"
echo "== done in $(($(date +%s) - start)) s"
