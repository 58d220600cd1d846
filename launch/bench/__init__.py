"""Benchmark suites of `megapar bench`; one module per suite, each with `run(ctx)`."""
