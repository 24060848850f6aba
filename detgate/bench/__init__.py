"""The engine and model benchmarks behind `detgate bench engine|model`, the in-process engine
experiment (`python -m detgate.bench.engine_gpu`) and its GPU self-check. Results go to
bench/results/; `detgate bench gateway|kernels` live with their packages."""
