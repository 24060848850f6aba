"""The product's torch-free contract, imported by the gateway, the worker, the audit and the
benchmarks alike: the shared constants (`constants`), the record and its choices (`record`),
and the one meaning of "bitwise equal" with the comparison of two answers (`compare`)."""
