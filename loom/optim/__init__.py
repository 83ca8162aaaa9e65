"""Everything optimizer-shaped: decay groups (:mod:`.groups`), fp32 master weights (:mod:`.master`), AdamW,
Adafactor and 8-bit Adam on flat shards, the state store for offload (:mod:`.store`), and the factory
:func:`loom.optim.flat.build_flat_optimizer` that ZeRO strategies receive."""
