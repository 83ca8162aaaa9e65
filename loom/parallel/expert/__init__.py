"""Expert parallelism: experts spread over the ep ranks, tokens exchanged by all-to-all
(:mod:`.parallelize`)."""
