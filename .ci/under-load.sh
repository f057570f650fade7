#!/usr/bin/env bash
# Run a command with busy loops beside it: the suite as a slower machine, or a noisy
# neighbour, would run it (`make test-slow`).
#   .ci/under-load.sh N COMMAND...   N busy loops (one core each), then COMMAND; the loops are
#                                    ended by pid when COMMAND exits, and its exit code returned
set -uo pipefail
loops=$1
shift
if ! [[ "$loops" =~ ^[0-9]+$ ]]; then
    echo "under-load.sh: the first argument is the number of busy loops, got '$loops'" >&2
    exit 2
fi
pids=()
stop_loops() {
    [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
}
trap stop_loops EXIT
for _ in $(seq 1 "$loops"); do
    # a shell's own arithmetic loop: no child processes, one core's worth of work
    bash -c 'while :; do :; done' &
    pids+=($!)
done
echo "under-load.sh: $loops busy loop(s) beside '$*' (pids ${pids[*]})"
start=$(date +%s)
"$@"
code=$?
echo "under-load.sh: '$*' exited $code after $(( $(date +%s) - start )) s with $loops busy loop(s) beside it"
exit $code
