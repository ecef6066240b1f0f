"""Offline building blocks for the demo, recipes and tests: a locally built tokenizer and built-in text.

Nothing here touches a model hub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")

DEMO_TEXT = """\
Memory is the quiet limit of every training run. A model that fits comfortably at inference time can run out of
room the moment it starts to learn, because learning keeps more things alive at once: activations saved for the
backward pass, gradients for every weight, the moments of the optimizer, and, at the very end of the network, a
table of scores with one row for every token and one column for every word in the vocabulary.
That last table is easy to forget. For a short sentence it is small, but a language model with a vocabulary of a
hundred thousand words, trained on a few thousand tokens at a time, produces hundreds of millions of scores in a
single step. They are computed, turned into probabilities, compared with the right answers, and thrown away, yet
for a moment they are the largest thing in memory.
The remedy is patience. Instead of scoring every token against every word at once, the work is cut into slices:
a few hundred tokens at a time, scored, reduced to a loss and a gradient, and released before the next slice is
taken. The answer is the same to the last few bits; only the peak is lower.
The same idea applies to the optimizer. A gradient that is used the moment it is computed never needs to be
stored; the update can be applied while the backward pass is still walking through the layer, one tile at a time.
A careful engineer checks every such trick against the plain version: same data, same seed, same numbers. If the
two runs disagree by more than rounding, the trick is wrong, however much memory it saves.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft
zebras jump! Sphinx of black quartz, judge my vow. Two driven jocks help fax my big quiz.
"""


def build_char_tokenizer(text: str = DEMO_TEXT, padding_side: str = "left") -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast`` built locally from ``text`` (specials: pad, bos, eos, unk).

    Example::

        tok = build_char_tokenizer("hello world")
        tok("hello").input_ids
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(text))
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side=padding_side,
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def lm_blocks(tokenizer: Any, text: str, seq_len: int, n_blocks: int) -> list[dict]:
    """``n_blocks`` training examples of ``seq_len`` tokens cut from ``text`` (repeated as needed)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    need = seq_len * n_blocks
    ids = (ids * (need // max(len(ids), 1) + 1))[:need]
    return [
        {"input_ids": ids[i * seq_len:(i + 1) * seq_len], "labels": ids[i * seq_len:(i + 1) * seq_len]}
        for i in range(n_blocks)
    ]


def run_recipe(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a recipe's ``main``; a model, dataset or file that cannot be loaded (offline hub, mistyped path) ends in
    one line naming it and the fix instead of a long traceback.

    Example::

        if __name__ == "__main__":
            sys.exit(run_recipe(main))
    """
    import os
    import sys

    args = sys.argv[1:] if argv is None else argv
    # a path that is not there: said at once, not as a bad hub repo id
    for flag, value in zip(args, args[1:], strict=False):
        if flag in ("--model", "--dataset", "--text", "--enwik8") and value.startswith(("/", "./", "../", "~")) \
                and not os.path.exists(os.path.expanduser(value)):
            print(f"error: {flag} {value}: no such file or directory. Check the path (a hub name has the form "
                  "owner/name).", file=sys.stderr)
            return 2
    try:
        return main(argv)
    except (OSError, ConnectionError) as e:  # (FileNotFoundError and transformers' hub errors are OSErrors)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = ("Check the file's path." if isinstance(e, FileNotFoundError) else  # (a text file, not the hub)
                "A --model/--dataset that is not a local path needs the Hugging Face hub (unset HF_HUB_OFFLINE, check "
                "the network); a file path must exist. Without --model the recipe runs its offline demo.")
        print(f"error: {type(e).__name__}: {first}\n{hint}", file=sys.stderr)
        return 2
