"""Hugging Face checkpoints in and out of Loom's model, without ``transformers`` (JSON + safetensors).

``families``: the families and ``config.json``'s fields; ``config``: ``config.json`` -> Loom's model
config; ``names``: Loom's tensors under their Hugging Face names and layouts (the mapping);
``directory``: a model directory opened and checked; ``reader``: its weights read box by box;
``run_config``: a run's ``model.from_hf``; ``to_hf``: a Loom model's ``config.json`` and tensors.
"""

from loom.model.hf.config import GELU, model_config
from loom.model.hf.directory import HFModel, moe_options, open_dir, open_shard
from loom.model.hf.families import (
    CONFIG,
    FAMILY_DEFAULTS,
    GPT2,
    INDEX,
    LLAMA,
    MISSING,
    MODEL_TYPES,
    OLMO2,
    PHI3,
    QWEN2,
    QWEN3MOE,
    SINGLE,
    SUPPORTED,
    HFError,
    architecture,
    architecture_of,
    hf_field,
    moe_export_problem,
    sliding_window,
    zero_tensors,
)
from loom.model.hf.names import (
    HEAD,
    VOCAB_TENSORS,
    Mapping,
    _mappings,
    expected_shapes,
    to_hf_rows,
    to_loom_rows,
)
from loom.model.hf.reader import HFSource, Reader, load_into, read_state, source
from loom.model.hf.run_config import (
    DERIVED,
    HF_FIELDS,
    apply_to,
    explicit_model_field,
    resolve_from_hf,
)
from loom.model.hf.to_hf import hf_config, hf_tensors, hf_units

__all__ = [
    "CONFIG",
    "DERIVED",
    "FAMILY_DEFAULTS",
    "GELU",
    "GPT2",
    "HEAD",
    "HF_FIELDS",
    "INDEX",
    "LLAMA",
    "MISSING",
    "MODEL_TYPES",
    "OLMO2",
    "PHI3",
    "QWEN2",
    "QWEN3MOE",
    "SINGLE",
    "SUPPORTED",
    "VOCAB_TENSORS",
    "HFError",
    "HFModel",
    "HFSource",
    "Mapping",
    "Reader",
    "_mappings",
    "apply_to",
    "architecture",
    "architecture_of",
    "expected_shapes",
    "explicit_model_field",
    "hf_config",
    "hf_field",
    "hf_tensors",
    "hf_units",
    "load_into",
    "model_config",
    "moe_export_problem",
    "moe_options",
    "open_dir",
    "open_shard",
    "read_state",
    "resolve_from_hf",
    "sliding_window",
    "source",
    "to_hf_rows",
    "to_loom_rows",
    "zero_tensors",
]
