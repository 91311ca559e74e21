"""The ops of `barqtrain bench ops`, each a table of shapes, byte counts and implementations.

base.py   OpBenchmark and OpCase: what the timing loop needs of any op
norms.py  RMSNorm, residual-add + RMSNorm, LayerNorm
glu.py    SwiGLU, GeGLU
rope.py   RoPE of q and k
"""

from barqtrain_bench.op_cases.base import OpBenchmark
from barqtrain_bench.op_cases.glu import GEGLU, SWIGLU
from barqtrain_bench.op_cases.norms import ADD_RMS_NORM, LAYER_NORM, RMS_NORM
from barqtrain_bench.op_cases.rope import ROPE

OP_BENCHMARKS: dict[str, OpBenchmark] = {
    benchmark.op: benchmark for benchmark in (RMS_NORM, ADD_RMS_NORM, SWIGLU, GEGLU, ROPE, LAYER_NORM)
}
