#!/bin/bash
# `sluice train --model gpt --fabric mpi` on 3 ranks (2 engines) reports the losses of 2
# local engines to the last digit, and resumes its own checkpoint over MPI as locally,
# with the projections streamed in fp32 and in bf16.
# The text is the repository's README (no download needed).
# Usage: gpt_np3.sh MPIEXEC "FLAGS" SLUICE TEXT
set -u
mpiexec=$1
flags=$2
sluice=$3
text=$4
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# Both precisions of the projections' streams.
for precision in fp32 bf16; do
run=(train --model gpt --text "$text" --batch 5 --steps 3 --threads 1 --json --precision "$precision")
args=("${run[@]}" --context 16 --d-model 32 --heads 2 --blocks 2 --sparsity 0.5)
losses() { grep -oE '"(val_loss|train_loss|steps_total|engines|precision)": [^,}]*' | tr '\n' ' '; }
local2=$("$sluice" "${args[@]}" --engines 2 --checkpoint "$scratch/local.ckpt" | losses)
# shellcheck disable=SC2086
mpi2=$("$mpiexec" -np 3 $flags "$sluice" "${args[@]}" --fabric mpi \
  --checkpoint "$scratch/mpi.ckpt" | losses)
local_resumed=$("$sluice" "${run[@]}" --engines 2 --resume "$scratch/local.ckpt" | losses)
# shellcheck disable=SC2086
mpi_resumed=$("$mpiexec" -np 3 $flags "$sluice" "${run[@]}" --fabric mpi \
  --resume "$scratch/mpi.ckpt" | losses)
echo "local:         $local2"
echo "mpi:           $mpi2"
echo "local resumed: $local_resumed"
echo "mpi resumed:   $mpi_resumed"
if [ -z "$local2" ] || [ -z "$local_resumed" ]; then
  echo "FAIL: a local run reported nothing"
  exit 1
fi
if [ "$mpi2" != "$local2" ] || [ "$mpi_resumed" != "$local_resumed" ]; then
  echo "FAIL: the MPI runs do not report the local runs' losses"
  exit 1
fi
case "$mpi2" in *'"engines": 2'*) ;; *) echo "FAIL: not 2 engines"; exit 1 ;; esac
case "$mpi2" in *"\"precision\": \"$precision\""*) ;; *) echo "FAIL: not $precision"; exit 1 ;; esac
done
echo "PASS"
