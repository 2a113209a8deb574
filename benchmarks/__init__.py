"""Side-by-side measurements; each writes benchmarks/results/<name>.json."""
