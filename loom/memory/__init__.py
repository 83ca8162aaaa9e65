"""Memory techniques: precision and loss scaling, recomputation, activation compression and offload,
activation accounting, optimizer-state offload."""
