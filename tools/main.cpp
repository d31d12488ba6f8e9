// sluice: sweeps, training and wafer-scale prediction from the command line.
#include "cli.hpp"

int main(int argc, char** argv) {
  return sluice::cli::run_cli(argc, argv);
}
