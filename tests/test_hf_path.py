"""The Hugging Face user's path from the command line (issue 34, item 7): ``loom config`` and
``loom plan`` read ``--model.from_hf``; explicit ``model.*`` settings are refused where they
contradict the directory's config.json (max_seq_len honoured); a from_hf run gets fine-tuning
defaults for the [train] values it does not give, and is refused without its own data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from loom import config as C
from loom.cli import main


def _save(path: Path, family: str = "llama", **kw) -> Path:
    """A tiny random transformers model (nothing downloaded) and a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, **kw)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cls = {"llama": "Llama", "nemo": "Mistral"}[family]
        fields = dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
        if family == "nemo":  # Mistral-Nemo's shape: head_dim 16 != 32 / 4
            fields |= {"head_dim": 16, "sliding_window": 512}
        cfg = getattr(transformers, f"{cls}Config")(**(fields | kw))
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
    model.save_pretrained(path)
    Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-path")
    return {f: _save(root / f, f) for f in ("llama", "nemo", "gpt2")}


def _config(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["config", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _toml(out: str) -> dict:
    return C.tomllib.loads(out)


def test_loom_config_shows_the_directorys_model_and_fine_tuning_defaults(dirs, capsys, tmp_path):
    """``loom config --model.from_hf`` prints the directory's model (Mistral-Nemo's head_dim
    included) with the fine-tuning defaults, stated in a comment line; explicit [train] values stay;
    the printed config read back with the same directory is the same config (no field refused)."""
    rc, out, err = _config(capsys, "--model.from_hf", str(dirs["nemo"]), "--data.source", "corpus.txt")
    assert rc == 0, err
    got = _toml(out)
    m = got["model"]
    assert (m["dim"], m["n_heads"], m["n_kv_heads"], m["attn_head_dim"], m["ffn_dim"], m["vocab_size"]) == (
        32,
        4,
        2,
        16,
        64,
        64,
    )
    assert m["from_hf"] == str(dirs["nemo"].absolute()) and m["max_seq_len"] == 256  # data.seq_len
    t = got["train"]
    assert (t["lr"], t["min_lr"], t["warmup_steps"], t["weight_decay"]) == (2e-5, 2e-6, 6, 0.0)
    note = out.splitlines()[0]
    assert note.startswith("# model.from_hf: fine-tuning defaults") and "train.lr 2e-05 (full)" in note
    assert "train.warmup_steps 6 (3% of 200 steps)" in note and "train.weight_decay 0" in note
    (tmp_path / "again.toml").write_text(out)
    rc, again, err = _config(capsys, str(tmp_path / "again.toml"), "--model.from_hf", str(dirs["nemo"]))
    assert rc == 0, err
    assert _toml(again) == got and not again.startswith("#")  # every [train] value is given now
    rc, out, err = _config(
        capsys,
        "--model.from_hf",
        str(dirs["llama"]),
        "--data.source",
        "c.txt",
        "--finetune.method",
        "lora",
        "--train.lr",
        "1e-3",
        "--train.steps",
        "10",
    )
    t = _toml(out)["train"]
    assert rc == 0 and (t["lr"], t["min_lr"], t["warmup_steps"]) == (1e-3, 1e-4, 1), err
    note = out.splitlines()[0]
    assert "train.min_lr 0.0001 (lr / 10, cosine)" in note and "train.lr " not in note  # lr was given


@pytest.mark.parametrize(
    "family,argv,says",
    [
        (
            "llama",
            ["--model.dim", "256"],
            "model.dim: 256 was given, but model.from_hf's config.json gives 32",
        ),
        (
            "llama",
            ["--model.n_kv_heads", "4"],
            "model.n_kv_heads: 4 was given, but model.from_hf's config.json gives 2",
        ),
        (
            "nemo",
            ["--model.attn_head_dim", "8"],
            "model.attn_head_dim: 8 was given, but model.from_hf's config.json gives 16",
        ),
        (
            "llama",
            ["--model.norm_eps", "1e-5"],
            "model.norm_eps: 1e-05 was given, but model.from_hf's config.json gives 1e-06",
        ),
        (
            "gpt2",
            ["--model.max_seq_len", "32", "--data.seq_len", "32"],
            "model.max_seq_len: 32 was given, but model.from_hf's config.json gives 64",
        ),
        ("llama", [], "data.source: model.from_hf fine-tunes a pretrained model; give its data"),
    ],
)
def test_conflicting_or_missing_settings_are_one_line(dirs, capsys, family, argv, says):
    """An explicit model field the directory contradicts (GPT-2's position table fixes max_seq_len),
    and a from_hf run without data.source, are refused in one line naming the field and both values,
    by loom config and by loom train before any rank starts."""
    data = [] if not argv else ["--data.source", "c.txt"]
    for cmd in ("config", "train"):
        capsys.readouterr()
        assert (
            main([cmd, "--model.from_hf", str(dirs[family]), *data, *argv, "--run.dir", "/nonexistent/r"])
            == 2
        )
        err = capsys.readouterr().err
        assert err.startswith(f"loom: error: {says}") and err.count("\n") == 1, err


def test_max_seq_len_is_honoured_and_equal_values_pass(dirs, capsys):
    """max_seq_len with RoPE only says how far the rotary tables reach: an explicit value is kept;
    explicit values equal to the directory's pass."""
    argv = ["--model.from_hf", str(dirs["llama"]), "--data.source", "c.txt", "--model.max_seq_len", "512"]
    rc, out, err = _config(capsys, *argv, "--model.dim", "32", "--model.vocab_size", "0")
    assert rc == 0, err
    m = _toml(out)["model"]
    assert m["max_seq_len"] == 512 and m["vocab_size"] == 64 and m["dim"] == 32


def test_loom_plan_plans_the_directorys_model(dirs, capsys, tmp_path):
    """``loom plan --model.from_hf`` plans the directory's model: the same ranking as for the same
    model given field by field (the config loom config prints), not the default model's."""

    def plan(*argv: str) -> dict:
        capsys.readouterr()
        rc = main(["plan", "--json", "--world", "2", *argv])
        out = json.loads(capsys.readouterr().out)
        assert rc in (0, 1)
        return {k: v for k, v in out.items() if k != "elapsed_s"}

    rc, out, _ = _config(capsys, "--model.from_hf", str(dirs["nemo"]), "--data.source", "c.txt")
    spelled = _toml(out)
    spelled["model"]["from_hf"] = ""
    (tmp_path / "spelled.toml").write_text(C.dump_toml(C.from_dict(spelled)))
    got = plan("--model.from_hf", str(dirs["nemo"]))
    assert got == plan("--config", str(tmp_path / "spelled.toml"))
    assert got != plan("--config", str(tmp_path / "spelled.toml"), "--model.attn_head_dim", "0")


# ----------------------------------------------------------------------------- vocabulary padding (item 6)

PAD_V = 129  # the tokenizer's size and the config's vocab_size: not divisible by 2
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"


def _chat_dir(path: Path) -> Path:
    """A tiny HF Llama whose vocab_size is its tokenizer's 129 tokens, chat template in chat_template.jinja."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    _save(path, vocab_size=PAD_V, tie_word_embeddings=False)
    words = ["<|user|>", "<|assistant|>", "<|end|>"] + [f"w{i}" for i in range(PAD_V - 3)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _chat_batches(path: Path, seq: int, micro: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` sequences of chat examples rendered with the directory's template (labels only on the
    assistant turns, -100 elsewhere), as micro-batches of (tokens, targets)."""
    from tokenizers import Tokenizer

    from loom.data.chat import encode_example, segments, template_render

    render = template_render(str(path / "tokenizer.json"))
    assert render is not None
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    g = torch.Generator().manual_seed(5)
    ids: list[int] = []
    mask: list[int] = []
    while len(ids) < n * (seq + 1):
        words = [f"w{int(i)}" for i in torch.randint(0, PAD_V - 3, (6,), generator=g)]
        record = {
            "messages": [
                {"role": "user", "content": " ".join(words[:3])},
                {"role": "assistant", "content": " ".join(words[3:])},
            ]
        }
        text, spans = segments(record, "test", "chat", render)
        one, m = encode_example(tok, text, spans, 2, False)
        ids, mask = ids + one, mask + m
    t = torch.tensor(ids[: n * (seq + 1)]).view(n, seq + 1)
    keep = torch.tensor(mask[: n * (seq + 1)]).view(n, seq + 1).bool()
    x, y = t[:, :-1], t[:, 1:].masked_fill(~keep[:, 1:], -100)
    return [(x[i : i + micro], y[i : i + micro]) for i in range(0, n, micro)]


def lora_from_hf(path: str, tp: int, steps: int = 4) -> dict:
    """LoRA fine-tuning of the HF directory ``path`` under tp (the trainer's path: the model built on the
    meta device, the vocabulary resolved and padded by ``effective_vocab``, weights read per box):
    losses, the adapters, the embedding's row count."""
    from loom.comm import CommMeter
    from loom.mesh import ParallelDims, ParallelMesh
    from loom.model.hf import open_dir, resolve_from_hf
    from loom.model.hf import source as hf_source
    from loom.model.llama import build_model
    from loom.train.build import build_run
    from loom.train.schedule import lr_at
    from loom.train.step import train_step
    from tests.dist import get_mesh

    mesh = get_mesh(tp=tp) if tp > 1 else ParallelMesh(ParallelDims(), "cpu")
    cfg = C.LoomConfig()
    cfg.model.from_hf, cfg.data.source, cfg.data.seq_len = path, "chat.jsonl", 16
    cfg.finetune = C.FinetuneConfig(method="lora", lora_rank=4, lora_alpha=8.0, lora_targets="all-linear")
    cfg.train.steps, cfg.train.global_batch, cfg.train.micro_batch, cfg.train.precision = steps, 8, 2, "fp32"
    cfg.parallel.tp = tp
    resolve_from_hf(cfg, need_data=False)
    C.validate(cfg, tp)
    cfg.model.vocab_size = C.effective_vocab(cfg, PAD_V)
    model = build_model(cfg.model, cfg.train.seed, meta=True)
    run = build_run(cfg, mesh, model, CommMeter(), hf_source(open_dir(path, 16)))
    batches = _chat_batches(Path(path), 16, 2, 8)
    losses = [
        train_step(run, batches, 1.0, lr_at(s, cfg.train), mesh.group("dp_cp")).loss for s in range(steps)
    ]
    state = run.strategy.full_state_dict() or {}
    return {
        "losses": losses,
        "adapters": {k: v.clone() for k, v in state.items() if ".lora_" in k},
        "rows": cfg.model.padded_vocab,
    }


def test_lora_tp2_on_a_vocab_tp_does_not_divide_equals_one_process(pools, tmp_path):
    """Issue 34's done-when: a tiny HF Llama whose vocab equals its tokenizer's 129 tokens and whose
    chat template is in chat_template.jinja fine-tunes with LoRA under tp2 (the vocabulary padded to
    256 = 128·2) equal to one process (no padding): losses and adapters of 4 steps on chat data
    rendered with that template."""
    from torch.testing import assert_close

    path = str(_chat_dir(tmp_path / "chat"))
    one = lora_from_hf(path, 1)
    assert one["rows"] == PAD_V and len(one["adapters"]) == 2 * 7 * 2
    for r in pools(2).run(lora_from_hf, path, 2):
        assert r["rows"] == 256
        assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
        for k, v in one["adapters"].items():
            assert_close(r["adapters"][k], v, rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_a_tokenizer_the_model_cannot_hold_is_refused_before_the_corpus_is_read(
    tmp_path, capsys, monkeypatch
):
    """model.from_hf whose tokenizer.json has more tokens than config.json's vocabulary (or no end of
    document token): one line naming the tokenizer file, before the corpus is tokenized."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("w1 w2 w3\n\n" * 200)
    d = _save(tmp_path / "big", "llama")
    words = {f"w{i}": i for i in range(100)} | {"<|endoftext|>": 100}
    Tokenizer(WordLevel(words, unk_token="w0")).save(str(d / "tokenizer.json"))
    for tok, says in [
        ("big", "model.vocab_size: 64 is smaller than the tokenizer's 101"),
        ("no end", "end-of-document tokens"),
    ]:
        if tok == "no end":
            _save(d, "llama")  # its word-level tokenizer has no end-of-document token
        capsys.readouterr()
        argv = ["train", "--model.from_hf", str(d), "--data.source", str(tmp_path / "c.txt")]
        assert main([*argv, "--run.dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("loom: error: ") and err.count("\n") == 1, err
        assert says in err and str(d / "tokenizer.json") in err and "the tokenizer of model.from_hf" in err, (
            err
        )
        assert not list(tmp_path.rglob("*.bin")) and not (tmp_path / "run").exists()  # no token file
