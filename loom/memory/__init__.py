"""Memory techniques: precision casting, the fp16 loss scaler, recomputation, activation compression and
host offload, activation accounting. (Optimizer-state offload is :mod:`loom.optim.store`.)"""
