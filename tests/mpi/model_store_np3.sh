#!/bin/bash
# A model store on rank 0 trains as the model in RAM does: 2 epochs with Adam over MPI
# (2 engine ranks) into a store whose cache is below the model (what the trainer's streams
# leave of a 300 kB budget, for a 116 kB store: layers come and go from files), and the
# same store trained 1 epoch then resumed for 1 more (--epochs counts this run's), each
# give the losses of 2 local engines with the model in RAM. Below the model, the store's
# backward streams by output (it would read the transposed patterns from its files every
# step): the run in RAM is told to do the same.
# Usage: model_store_np3.sh MPIEXEC "FLAGS" SLUICE
set -u
mpiexec=$1
flags=$2
sluice=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
args=(train --dataset synthetic --layers 64,128,128,128,10 --threads 1 --optimizer adam --json)
store=(--fabric mpi --model-memory-budget 300000)
losses() { grep -oE '"(test_loss|final_loss)": [^,}]*' | tr '\n' ' '; }
in_ram=$("$sluice" "${args[@]}" --epochs 2 --engines 2 --backward-order by_output | losses)
# shellcheck disable=SC2086
whole=$("$mpiexec" -np 3 $flags "$sluice" "${args[@]}" --epochs 2 "${store[@]}" \
  --model-store "$dir/whole" | losses)
# shellcheck disable=SC2086
"$mpiexec" -np 3 $flags "$sluice" "${args[@]}" --epochs 1 "${store[@]}" \
  --model-store "$dir/resumed" >/dev/null || exit 1
# shellcheck disable=SC2086
resumed=$("$mpiexec" -np 3 $flags "$sluice" "${args[@]}" --epochs 1 "${store[@]}" \
  --model-store "$dir/resumed" | losses)
echo "in RAM, local:        $in_ram"
echo "store over MPI:       $whole"
echo "store, 1 + 1 resumed: $resumed"
if [ -z "$in_ram" ] || [ "$whole" != "$in_ram" ] || [ "$resumed" != "$in_ram" ]; then
  echo "FAIL: the store over MPI did not train as the model in RAM"
  exit 1
fi
echo "PASS"
