// bench_torch: sluice's layer inside libtorch against torch's own Linear (dense fp32 and
// bf16) and torch's sparse CSR matmul, forward and forward+backward, in the same run:
// every method runs once per round, rounds alternate methods, the median of the rounds
// is reported. Also sluice's own product (spmm) without torch, for the binding's cost.
//   bench_torch [--json] [--out N] [--in N] [--tokens N] [--sparsity a,b,...] [--rounds N]
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "sluice/kernels.hpp"
#include "sluice/topology.hpp"
#include "sluice/torch/sparse_linear.hpp"

namespace {

using torch::Tensor;

struct Args {
  bool json = false;
  std::int64_t out = 4096, in = 4096, tokens = 256;
  std::vector<double> sparsities{0.9, 0.95, 0.99};
  int rounds = 7;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_torch: %s\nusage: bench_torch [--json] [--out N] [--in N] [--tokens N] "
               "[--sparsity a,b,...] [--rounds N]\n",
               why.c_str());
  std::exit(2);
}

std::int64_t positive(const std::string& flag, const char* text) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v <= 0)
    usage(flag + " wants a positive integer, got '" + text + "'");
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--json") {
      a.json = true;
      continue;
    }
    if (i + 1 >= argc) usage("unknown flag or missing value: " + flag);
    const char* v = argv[++i];
    if (flag == "--out")
      a.out = positive(flag, v);
    else if (flag == "--in")
      a.in = positive(flag, v);
    else if (flag == "--tokens")
      a.tokens = positive(flag, v);
    else if (flag == "--rounds")
      a.rounds = static_cast<int>(positive(flag, v));
    else if (flag == "--sparsity") {
      a.sparsities.clear();
      std::stringstream list(v);
      for (std::string item; std::getline(list, item, ',');) {
        char* end = nullptr;
        const double s = std::strtod(item.c_str(), &end);
        if (end == item.c_str() || *end != '\0' || !(s >= 0 && s < 1)) {
          usage("--sparsity wants numbers in [0, 1), got '" + item + "'");
        }
        a.sparsities.push_back(s);
      }
      if (a.sparsities.empty()) usage("--sparsity wants at least one number");
    } else {
      usage("unknown flag " + flag);
    }
  }
  return a;
}

double seconds_of(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

constexpr double kSlowMs = 2000;

/// Every method's median time in ms, the methods alternated round by round.
std::map<std::string, double> measure(const Args& a, double sparsity) {
  torch::manual_seed(1);
  const sluice::CsrMatrix w = sluice::CsrMatrix::random(a.out, a.in, sparsity, 7);
  const sluice::DenseMatrix wd = w.to_dense();
  const Tensor weight =
      torch::from_blob(const_cast<float*>(wd.data()), {a.out, a.in}, {wd.stride(), 1}).clone();
  const Tensor mask = (weight != 0).to(torch::kFloat);
  const Tensor bias = torch::randn({a.out}) * 0.01;

  sluice::torch::SparseLinear layer(weight, mask, bias,
                                    sluice::torch::SparseLinearOptions(a.in, a.out));
  torch::nn::Linear dense(a.in, a.out);
  torch::nn::Linear dense_bf16(a.in, a.out);
  {
    torch::NoGradGuard no_grad;
    dense->weight.copy_(weight);
    dense->bias.copy_(bias);
    dense_bf16->to(torch::kBFloat16);
    dense_bf16->weight.copy_(weight);
    dense_bf16->bias.copy_(bias);
  }
  const Tensor w_csr = weight.to_sparse_csr();
  const Tensor w_mkldnn = weight.to_mkldnn();
  const Tensor x = torch::randn({a.tokens, a.in});  // token-major, as torch holds it
  const Tensor x_bf16 = x.to(torch::kBFloat16);
  const Tensor x_fm = x.t().contiguous().t();  // the same values held feature-major
  const Tensor dy = torch::randn({a.tokens, a.out});
  sluice::DenseMatrix xs(a.in, a.tokens), ys(a.out, a.tokens);
  const Tensor x_t = x.t().contiguous();
  for (std::int64_t i = 0; i < a.in; ++i) {
    std::copy_n(x_t.data_ptr<float>() + i * a.tokens, a.tokens, xs.row(i));
  }

  auto no_grad = [](auto fn) {
    return [fn] {
      torch::NoGradGuard guard;
      fn();
    };
  };
  auto fwdbwd = [&](auto forward) {
    return [&, forward] {
      Tensor xg = x.detach().requires_grad_(true);
      forward(xg).backward(dy);
    };
  };
  const std::vector<std::pair<std::string, std::function<void()>>> methods = {
      {"sluice_fwd", no_grad([&] { layer(x); })},
      {"sluice_fwd_feature_major", no_grad([&] { layer(x_fm); })},
      {"spmm_fwd", [&] { sluice::spmm(w, xs.view(), ys.view()); }},
      {"sluice_fwdbwd", fwdbwd([&](const Tensor& xg) { return layer(xg); })},
      {"torch_dense_fwd", no_grad([&] { dense(x); })},
      {"torch_dense_fwdbwd", fwdbwd([&](const Tensor& xg) { return dense(xg); })},
      {"torch_dense_bf16_fwd", no_grad([&] { dense_bf16(x_bf16); })},
      // torch's oneDNN fp32 path (its Linear takes the BLAS path): inputs converted per call.
      {"torch_dense_mkldnn_fwd",
       no_grad([&] { torch::mkldnn_linear(x.to_mkldnn(), w_mkldnn, bias).to_dense(); })},
      {"torch_sparse_fwd", no_grad([&] { torch::mm(w_csr, x.t()).t(); })},
      {"torch_sparse_fwdbwd", fwdbwd([&](const Tensor& xg) {
         Tensor wg = w_csr.detach().requires_grad_(true);
         return torch::mm(wg, xg.t()).t();
       })},
  };
  // Round -1 warms up. A method whose first call takes seconds (torch's fp32 Linear on
  // Debian's reference BLAS) keeps that call as its one sample: rounds of it would take
  // the run hours.
  std::map<std::string, std::vector<double>> times;
  for (int r = -1; r < a.rounds; ++r) {
    for (const auto& [name, fn] : methods) {
      if (r >= 0 && times[name].size() == 1 && times[name][0] > kSlowMs) continue;
      const double ms = seconds_of(fn) * 1e3;
      if (r >= 0 || ms > kSlowMs) times[name].push_back(ms);
    }
  }
  std::map<std::string, double> ms;
  for (const auto& [name, v] : times) ms[name] = median(v);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  // torch's intra-op threads follow OMP_NUM_THREADS (1 in some shells) or the physical
  // cores: give torch, and so sluice's default engine, every CPU of the process.
  torch::set_num_threads(sluice::process_cpus());
  nlohmann::ordered_json j;
  j["out"] = a.out;
  j["in"] = a.in;
  j["tokens"] = a.tokens;
  j["rounds"] = a.rounds;
  j["torch_threads"] = torch::get_num_threads();
  j["sluice_threads"] = sluice::torch::default_engine()->threads();
  j["points"] = nlohmann::ordered_json::array();
  if (!a.json) {
    std::printf("%dx%d, %d tokens, median of %d alternated rounds (ms)\n", int(a.out), int(a.in),
                int(a.tokens), a.rounds);
  }
  for (double s : a.sparsities) {
    const auto ms = measure(a, s);
    nlohmann::ordered_json point;
    point["sparsity"] = s;
    for (const auto& [name, v] : ms) point[name + "_ms"] = v;
    // The targets' ratios: the binding's cost, and fwd+bwd against torch's dense and CSR.
    point["binding_cost"] = ms.at("sluice_fwd") / ms.at("spmm_fwd");
    point["fwdbwd_speedup_vs_dense"] = ms.at("torch_dense_fwdbwd") / ms.at("sluice_fwdbwd");
    point["fwdbwd_speedup_vs_sparse"] = ms.at("torch_sparse_fwdbwd") / ms.at("sluice_fwdbwd");
    j["points"].push_back(point);
    if (!a.json) {
      std::printf("sparsity %.2f:", s);
      for (const auto& [name, v] : ms) std::printf(" %s %.2f", name.c_str(), v);
      std::printf("\n");
    }
  }
  if (a.json) std::printf("%s\n", j.dump(2).c_str());
  return 0;
}
