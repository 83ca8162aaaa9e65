"""Tensor + sequence parallelism (Megatron): column- and row-parallel layers (:mod:`.layers`), their
collectives as autograd functions (:mod:`.comm`), the module swap and volume formulas
(:mod:`.parallelize`), LoRA adapters on sharded layers (:mod:`.lora`) and per-rank RNG (:mod:`.rng`)."""
