"""How the merge math cuts a tensor into chunks: sizes that fix the rounding of its reductions and the layout of
its slabs, read by the method declarations and by the math (torch-free, so the declarations stay light)."""

CHUNK = 1 << 20  # elements per chunk of the reductions (SLERP's angle, Gram matrices); it fixes their rounding
# Elements per chunk of the elementwise passes, exact at any size: a TIES or DARE chunk's float32 temporaries (several
# per model) then stay in the caches (benchmarks/RESULTS.md, chunk_math.py --elementwise-chunk 18 against 20)
ELEMENTWISE_CHUNK = 1 << 18
