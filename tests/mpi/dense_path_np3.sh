#!/bin/bash
# Engine ranks run the product path rank 0 was asked for: `train --path dense` on 3 ranks
# (2 engines) must give the losses of 2 local engines on the dense path, which differ in
# their last bits from the sparse path's (else this test could not tell the paths apart).
# Usage: dense_path_np3.sh MPIEXEC "FLAGS" SLUICE
set -u
mpiexec=$1
flags=$2
sluice=$3
args=(train --dataset synthetic --layers 64,48,10 --epochs 1 --threads 1 --json)
losses() { grep -oE '"(test_loss|final_loss)": [^,}]*' | tr '\n' ' '; }
local_dense=$("$sluice" "${args[@]}" --engines 2 --path dense | losses)
local_sparse=$("$sluice" "${args[@]}" --engines 2 --path sparse | losses)
# shellcheck disable=SC2086
mpi_dense=$("$mpiexec" -np 3 $flags "$sluice" "${args[@]}" --fabric mpi --path dense | losses)
echo "local dense:  $local_dense"
echo "local sparse: $local_sparse"
echo "mpi dense:    $mpi_dense"
if [ -z "$local_dense" ] || [ "$local_dense" = "$local_sparse" ]; then
  echo "FAIL: the local paths do not differ, so the test cannot tell them apart"
  exit 1
fi
if [ "$mpi_dense" != "$local_dense" ]; then
  echo "FAIL: the MPI run's losses are not those of the dense path"
  exit 1
fi
echo "PASS"
