"""``loom generate``: text from a Loom run or a Hugging Face model directory, with a KV cache.

options.py  the sampling options and prompt files (checked before torch is imported)
source.py   the model, tokenizer, end tokens and chat template of a run or an HF directory
decode.py   next-token rule; cached batched decoding and the cache-free reference
run.py      prompts to completions, printed with tokens/s
"""
