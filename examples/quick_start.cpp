// The README's example, kept compiling: the products alone, then one training step.
#include <sluice/executor.hpp>
#include <sluice/kernels.hpp>

int main() {
  using namespace sluice;
  // The products alone: W (out x in, CSR) times X (in x tokens, row-major).
  const CsrMatrix w = CsrMatrix::random(4096, 4096, /*sparsity=*/0.9, /*seed=*/1);
  DenseMatrix x(4096, 256);
  DenseMatrix y = spmm(w, x);              // Y = W X
  DenseMatrix dx = spmm_t(w, y);           // dX = W^T dY
  std::vector<float> dw = sddmm(w, y, x);  // dW at the mask's positions

  // Training: weights live in ModelMemory, engines behind a fabric.
  HostModelMemory memory;
  build_sparse_mlp(memory, {64, 512, 512, 10}, /*sparsity=*/0.9, /*seed=*/1);
  memory.set_optimizer({.kind = OptimizerKind::adam, .learning_rate = 2e-3});
  LocalFabric fabric({.engines = 2});
  // Per layer: bf16 streams half the bytes; sums, gradients and master weights stay fp32.
  LayerStreamingExecutor executor(
      memory, fabric, {.precisions = {Precision::bf16, Precision::bf16, Precision::fp32}});
  DenseMatrix batch(64, 32);
  const StepResult step = executor.train_step({batch.view(), std::vector<int>(32, 0), {}});
  memory.save("model.ckpt");  // crash-safe: temp file, fsync, rename
}
