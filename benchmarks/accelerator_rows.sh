#!/usr/bin/env bash
# Our rows of docs/benchmarks.md's accelerator section, on whatever JAX device the machine has
# (the same worker as benchmarks/honest.py; no peer needed):
#
#     bash benchmarks/accelerator_rows.sh OUTDIR [WORKDIR]
#
# ROWS="w1 w2 ..." picks rows (default: all, in the order below, most important first). Each row
# runs benchmarks/ours_worker.py in its own process under its own time limit; OUTDIR/results.tsv
# gets "label<TAB>{RESULT json}" per finished row, OUTDIR/log.txt every row's output (both are
# rewritten), and a table is printed last. Workload directories (random weights,
# benchmarks/hfdir.py) go to WORKDIR. Row w1-cached reads the persistent compilation cache that
# row w1 filled in the same run (CACHE=DIR names another one). The exit status is 1 when a row
# failed or ran out of time.
set -u
[ $# -ge 1 ] || { echo "usage: accelerator_rows.sh OUTDIR [WORKDIR]" >&2; exit 2; }
mkdir -p "$1" "${2:-/tmp/artifex-bench-accel}" || exit 2
out=$(cd "$1" && pwd)
work=$(cd "${2:-/tmp/artifex-bench-accel}" && pwd)
rows=${ROWS:-"w1 w2 w2-bf16 q05-bf16 w1-cached w2-remat2"}
py=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cache=${CACHE:-$(mktemp -d)}
: >"$out/log.txt"
: >"$out/results.tsv"
failed=()
cd "$root" || exit 2

$py - <<'EOF' 2>&1 | tee -a "$out/log.txt"
import time

import jax
import jax.numpy as jnp

print("jax", jax.__version__, jax.devices())
big = jax.default_backend() != "cpu"
for dtype, n in ((jnp.float32, 4096 if big else 1024), (jnp.bfloat16, 8192 if big else 1024)):
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    reps = 20 if big else 2
    t = time.perf_counter()
    for _ in range(reps):
        c = f(a, b)
    c.block_until_ready()
    s = (time.perf_counter() - t) / reps
    print(f"matmul {jnp.dtype(dtype).name} {n}^3: {2 * n**3 / s / 1e12:.1f} TFLOP/s")
EOF

row() { # row LABEL SECONDS WORKLOAD WORKER_ARGS...
    local label=$1 secs=$2 wl=$3 dir log rc
    shift 3
    if ! dir=$($py -c 'import sys; from benchmarks import hfdir; print(hfdir.ensure_dir(*sys.argv[1:]))' \
        "$wl" "$work" 2>>"$out/log.txt"); then
        echo "== $label: writing the $wl workload failed" | tee -a "$out/log.txt"
        failed+=("$label")
        return
    fi
    log=$(mktemp)
    echo "== $label: ours_worker.py --dir $dir $*" | tee -a "$out/log.txt"
    timeout -k 30 "$secs" $py benchmarks/ours_worker.py --dir "$dir" "$@" >"$log" 2>&1
    rc=$?
    cat "$log" >>"$out/log.txt"
    echo "== $label: exit $rc" | tee -a "$out/log.txt"
    if [ "$rc" -eq 0 ] && grep -q '^RESULT ' "$log"; then
        grep '^RESULT ' "$log" | tail -1 | sed "s/^RESULT /$label\t/" >>"$out/results.tsv"
    else
        failed+=("$label")
    fi
    rm -f "$log"
}

for r in $rows; do
    case $r in
    w1) row w1 150 w1 --windows 5 --max-retries 2 --compilation-cache "$cache" ;;
    w2) row w2 200 w2 --windows 5 --max-retries 2 ;;
    w2-bf16) row w2-bf16 200 w2 --windows 5 --max-retries 2 --dtype bfloat16 ;;
    q05-bf16) row q05-bf16 300 q05 --windows 2 --max-retries 1 --dtype bfloat16 --remat ;;
    w1-cached) row w1-cached 100 w1 --windows 1 --max-retries 1 --compilation-cache "$cache" ;;
    w2-remat2) row w2-remat2 200 w2 --windows 3 --max-retries 1 --remat --remat-every 2 ;;
    *)
        echo "unknown row $r (rows: w1 w2 w2-bf16 q05-bf16 w1-cached w2-remat2)" >&2
        failed+=("$r")
        ;;
    esac
done

$py - "$out/results.tsv" <<'EOF'
import json
import sys


def ms(x):
    return f"{1e3 * x:.0f}" if isinstance(x, (int, float)) else "?"


def gb(x):
    return f"{x / 1e9:.2f}" if isinstance(x, (int, float)) else "-"


print(
    "| row | device | whole step ms, median (min-max) | generation ms | training ms "
    "| first step s | device peak GB | host RSS GB | clean windows |"
)
print("|---|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]):
    label, rec = line.rstrip("\n").split("\t", 1)
    try:
        r = json.loads(rec)
        s, g, t = r["seconds"], r["generation_s"], r["training_s"]
        first = r.get("first_step_s")
        print(
            f"| {label} | {r.get('device', '?')} | {ms(s['median'])} ({ms(s['min'])}-"
            f"{ms(s['max'])}) | {ms(g['median'])} | {ms(t['median'])} "
            f"| {first if first is None else round(first, 1)} "
            f"| {gb(r.get('device_peak_bytes'))} | {gb(r.get('peak_rss_bytes'))} "
            f"| {r.get('clean_windows', '?')}/{r.get('windows', '?')} |"
        )
    except (KeyError, TypeError, ValueError) as err:
        print(f"| {label} | unreadable record: {err!r} |")
EOF
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed or timed out: ${failed[*]} (see $out/log.txt)" >&2
    exit 1
fi
