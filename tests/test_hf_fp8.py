"""Checkpoints stored in 8-bit floats with scales (:mod:`loom.model.hf.quantized`): a tiny random
Llama and Qwen3 quantized here as transformers' fine-grained FP8 (blocks of 16 × 32 over widths that
leave partial blocks) and as compressed-tensors' float-quantized FP8 (per channel, per tensor)
import with the logits ``transformers`` gets by dequantizing the same directory (and those of the
formula's weights), any box reads only the codes and scale blocks over it, the export carries no
``quantization_config``; methods and tensors Loom cannot dequantize are refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from torch.testing import assert_close

from tests.helpers import HF_TINY, imported_with_their_logits

FP8 = torch.float8_e4m3fn
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def _quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of w in blocks of ``block`` rows × columns: scale = amax / 448 per block."""
    r, c = w.shape
    g0, g1 = math.ceil(r / block[0]), math.ceil(c / block[1])
    padded = torch.zeros(g0 * block[0], g1 * block[1])
    padded[:r, :c] = w
    amax = padded.reshape(g0, block[0], g1, block[1]).abs().amax((1, 3)).clamp(min=1e-12)
    scale = amax / torch.finfo(FP8).max
    tiles = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:r, :c]
    return (w / tiles).to(FP8), scale


def save_fp8(
    path: Path, family: str, scheme: str, ffn: int = 96
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A random ``family`` model of MLP width ``ffn`` whose block linears are stored in fp8 under
    ``scheme`` (``fp8``: 16 × 32 blocks, partial ones where ``ffn`` is not a multiple of 32;
    ``channel``, ``tensor``: compressed-tensors); returns the full-precision model holding the
    dequantized weights (what the checkpoint means) and those weights."""
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**(HF_TINY | {"intermediate_size": ffn, "head_dim": 16}))
    model = getattr(transformers, model_cls)(config).eval()
    tensors, meant = {}, {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            t = p.detach().clone()
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                r, c = t.shape
                block = {"fp8": (16, 32), "channel": (1, c), "tensor": (r, c)}[scheme]
                codes, scale = _quantize(t, block)
                if scheme == "tensor":
                    scale = scale.reshape(1)
                suffix = "_scale_inv" if scheme == "fp8" else "_scale"
                tensors[name], tensors[name + suffix] = codes, scale
                tiles = scale.reshape(math.ceil(r / block[0]), -1)
                meant[name] = (
                    codes.float()
                    * tiles.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:r, :c]
                )
            else:
                tensors[name] = t
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = config.to_dict() | {"architectures": [model_cls]}
    if scheme == "fp8":
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [16, 32],
        }
    else:
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": scheme, "symmetric": True},
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "dynamic": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        }
    (path / "config.json").write_text(json.dumps(raw))
    with torch.no_grad():
        for name, w in meant.items():
            model.get_parameter(name).copy_(w)
    return model, meant


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scheme", ["fp8", "fp8 partial blocks", "channel", "tensor"])
def test_fp8_checkpoints_import_dequantized_with_transformers_logits(tmp_path, family, scheme):
    """Logits equal those of the dequantized weights in transformers; the fine-grained FP8 directory
    loads in transformers itself (it dequantizes on a machine without a GPU; whole blocks only: an
    MLP width of 88 over blocks of 32 it refuses) with the same logits; every weight equals the
    formula's, and a tp2 half reads half the codes."""
    from loom.model.hf import Reader, open_dir

    partial = scheme == "fp8 partial blocks"
    meant_model, meant = save_fp8(tmp_path, family, "fp8" if partial else scheme, 88 if partial else 96)
    hf = open_dir(tmp_path, 32)
    _, x, logits = imported_with_their_logits(hf, meant_model)
    if scheme == "fp8":
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        with torch.no_grad():
            assert_close(logits, theirs(x).logits)
    with Reader(hf) as reader:
        for lm, hf_name in (("layers.1.feed_forward.w2.weight", "model.layers.1.mlp.down_proj.weight"),
                            ("layers.0.feed_forward.w1.weight", "model.layers.0.mlp.gate_proj.weight")):  # fmt: skip
            whole = meant[hf_name]
            assert_close(reader.read(lm), whole, rtol=0, atol=0)
            for box in (
                (slice(5, 70), slice(17, 50)),
                (slice(0, 44), slice(None)),
                (slice(40, 41), slice(3, 4)),
            ):
                box = box[: whole.dim()]
                assert torch.equal(reader.read(lm, box), whole[box]), (lm, box)
            before = reader.bytes_read
            reader.read(lm, (slice(whole.shape[0] // 2, None),))
            assert reader.bytes_read - before == whole.numel() // 2  # one byte per code


@pytest.mark.parametrize(
    "edit,says",
    [
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "config.json: quantization_config (quant_method = 'gptq') is not supported: Loom dequantizes fp8 "
            "(weight_scale_inv) and compressed-tensors' float-quantized fp8 weights as it reads them; "
            "dequantize other methods first (e.g. save the model in bfloat16)",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16]}},
            "config.json: quantization_config.weight_block_size = [16]: want two integers > 0",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}},
            "model.layers.0.mlp.down_proj.weight's scale has shape (4, 3); weight_block_size [32, 32] over "
            "(64, 88) implies (2, 3)",
        ),
    ],
    ids=["gptq", "bad block", "block against scale"],
)
def test_what_loom_cannot_dequantize_is_one_line(tmp_path, edit, says):
    from loom.model.hf import HFError, open_dir

    save_fp8(tmp_path, "llama", "fp8", 88)
    raw = json.loads((tmp_path / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFError) as e:
        open_dir(tmp_path, 32)
    assert str(e.value).endswith(says)


def test_codes_without_their_scale_are_refused(tmp_path):
    """An 8-bit weight whose scale is missing is codes, not values: refused naming the tensor."""
    from safetensors.torch import load_file

    from loom.model.hf import HFError, open_dir

    save_fp8(tmp_path, "llama", "fp8")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        HFError, match=r"tensor model\.layers\.0\.self_attn\.q_proj\.weight is stored as F8_E4M3"
    ):
        open_dir(tmp_path, 32)


def test_the_export_of_a_quantized_source_carries_no_quantization_config(tmp_path):
    """Loom writes the weights in its own precision: the source's other fields carry over, its
    quantization_config does not."""
    from loom.checkpoint.hf_export import carried_config
    from loom.model.hf import hf_config, open_dir

    save_fp8(tmp_path, "qwen3", "fp8")
    ours = hf_config(open_dir(tmp_path, 32).config)
    carried = carried_config(ours, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in carried
    dropped = ("quantization_config", "dtype", "transformers_version")
    assert all(carried[k] == v for k, v in raw.items() if k not in dropped)
