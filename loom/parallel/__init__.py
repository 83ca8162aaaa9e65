"""Parallel strategies, a folder per dimension (:mod:`loom.parallel.base`: the protocol they share).

The dimensions (data, zero, tensor, context, expert, pipeline, ps, allreduce) import none of each
other; what several need sits at the top and imports no dimension: placement (what a local tensor
is a piece of), layout (flat sharded buffers), partial (gradients summed once a step), sequence
(gathering and scattering the sequence dim), rng (per-rank dropout streams), state (gathering a
single-device state dict), reducer and bucket (the gradient reduction), materialize. Both rules
are contracts of ``.importlinter``. They are composed in one place, :mod:`loom.train.build`.
"""
