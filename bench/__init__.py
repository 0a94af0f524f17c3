"""Benchmarks: Kiln against ONNX Runtime (and numpy, the FMA peak) measured in one run.

numpy's OpenBLAS keeps a pool of worker threads that spin after every BLAS call the harness
makes (building a case's weights, a reference product): on a 2-core machine they took 14% of
the samples of a kernel measured after them. Neither engine under test uses them: one thread.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
