#!/usr/bin/env bash
# Run a command as a slower or shared machine would (`make test-slow`).
#   .ci/under-load.sh [--cpus X] N COMMAND...
#     N        busy loops (one core's worth of work each) beside COMMAND: a noisy neighbour
#     --cpus X COMMAND, its children and the loops get X CPUs' worth of time in all (a CPU
#              cgroup's quota; needs root): --cpus 1.33 on 2 cores is a machine 1.5x slower
# The loops are ended by pid and the cgroup removed when COMMAND exits; its exit code is
# returned.
set -uo pipefail
cpus=""
if [ "${1:-}" = --cpus ]; then
    cpus=${2:-}
    shift 2
fi
loops=${1:-}
shift
if ! [[ "$loops" =~ ^[0-9]+$ ]] || [ $# -eq 0 ]; then
    echo "usage: under-load.sh [--cpus X] N COMMAND... (N: the number of busy loops, got '$loops')" >&2
    exit 2
fi

cgroup=""
cgroup_root=""
if [ -n "$cpus" ]; then
    if ! [[ "$cpus" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
        echo "under-load.sh: --cpus takes a number of CPUs such as 1.33, got '$cpus'" >&2
        exit 2
    fi
    quota=$(awk -v c="$cpus" 'BEGIN { printf "%d", c * 100000 }')
    if [ "$quota" -lt 1000 ]; then
        echo "under-load.sh: --cpus $cpus is too little to run anything (at least 0.01)" >&2
        exit 2
    fi
    if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then  # cgroup v1
        cgroup_root=/sys/fs/cgroup/cpu
        cgroup=$cgroup_root/swarmtrain-slow-$$
        mkdir "$cgroup" && echo 100000 >"$cgroup/cpu.cfs_period_us" && echo "$quota" >"$cgroup/cpu.cfs_quota_us"
    elif [ -w /sys/fs/cgroup/cgroup.subtree_control ] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then  # v2
        cgroup_root=/sys/fs/cgroup
        echo +cpu >"$cgroup_root/cgroup.subtree_control" 2>/dev/null
        cgroup=$cgroup_root/swarmtrain-slow-$$
        mkdir "$cgroup" && echo "$quota 100000" >"$cgroup/cpu.max"
    else
        echo "under-load.sh: --cpus needs root and a writable CPU cgroup controller (run as root, or leave --cpus out)" >&2
        exit 2
    fi || { echo "under-load.sh: could not set up the CPU cgroup $cgroup" >&2; exit 2; }
    echo $$ >"$cgroup/cgroup.procs"  # this shell, and so everything it starts from now on
fi

pids=()
finish() {
    [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
    if [ -n "$cgroup" ]; then
        echo $$ >"$cgroup_root/cgroup.procs"
        rmdir "$cgroup" 2>/dev/null || echo "under-load.sh: $cgroup still holds processes; not removed" >&2
    fi
}
trap finish EXIT
for _ in $(seq 1 "$loops"); do
    bash -c 'while :; do :; done' &  # a shell's own arithmetic loop: no child processes
    pids+=($!)
done
what="$loops busy loop(s)${cpus:+, $cpus CPUs in all}"
echo "under-load.sh: $what beside '$*'"
start=$(date +%s)
"$@"
code=$?
echo "under-load.sh: '$*' exited $code after $(($(date +%s) - start)) s with $what"
exit $code
