"""Every benchmark of detgate: the ones behind `detgate bench engine|model|kernels|gateway`
(`cli.py` registers them), the in-process engine experiment (`python -m
detgate.bench.engine_gpu`) with its GPU self-check, and the kernels' GPU session (`python -m
detgate.bench.kernels_proof`). Results go to bench/results/."""
