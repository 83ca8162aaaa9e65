"""Parameter-efficient fine-tuning: LoRA adapters (:mod:`.lora`) on a frozen base, QLoRA's NF4 base
(:mod:`.nf4`), the base a run is bound to (:mod:`.base`), PEFT and merged exports (:mod:`.export`)."""
