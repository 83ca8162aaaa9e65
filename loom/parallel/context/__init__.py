"""Context-parallel attention cores, one module per ``parallel.cp_mode``.

- :mod:`.blocks`: one attention block with its log-sum-exp, its backward, and the merge rule;
  which (query chunk, key chunk) blocks the load-balanced layout computes, and how.
- :mod:`.allgather`: K and V all-gathered, attention of the local queries over the whole sequence.
- :mod:`.ring`: K and V blocks circulate over the cp ranks (O(T/cp) memory per rank).
- :mod:`.alltoall`: sequence-sharded q, k, v exchanged for head-sharded ones (Ulysses).

The layout, the module swap and the volume formulas are in :mod:`loom.parallel.context.parallelize`.
"""
