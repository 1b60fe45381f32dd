"""Measured results and the benchmarks that write them: `benchmarks/<name>.py` writes
`benchmarks/<name>.{md,json}` beside it; run one as `python -m benchmarks.<name>` from the checkout's
root (`--help` for its options). What they share is in `benchmarks.common`; the GPU acceptance run is
`benchmarks.gpu`. README.md here lists every result with its command.
"""
