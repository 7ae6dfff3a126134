"""The demo pair: a small Qwen3 target trained on the standard library's own Python source, and a
DFlash drafter trained on that target's hidden states and greedy outputs. The repository ships one
(``data/demo_pair``, what ``make demo`` runs); ``python -m tools.demo_pair data/demo_pair --force``
rebuilds it.

Every machine with Python has the corpus offline: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
(tests, idlelib and installed packages left out). A few modules (``HELD_OUT``) are kept out of
training entirely; the prompts file is cut from them, so the demo measures acceptance on code the
pair has never seen.

Steps, each printing a line every few seconds:
  1. a byte-level BPE tokenizer (``tokenizers``) trained on the corpus, saved with the target so
     ``AutoTokenizer`` reads it;
  2. the target (transformers' ``Qwen3ForCausalLM``) trained as a language model on random
     windows of the corpus, saved as a normal checkpoint folder (config + safetensors + tokenizer);
  3. the drafter (``workers.models.drafter.DFlashDrafter``) trained on the target's own greedy
     continuations of corpus windows and the taps of those sequences (``tools.drafter_training``).
Weights are stored in ``weights_dtype`` (float16: small enough to ship in git); the target is rounded
to it before the drafter's data are made, so the drafter learns the target that is saved.
Writes ``FOLDER/{target,drafter,prompts.jsonl}`` and, last, ``FOLDER/recipe.json``: the recipe (the
cache key) and, as information only, what it was built with (Python, torch, threads). A folder whose
recipe matches is left as it is, whatever Python built it; any other state is rebuilt in a temporary
folder and swapped in at the end (an interrupted run leaves the old folder or none, never half a pair).
The corpus is this Python's stdlib, so a bit-for-bit rebuild needs the same Python, torch and threads.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RECIPE_VERSION = 2  # bump when the code below changes what a recipe produces
EOS, MASK = "<|endoftext|>", "<|mask|>"
# stdlib modules never trained on; the held-out prompts come from them (all exist in Python 3.9+)
HELD_OUT = ("textwrap.py", "shlex.py", "fractions.py", "calendar.py", "difflib.py", "heapq.py", "bisect.py",
            "string.py")
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "turtledemo"}
SHIPPED = Path(__file__).resolve().parents[1] / "data" / "demo_pair"  # the pair in the repository


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that decides the pair; its JSON is the cache key."""

    # tokenizer and corpus
    vocab_size: int = 512  # BPE vocabulary, the two special tokens included
    corpus_bytes: int = 6_000_000  # stdlib text tokenized for training (the corpus holds ~12 MB)
    # target: Qwen3 shape and LM training
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 768
    seq_len: int = 256
    batch_size: int = 8
    target_steps: int = 400
    target_lr: float = 4e-3
    # drafter: DFlash shape, its training data (the target's greedy continuations) and training
    drafter_layers: int = 1
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 3, 5, 6)
    data_sequences: int = 256  # corpus windows the target continues greedily
    data_prompt_len: int = 64
    data_new_tokens: int = 128
    drafter_steps: int = 300
    drafter_lr: float = 3e-3
    drafter_batch: int = 8  # sequences per step
    anchors_per_sequence: int = 16  # blocks per sequence per step
    loss_gamma: float = 7.0  # block position k weighted exp(-(k-1)/gamma), as DFlash at b=16
    seed: int = 0
    weights_dtype: str = "float16"  # as saved; training runs in float32

    def key(self) -> dict:
        return {"recipe_version": RECIPE_VERSION, **asdict(self)}


def built_with(threads: int) -> dict:
    """What a build ran on: information beside the key, since another Python or torch still builds a
    valid pair (not the same bits: the corpus is that Python's stdlib)."""
    import tokenizers
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "threads": threads, "machine": platform.machine()}


# a few seconds of training end to end: the quick test of the whole path
QUICK = DemoRecipe(vocab_size=300, corpus_bytes=200_000, hidden_size=64, num_layers=4, intermediate_size=128,
                   seq_len=64, batch_size=4, target_steps=20, block_size=8, target_layer_ids=(1, 2),
                   data_sequences=8, data_prompt_len=16, data_new_tokens=24, drafter_steps=20, drafter_batch=4,
                   anchors_per_sequence=4)


# --- corpus and prompts -------------------------------------------------------------------------

def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the stdlib's own .py files, sorted, tests and installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIPPED_DIRS or part.startswith("config-") for part in parts[:-1]):
            continue
        (held if len(parts) == 1 and parts[0] in HELD_OUT else train).append(path)
    return train, held


def read_corpus(files: list[Path], limit: int, seed: int) -> list[str]:
    """File texts in a seeded random order until ``limit`` characters."""
    order = list(files)
    random.Random(seed).shuffle(order)
    texts, total = [], 0
    for path in order:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):  # a stray non-UTF-8 file: not worth failing the demo
            continue
        texts.append(text)
        total += len(text)
        if total >= limit:
            break
    return texts


def held_out_prompts(files: list[Path], per_file: int = 2, lines: int = 14) -> list[dict]:
    """Prompts cut from held-out modules: ``lines`` lines starting at a ``def`` (signature, docstring,
    first statements) and the first word of the next line, ``per_file`` spread over each file; the
    target continues the code mid-statement (a prompt ending at a line break invites blank lines)."""
    prompts = []
    for path in files:
        source = path.read_text(encoding="utf-8").splitlines(keepends=True)
        starts = [i for i, line in enumerate(source) if line.lstrip().startswith("def ") and i + lines < len(source)]
        for k in range(min(per_file, len(starts))):
            begin = starts[(k * len(starts)) // per_file + len(starts) // (2 * per_file)]
            following = source[begin + lines].rstrip("\n")
            indent = len(following) - len(following.lstrip())
            word = following[indent:].split(" ", 1)[0]
            text = "".join(source[begin : begin + lines]) + following[:indent] + word
            prompts.append({"prompt": text, "category": "code"})
    return prompts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (every string encodes; no unknown token) wrapped for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS, model_max_length=4096)


# --- the target ---------------------------------------------------------------------------------

def target_config(recipe: DemoRecipe, tokenizer) -> dict:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_kv_heads,
        "head_dim": recipe.hidden_size // recipe.num_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "bos_token_id": eos,
        "pad_token_id": eos,
    }


def train_target(recipe: DemoRecipe, stream, config: dict, device: str = "cpu"):
    """Qwen3ForCausalLM trained on random ``seq_len`` windows of the token stream [N] (AdamW, warm-up
    then cosine decay); returns the model in eval mode."""
    import math

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tools.drafter_training import Ticker

    torch.manual_seed(recipe.seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, recipe.target_steps // 15)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / recipe.target_steps)))))
    generator = torch.Generator().manual_seed(recipe.seed)
    ticker, loss_avg = Ticker("target step", recipe.target_steps), None
    model.train()
    for step in range(1, recipe.target_steps + 1):
        starts = torch.randint(0, stream.numel() - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + recipe.seq_len + 1] for s in starts.tolist()]).to(device)  # [B, S+1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loss_avg = loss.item() if loss_avg is None else 0.9 * loss_avg + 0.1 * loss.item()  # host read: the log line
        ticker.tick(step, f"loss {loss_avg:.3f}")
    return model.eval(), ticker.seconds


# --- building the folder ------------------------------------------------------------------------

def read_recipe(folder: Path) -> dict | None:
    """The key a folder's ``recipe.json`` records (``built_with`` left out), or None without one."""
    try:
        recorded = json.loads((folder / "recipe.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return {k: v for k, v in recorded.items() if k != "built_with"} if isinstance(recorded, dict) else None


def is_current(folder: Path, recipe: DemoRecipe) -> bool:
    return read_recipe(folder) == json.loads(json.dumps(recipe.key()))


def build(folder: Path, recipe: DemoRecipe, stdlib: Path | None = None, device: str = "cpu",
          threads: int | None = None) -> dict:
    """Train and write the pair into ``folder`` (through a temporary sibling folder); returns timings.
    ``threads`` (default: torch's current count) is only recorded in ``recipe.json``."""
    import torch

    from tools.drafter_training import DrafterData, drafter_config, train_drafter
    from workers.models.drafter import DFlashDrafter
    from workers.models.drafter_config import DrafterSpec
    from workers.models.loading import save_drafter

    train_files, held_files = stdlib_files(stdlib)
    if not train_files or not held_files:
        raise SystemExit("tools.demo_pair: no standard-library sources under "
                         f"{stdlib or sysconfig.get_paths()['stdlib']}")
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    times: dict[str, float] = {}

    began = time.monotonic()
    texts = read_corpus(train_files, recipe.corpus_bytes, recipe.seed)
    tokenizer = train_tokenizer(texts, recipe.vocab_size)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):  # whole files: no length warning
        ids.extend(encoding.ids)
        ids.append(eos)  # files separated by eos, as documents are
    stream = torch.tensor(ids, dtype=torch.long)
    times["tokenizer_s"] = time.monotonic() - began
    print(f"demo pair: {len(texts)} stdlib files, {sum(map(len, texts)) / 1e6:.1f} MB -> {stream.numel()} tokens "
          f"(vocab {len(tokenizer)}); held out: {', '.join(p.name for p in held_files)}", flush=True)

    config = target_config(recipe, tokenizer)
    model, times["target_s"] = train_target(recipe, stream, config, device)
    saved = getattr(torch, recipe.weights_dtype)
    target_dir = work / "target"
    model.to("cpu", saved).save_pretrained(target_dir)
    model.to(device, torch.float32)  # the saved weights, rounded, from here on: the drafter learns them
    tokenizer.save_pretrained(target_dir)

    raw = drafter_config(config, recipe, mask_token_id=tokenizer.convert_tokens_to_ids(MASK))
    drafter = DFlashDrafter(DrafterSpec.from_dict(raw))
    began = time.monotonic()
    data = DrafterData.from_target(model, stream.to(device), recipe)
    times["drafter_data_s"] = time.monotonic() - began
    times["drafter_s"] = train_drafter(drafter, model, data, recipe)
    save_drafter(drafter.eval().to("cpu", saved), work / "drafter", raw)

    with (work / "prompts.jsonl").open("w") as handle:
        for record in held_out_prompts(held_files):
            handle.write(json.dumps(record) + "\n")
    record = recipe.key() | {"built_with": built_with(torch.get_num_threads() if threads is None else threads)}
    (work / "recipe.json").write_text(json.dumps(record, indent=2) + "\n")  # last: the pair is complete
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)
    return times


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.demo_pair FOLDER``: train the demo target, drafter and held-out prompts there (once)."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_pair", description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--quick", action="store_true", help="a few seconds of training (tests), not the demo recipe")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    args = parser.parse_args(argv)
    recipe = QUICK if args.quick else DemoRecipe()
    if not args.force and is_current(args.folder, recipe):
        print(f"{args.folder} is up to date (recipe.json matches); --force rebuilds it")
        return 0
    print(f"demo pair: training into {args.folder} on {args.threads} CPU threads (once; cached afterwards)", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    times = build(args.folder, recipe, threads=args.threads)
    total = sum(times.values())
    print(f"wrote {args.folder}/target, drafter, prompts.jsonl in {total:.0f}s "
          f"({', '.join(f'{k[:-2]} {v:.0f}s' for k, v in times.items())})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


