"""Optimizers on flat parameter shards: AdamW with loss-scale unscaling, Adafactor, 8-bit Adam."""
