"""Side-by-side benchmarks of elastic_ddp against plain PyTorch; run with ``python benchmarks/run.py``."""
