"""The benchmarks behind `detgate bench engine|model|gateway`, the in-process engine
experiment (`python -m detgate.bench.engine_gpu`) and its GPU self-check. Results go to
bench/results/; `detgate bench kernels` lives with its package."""
