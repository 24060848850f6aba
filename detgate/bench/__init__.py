"""The benchmarks behind `detgate bench engine|model|kernels` (`cli.py` registers them), the
in-process engine experiment (`python -m detgate.bench.engine_gpu`) with its GPU self-check,
and the kernels' GPU session (`python -m detgate.bench.kernels_proof`). Results go to
bench/results/; `detgate bench gateway` lives with the gateway."""
