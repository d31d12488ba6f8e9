#!/bin/bash
# A stalled MPI peer must not hang the job: runs `sluice train --fabric mpi` on 3 ranks
# with a short --peer-timeout, stops engine rank 2 with SIGSTOP once training runs, and
# expects the whole job to end with exit code 1 and a message naming rank 2, within the
# timeout and a grace period (not the test's own time limit).
# Usage: peer_timeout.sh MPIEXEC "FLAGS" SLUICE
set -u
mpiexec=$1
flags=$2
sluice=$3
timeout=3
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# shellcheck disable=SC2086
"$mpiexec" -np 3 $flags "$sluice" train --fabric mpi --dataset synthetic --layers 64,256,10 \
  --epochs 100000 --threads 1 --peer-timeout $timeout >"$out" 2>&1 &
job=$!
# Rank 2's process: a descendant of mpirun whose environment says so.
victim=""
for _ in $(seq 1 300); do
  for pid in $(pgrep -f "$sluice train --fabric mpi" || true); do
    if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=2'; then
      victim=$pid
    fi
  done
  [ -n "$victim" ] && grep -q "epoch" "$out" && break
  kill -0 $job 2>/dev/null || break
  sleep 0.1
done
if [ -z "$victim" ]; then
  echo "rank 2 never started:"; cat "$out"; kill $job 2>/dev/null; exit 1
fi
sleep 1
kill -STOP "$victim"
stopped=$(date +%s.%N)
# The job must end by itself: timeout, the roll call's grace, and MPI's teardown.
limit=$((timeout + 30))
for _ in $(seq 1 $((limit * 10))); do
  kill -0 $job 2>/dev/null || break
  sleep 0.1
done
if kill -0 $job 2>/dev/null; then
  echo "the job still runs $limit s after rank 2 stopped"
  kill -CONT "$victim"; kill $job; cat "$out"; exit 1
fi
wait $job
rc=$?
took=$(awk -v a="$(date +%s.%N)" -v b="$stopped" 'BEGIN { printf "%.1f", a - b }')
cat "$out"
echo "exit code $rc, $took s after rank 2 stopped"
if [ $rc -ne 1 ]; then echo "expected exit code 1"; exit 1; fi
if ! grep -q "peer timeout: rank 2 (engine 1) has not answered" "$out"; then
  echo "no message naming rank 2"; exit 1
fi
