"""The GPU acceptance run (`python -m benchmarks.gpu.gpu_acceptance`, on a lent GPU machine through
`bash benchmarks/gpu/gpu_acceptance.sh PARTS`) and the JSON it wrote beside this file; README.md here is
drawn from them.
"""
