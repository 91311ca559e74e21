"""The ops of `barqtrain bench ops`, each a table of shapes, byte counts and implementations.

base.py   OpBenchmark and OpCase: what the timing loop needs of any op
norms.py  RMSNorm
"""

from barqtrain.bench.op_cases.base import OpBenchmark
from barqtrain.bench.op_cases.norms import RMS_NORM

OP_BENCHMARKS: dict[str, OpBenchmark] = {benchmark.op: benchmark for benchmark in (RMS_NORM,)}
