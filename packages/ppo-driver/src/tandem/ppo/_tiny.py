"""A tiny character-level tokenizer built locally: no downloads, for the demo and the tests.

Every character of the vocabulary is one token (so each digit is exactly one
token, which keeps arithmetic tasks learnable by a tiny model); characters
outside it become `<unk>`. The chat template writes each message as
`<s>role: content</s>` plus a newline and, with `add_generation_prompt`, opens
`<s>assistant: ` so that the model's answer follows; the model ends it with `</s>`.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens, with ids 0..3 in this order."""

CHARACTERS = string.digits + string.ascii_lowercase + " \n+-*/=?:,.()\\{}"
"""Ordinary tokens, one per character, with ids from 4 on."""

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<s>{{ m['role'] }}: {{ m['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
"""Jinja chat template: one `<s>role: content</s>` line per message, then `<s>assistant: `."""


def build_tiny_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer; with `out_dir`, also save it there (`save_pretrained`).

    The vocabulary holds the special tokens (`<pad>`, `<s>`, `</s>`, `<unk>`),
    digits, lowercase letters, space, newline and a few symbols: 56 tokens.
    `decode(ids, skip_special_tokens=True)` gives the text back, characters joined
    without separators.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    # BPE without merges and without a pre-tokenizer splits text into single characters.
    model = models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN, fuse_unk=False)
    backend = Tokenizer(model)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
