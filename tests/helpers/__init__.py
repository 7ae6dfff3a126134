"""Test helpers, not runtime code: transformers' own forward as a reference target (reference) and
random kernel inputs (kernel_inputs), shared by the tests and the benchmarks (``tests.helpers.*``); a
benchmark script loaded as a module (benchmarks)."""
