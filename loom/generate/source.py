"""Where ``loom generate`` takes its model, tokenizer, end tokens and chat template from.

A Loom run directory (config.toml + tokenizer.json + the final weights, verified before use:
``checkpoints/final/model.safetensors`` must have the SHA-256 ``final/meta.json`` records, if it
records one; else, as an export of the run's last checkpoint (its header names it), that
checkpoint is verified against its manifest (and the hash ``latest`` recorded) and every tensor of
the file must equal it; a LoRA run's file is the merged model (header ``lora = merged``): it must
equal the merge of that checkpoint's adapters on the base, whose SHA-256 must be the one the
checkpoint recorded), or a local Hugging Face model directory (loom.model.hf). The model a run
generates with is the one recorded by the checkpoint its final file was exported from (its
``train_state.json`` config, as ``loom export hf`` reads it: loom.checkpoint.recorded), not
config.toml's: a config.toml whose model fields differ from it is refused, naming each; a final
file whose checkpoint recorded no config (an older Loom) is built from config.toml.

End-of-text ids: ``generation_config.json``'s ``eos_token_id`` (an id or a list: any of them ends a
prompt), else ``config.json``'s, of the Hugging Face directory (a run's: its ``model.from_hf``), else
(a run) its tokenizer config's ``eos_token`` (ChatML's ``<|im_end|>``) and the tokenizer's
end-of-document token (:func:`loom.checkpoint.hf_export.end_tokens`, as its export lists them).

Chat prompts are rendered as the chat data was (loom.data.chat): the tokenizer directory's template
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) with its generation
prompt, or the built-in ``<|role|>\\ncontent\\n`` turns followed by ``<|assistant|>\\n``. A run's
tokenizer directory is the copy it keeps in ``run.dir``, else (an older run) ``data.tokenizer``'s, as
``loom export hf`` reads it (:func:`loom.checkpoint.hf_export.run_tokenizer_dir`).

Sampling defaults: the ``temperature``, ``top_k``, ``top_p`` and ``repetition_penalty`` of the
Hugging Face directory's (a run's: its base's) ``generation_config.json`` (``do_sample: false``:
greedy; ``do_sample: true``: the fields it leaves out are ``transformers``' defaults, 1.0 / 50 /
1.0) for each option the command line leaves unset (loom.generate.options); fields that change
the tokens which Loom does not implement (beams, ``min_p``, ``no_repeat_ngram_size``, ...) are
named in one warning line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from tokenizers import Tokenizer
from torch import nn

from loom import config as C
from loom.checkpoint.format import (
    LATEST,
    TRAIN_STATE,
    CheckpointError,
    check_header,
    check_run_tokenizer,
    read_json,
)
from loom.checkpoint.hf_export import end_tokens, run_tokenizer_dir
from loom.checkpoint.recorded import adopt_model, model_changes, recorded_config
from loom.data.chat import builtin_render, template_render
from loom.data.tokenizer import EOT_CANDIDATES, load_tokenizer, start_ids
from loom.generate.options import Prompt, SamplingOptions
from loom.model.llama import Transformer
from loom.train.export import load_model

if TYPE_CHECKING:
    from loom.model.hf import HFModel

PREFIX = "model."  # names of the model's tensors in a checkpoint (loom.checkpoint.convert)
SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")  # generation_config.json's, taken
HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' defaults under do_sample
# generation_config.json fields that change the tokens, Loom does not implement: their no-op values
UNHONOURED: dict[str, Any] = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "guidance_scale": None,
    "min_length": 0,
    "min_new_tokens": None,
    "exponential_decay_length_penalty": None,
    "dola_layers": None,
    "diversity_penalty": 0.0,
}


@dataclass
class Source:
    """A model ready to generate, its tokenizer, end-of-text ids and chat template directory."""

    model: Transformer
    tokenizer: Tokenizer
    eos: frozenset[int]
    template: str | None  # a tokenizer path whose directory may hold a chat template; None: built-in
    what: str  # for messages: "run DIR" or "Hugging Face model DIR"
    sampling: dict[str, float] = field(default_factory=dict)  # the model's defaults (module doc)
    unhonoured: str = ""  # the warning naming the fields of its generation_config.json Loom ignores

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat prompt: the conversation so far and the opening of the assistant's turn."""
        render = template_render(self.template, generation_prompt=True) if self.template else None
        return render(messages) if render is not None else builtin_render(messages, generation_prompt=True)

    def encode(self, prompt: Prompt, chat: bool, where: str = "--prompt") -> list[int]:
        """Token ids of a prompt: chat messages (or a text as one user turn, with ``chat``) rendered
        and encoded as chat data is (the tokenizer's start tokens before it unless the template wrote
        them, :func:`~loom.data.tokenizer.start_ids`), or a text as the tokenizer encodes it (its
        post-processor's start tokens included)."""
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            ids = self.tokenizer.encode(_utf8(self.render(messages), where), add_special_tokens=False).ids
            start = [i for i in start_ids(self.tokenizer, -1) if i not in self.eos]
            if ids[: len(start)] != start:  # as chat data is prepared (data.bos): a template may write it
                ids = [*start, *ids]
        else:
            assert isinstance(prompt, str)  # read_prompts refuses messages without --chat
            ids = self.tokenizer.encode(_utf8(prompt, where)).ids
        ids = ids or sorted(self.eos)[:1] or [0]  # an empty prompt starts a document
        vocab = self.model.cfg.vocab_size
        if max(ids) >= vocab:
            raise C.ConfigError(
                f"{where}: the tokenizer of {self.what} gives ids up to {max(ids)}, beyond the model's "
                f"vocabulary of {vocab}; its tokenizer.json was replaced"
            )
        return ids


def _utf8(text: str, where: str) -> str:
    """``text`` if it is Unicode text; a command-line argument of invalid UTF-8 bytes (kept by Python
    as lone surrogates) or a JSON ``\\ud800`` escape is refused, naming where it came from."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise C.ConfigError(
            f"{where}: not valid UTF-8 text ({text[e.start : e.end]!a} at character {e.start})"
        ) from None
    return text


def end_ids(tok: Tokenizer, configured: object = None) -> frozenset[int]:
    """End-of-text ids: ``configured`` (an HF config's ``eos_token_id``: an id or a list) if given,
    else the tokenizer's end-of-document token (loom.data.tokenizer), if it has one."""
    if isinstance(configured, int):
        return frozenset([configured])
    if isinstance(configured, list) and configured:
        return frozenset(int(i) for i in configured)
    found = (tok.token_to_id(name) for name in EOT_CANDIDATES)
    return frozenset(next(([i] for i in found if i is not None), []))


def generation_eos(hf_dir: Path) -> object:
    """The end-of-text ids of a Hugging Face directory as ``transformers.generate`` takes them:
    ``generation_config.json``'s ``eos_token_id`` (an id or a list), else ``config.json``'s."""
    for name in ("generation_config.json", "config.json"):
        f = hf_dir / name
        if f.is_file():
            value = read_json(f).get("eos_token_id")
            if value is not None and value != []:
                return value
    return None


def generation_defaults(hf_dir: Path | None) -> tuple[dict[str, float], str]:
    """The sampling defaults of a Hugging Face directory's ``generation_config.json`` (module doc; a
    field of null value is unset), checked as the options are, and the warning line naming its
    fields Loom does not honour ("": none)."""
    path = hf_dir / "generation_config.json" if hf_dir is not None else None
    if path is None or not path.is_file():
        return {}, ""
    raw = {k: v for k, v in read_json(path).items() if v is not None}
    given = {k: _number(raw, k, path) for k in SAMPLING if k in raw}
    sample = raw.get("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise C.ConfigError(f"{path}: do_sample: expected true or false, got {sample!r}")
    if sample is True:
        given = HF_SAMPLING | given
    elif sample is False:
        given["temperature"] = 0.0  # greedy, as transformers' generate
    SamplingOptions().with_defaults(given).check(where=str(path))
    ignored = ", ".join(k for k, noop in UNHONOURED.items() if raw.get(k, noop) not in (noop, []))
    said = f"loom: warning: {path}: loom generate does not implement {ignored}; it generates without them"
    return given, said if ignored else ""


def _number(raw: dict, key: str, path: Path) -> float:
    """``raw[key]``: an integer for ``top_k``, else a number; anything else is one line naming it."""
    value = raw[key]
    want = (int,) if key == "top_k" else (int, float)
    if isinstance(value, bool) or not isinstance(value, want):
        raise C.ConfigError(
            f"{path}: {key}: expected {'an integer' if key == 'top_k' else 'a number'}, got {value!r}"
        )
    return value


def load_run(run_dir: str) -> Source:
    """The final model of a run written by ``loom train``, verified (module doc)."""
    if not run_dir.strip():
        raise C.ConfigError("run.dir: must name a directory written by loom train, got ''")
    d = Path(run_dir)
    if not d.is_dir():
        raise C.ConfigError(
            f"run.dir: {d} is not a directory; train first with loom train --run.dir {run_dir}"
        )
    weights = d / "checkpoints" / "final" / "model.safetensors"
    for f in (d / "config.toml", d / "tokenizer.json", weights):
        if not f.exists():
            began = (d / "checkpoints").is_dir() or (d / "metrics.jsonl").is_file()
            if f == weights and began:  # trained, not finished: no final model yet
                todo = (
                    f"the run has not finished; finish it (loom train --run.dir {run_dir}), or export one of "
                    f"its checkpoints (loom export hf {run_dir} DIR) and give --model.from_hf DIR"
                )
            elif began:  # a run that lost a file it wrote when it started
                todo = "restore it (a run writes it when it starts), or give --run.dir a complete run"
            else:
                todo = f"train first with loom train --run.dir {run_dir}"
            raise C.ConfigError(f"run.dir: {f} not found; {todo}")
    cfg = C.load_toml(d / "config.toml")
    if cfg.model.vocab_size < 1:
        raise C.ConfigError(
            f"model.vocab_size: {d / 'config.toml'} records {cfg.model.vocab_size}; a trained run "
            "records its vocabulary"
        )
    check_run_tokenizer(d)
    tok = load_tokenizer(d / "tokenizer.json")
    merged = verify_final(d, weights, cfg)
    trained_model(cfg, d, weights)
    if cfg.finetune.method != "full" and not merged:  # a file of adapters (loom checkpoint convert)
        model = load_lora(cfg, d, weights)
    else:  # a full run's model, or a LoRA run's merged one (W + (α/r)·B A, as the trainer writes it)
        model = Transformer(cfg.model, cfg.moe)
        try:
            load_model(model, weights)
        except ValueError as e:  # tensors missing or of another shape: config.toml and the weights disagree
            raise CheckpointError(f"{e} (does {d / 'config.toml'} belong to this run?)") from None
    tok_dir = run_tokenizer_dir(d, cfg)  # the chat data's template came from there (loom.data.prepare)
    base = cfg.train.init_from or cfg.model.from_hf
    hf_dir = Path(base) if base and (Path(base) / "config.json").is_file() else None
    configured = generation_eos(hf_dir) if hf_dir is not None else None
    eos = end_ids(tok, configured) if configured is not None else frozenset(end_tokens(tok, tok_dir))
    sampling, unhonoured = generation_defaults(hf_dir)
    template = str(tok_dir) if tok_dir is not None else None
    return Source(model.eval(), tok, eos, template, f"run {d}", sampling, unhonoured)


@torch.no_grad()
def load_lora(cfg: C.LoomConfig, run_dir: Path, weights: Path) -> Transformer:
    """A LoRA run's model: its base (``model.from_hf`` / ``train.init_from`` / the seeded init, which
    must have the SHA-256 the run's checkpoint recorded) wrapped in the adapters of ``weights`` (the
    verified final export: the adapters, and any base tensor it holds); QLoRA's base in NF4 again,
    as it was trained. Generation then runs the adapters as training did, unmerged."""
    from safetensors.torch import load_file

    from loom.finetune.export import base_tensors
    from loom.finetune.lora import LoRALinear, apply_lora, is_adapter, quantize_base

    _check_base(cfg, run_dir, _recorded_base(run_dir, weights))
    model = Transformer(cfg.model, cfg.moe)
    apply_lora(model, targets=C.lora_targets(cfg), finetune=cfg.finetune)
    for mod in model.modules():
        if isinstance(mod, LoRALinear):  # adapters are built on the meta device
            for part in (mod.lora_A, mod.lora_B):
                cast(nn.Module, part).to_empty(device="cpu")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in base_tensors(cfg):
        params[name].copy_(t)
    state = load_file(str(weights))
    missing = sorted(n for n in params if is_adapter(n) and n not in state)
    unknown = sorted(n for n in state if n not in params)
    if missing or unknown:
        raise CheckpointError(
            f"{weights}: adapters missing {missing[:3]}, unknown tensors {unknown[:3]} (does "
            f"{run_dir / 'config.toml'} belong to this run?)"
        )
    for name, t in state.items():
        if tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"{weights}: {name} has shape {tuple(t.shape)}, the model {tuple(params[name].shape)}"
            )
        params[name].copy_(t)
    if cfg.finetune.method == "qlora":
        quantize_base(model)
    return model


def _check_base(cfg: C.LoomConfig, run_dir: Path, recorded: dict | None) -> None:
    """Point ``cfg`` at the base ``recorded`` by a LoRA run's checkpoint (its absolute path) and
    refuse it if its SHA-256 changed (:func:`loom.finetune.base.bind_base`)."""
    from loom.finetune.base import bind_base

    bind_base(cfg, recorded, run_dir, "generate from the base it was trained on")


def trained_model(cfg: C.LoomConfig, run_dir: Path, weights: Path) -> None:
    """Give ``cfg`` the model the checkpoint ``weights`` was exported from recorded (module doc);
    a config.toml that says otherwise is refused in one line naming each field."""
    found = _recorded_state(run_dir, weights)
    saved = recorded_config(found[1]) if found is not None else None
    if found is None or saved is None:
        return  # an older checkpoint: config.toml's model, as before
    changes = model_changes(saved, cfg)
    if changes:
        toml = run_dir / "config.toml"
        (name, old, new), *rest = changes
        said = [f"{name}: {toml} says {new}, the checkpoint {found[0]} was trained with {old}"]
        said += [f"{n}: says {v}, trained with {o}" for n, o, v in rest]
        raise C.ConfigError(
            f"{'; '.join(said)}; put the trained values back in {toml} (generation runs the model "
            "the checkpoint recorded)"
        )
    adopt_model(cfg, saved)


def _recorded_state(run_dir: Path, weights: Path) -> tuple[Path, dict] | None:
    """The checkpoint ``weights`` was exported from (its header's ``source``, under
    ``run_dir/checkpoints``) and its ``train_state.json``; None: not found."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        source = (f.metadata() or {}).get("source", "")
    named = bool(source) and not source.startswith(".") and Path(source).name == source  # a tag
    ckpt = run_dir / "checkpoints" / source
    if not named or not (ckpt / TRAIN_STATE).is_file():
        return None
    return ckpt, read_json(ckpt / TRAIN_STATE)


def _recorded_base(run_dir: Path, weights: Path) -> dict | None:
    """The base identity the checkpoint ``weights`` was exported from records (None: not found)."""
    found = _recorded_state(run_dir, weights)
    return found[1].get("finetune_base") if found is not None else None


def hf_model(path: str | Path) -> tuple[HFModel, Transformer]:
    """A Hugging Face directory's model as generation runs it (see :func:`load_hf`), weights loaded."""
    from loom.model.hf import HFError, load_into, moe_options, open_dir

    try:
        hf = open_dir(path)
        moe = C.MoEConfig(**moe_options(hf))  # type: ignore[arg-type]
        C.validate_shape(C.LoomConfig(model=hf.config, moe=moe))  # what loom train checks: eps > 0, ...
    except (HFError, C.ConfigError) as e:
        raise C.ConfigError(f"model.from_hf: {e}") from None
    model = Transformer(hf.config, moe)
    load_into(model, hf)
    return hf, model


def load_hf(path: str) -> Source:
    """A local Hugging Face model directory: its weights, ``tokenizer.json``, ``eos_token_id`` and
    chat template; its routing options (Qwen3-MoE's ``norm_topk_prob``); a sliding window shorter
    than its positions (Mistral-7B v0.1) as the context Loom keeps (the model's own attention while
    prompt and output fit the window)."""
    hf, model = hf_model(path)
    if hf.tokenizer is None:
        raise C.ConfigError(f"model.from_hf: {hf.dir} has no tokenizer.json; generation needs its tokenizer")
    tok = load_tokenizer(hf.tokenizer)
    sampling, unhonoured = generation_defaults(hf.dir)
    return Source(
        model.eval(),
        tok,
        end_ids(tok, generation_eos(hf.dir)),
        str(hf.dir),
        f"Hugging Face model {hf.dir}",
        sampling,
        unhonoured,
    )


def verify_final(run_dir: Path, weights: Path, cfg: C.LoomConfig | None = None) -> bool:
    """Refuse ``weights`` unless it has the SHA-256 its ``meta.json`` records, or (when none is
    recorded) equals the model tensors of the verified checkpoint it was exported from (named in
    its safetensors header, under ``run_dir/checkpoints``); a LoRA run's merged file (header
    ``lora = merged``) must equal the merge of that checkpoint's adapters on the base it records,
    which must still have the recorded SHA-256. Returns whether the file is such a merged model."""
    from safetensors import safe_open

    from loom.checkpoint.integrity import sha256_file
    from loom.checkpoint.load import CheckpointReader

    check_header(weights)
    try:
        with safe_open(str(weights), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error type for a damaged header or body
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    merged = header.get("lora") == "merged"
    meta = weights.parent / "meta.json"
    recorded = read_json(meta).get("sha256") if meta.is_file() else None
    if recorded:
        if sha256_file(weights) != recorded:
            raise CheckpointError(
                f"{weights}: content altered (its SHA-256 differs from the one recorded in {meta})"
            )
        return merged
    source = header.get("source", "")
    try:
        with safe_open(str(weights), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    root = run_dir / "checkpoints"
    ckpt = root / source
    if not source or "/" in source or "\\" in source or source.startswith(".") or not ckpt.is_dir():
        raise CheckpointError(
            f"{weights}: cannot be verified: the checkpoint it was exported from ({source or '?'}) is "
            f"not in {root}; export a model with loom checkpoint convert and load that"
        )
    expect = None
    if (root / LATEST).is_file():
        latest = read_json(root / LATEST)
        if latest.get("tag") == source:
            expect = str(latest.get("manifest_sha256") or "") or None
    with CheckpointReader(ckpt, manifest_sha=expect) as reader:
        if merged:
            if cfg is not None:
                _check_base(cfg, run_dir, reader.train_state.get("finetune_base"))
            from loom.finetune.export import MergedReader

            view = MergedReader(reader)
            names = {n[len(PREFIX) :] for n in view.names()}
            read = view.read
        else:
            names = {n[len(PREFIX) :] for n in reader.names() if n.startswith(PREFIX)}
            read = reader.read
        if names != set(tensors):
            extra, missing = sorted(set(tensors) - names)[:3], sorted(names - set(tensors))[:3]
            raise CheckpointError(
                f"{weights}: its tensors differ from {ckpt}'s (extra {extra}, missing {missing}); "
                "the file was altered"
            )
        what = "the merge of its adapters on the base" if merged else ""
        for name, t in tensors.items():
            if not torch.equal(t, read(PREFIX + name)):
                raise CheckpointError(
                    f"{weights}: tensor {name} differs from {ckpt}{' (' + what + ')' if what else ''}, "
                    "which it was exported from (the file was altered)"
                )
    return merged
