"""The real Qwen and Llama 3.2 tokenizers, every added token of each, and the fragments the
property tests build their texts from (test_segment_counts.py, test_prefix_bound_properties.py):
words, whitespace and line breaks, composed and decomposed characters, and pieces of added
tokens."""

from __future__ import annotations

from tokenizers import Tokenizer

from tests.conftest import model_dir

FRAGMENTS = [
    "hello",
    " world",
    "The",
    "'s",
    "'ll",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "é",
    "e\u0301",  # e + combining acute: NFC composes it (Qwen's normalizer)
    "ﬁ",
    "Å",
    "日本語",
    "🙂",
    "12345",
    "3.14",
    "<",
    "|",
    ">",
    "<|",
    "|>",
    "<|im_",
    "_start|>",
    "<|eot",
    "user\n",
    "assistant\n",
]
TOKENIZERS = {
    name: Tokenizer.from_file(str(model_dir(name) / "tokenizer.json"))
    for name in ("qwen", "llama3.2")
}
ADDED = {
    name: sorted(t.content for t in tok.get_added_tokens_decoder().values())
    for name, tok in TOKENIZERS.items()
}
