"""Parallel strategies, one module per dimension (:mod:`loom.parallel.base`: the protocol they share).

They are composed in one place, :mod:`loom.train.build`.
"""
