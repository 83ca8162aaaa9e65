"""Data parallelism: every rank holds the whole model; gradients are all-reduced in buckets
(:mod:`.strategy`), and the replicated state is saved once (:mod:`.checkpoint`)."""
