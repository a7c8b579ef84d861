"""Turning text into fixed-length token tensors, without ever downloading anything.

Two tokenizers share one small interface (``vocab_size``, ``pad_token_id``,
``bos_token_id``, ``eos_token_id``, ``encode_batch``, ``decode``):

- :class:`ByteTokenizer`, dpclip's builtin: the 256 UTF-8 byte values plus pad, bos and
  eos. It needs no files, handles any language, and is what the tests and the builtin
  synthetic text use.
- :class:`HFTokenizer`, a thin wrapper around a Hugging Face tokenizer loaded from a
  local directory (or the local cache) with ``local_files_only=True``.

Every batch is right-padded (or truncated) to ``max_length``, so the data set is a pair of
dense ``[N, max_length]`` tensors and a causal-LM's real tokens always sit at positions
0..L-1, whatever the padding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpclip.errors import DpclipError


class ByteTokenizer:
    """UTF-8 bytes 0..255 are tokens 0..255; then pad (256), bos (257) and eos (258).

    ``encode`` wraps the text as ``bos, bytes..., eos`` so a causal LM learns where a
    sentence starts and ends. A text longer than ``max_length`` keeps its beginning
    (and loses its eos).
    """

    name = "byte"
    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """Token ids of one text, truncated to ``max_length`` when given."""
        ids = [self.bos_token_id, *text.encode("utf-8"), self.eos_token_id]
        return ids if max_length is None else ids[:max_length]

    def encode_batch(self, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both int64 ``[len(texts), max_length]``, right-padded."""
        input_ids = torch.full((len(texts), max_length), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(texts), max_length), dtype=torch.int64)
        for row, text in enumerate(texts):
            ids = self.encode(text, max_length)
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            attention_mask[row, : len(ids)] = 1
        return input_ids, attention_mask

    def decode(self, ids) -> str:
        """Text of a sequence of ids; special tokens are dropped.

        Truncation can cut a multi-byte character in half, so invalid bytes become
        U+FFFD instead of raising.
        """
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer behind the same interface as :class:`ByteTokenizer`.

    The wrapped tokenizer is ``hf_tokenizer``. Tokenizers without a pad token (GPT-2's)
    pad with their eos token; the attention mask, not the token id, says what is padding.
    """

    def __init__(self, hf_tokenizer, name: str):
        if hf_tokenizer.pad_token is None:
            if hf_tokenizer.eos_token is None:
                raise DpclipError(f"tokenizer {name!r} has neither a pad nor an eos token",
                                  "add a pad token to the tokenizer and save it again, or use tokenizer: byte")
            hf_tokenizer.pad_token = hf_tokenizer.eos_token
        # Right padding keeps each example's real tokens at positions 0..L-1.
        hf_tokenizer.padding_side = "right"
        self.hf_tokenizer = hf_tokenizer
        self.name = name

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens; .vocab_size does not, and ids can reach len() - 1.
        return len(self.hf_tokenizer)

    @property
    def pad_token_id(self) -> int:
        return self.hf_tokenizer.pad_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf_tokenizer.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf_tokenizer.eos_token_id

    def encode_batch(self, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), both int64 ``[len(texts), max_length]``, right-padded."""
        encoded = self.hf_tokenizer(list(texts), max_length=max_length, truncation=True,
                                    padding="max_length", return_tensors="pt")
        return encoded["input_ids"].to(torch.int64), encoded["attention_mask"].to(torch.int64)

    def decode(self, ids) -> str:
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` gives the builtin tokenizer; anything else is a local directory or a
    tokenizer already in the Hugging Face cache (nothing is downloaded)."""
    if spec == "byte":
        return ByteTokenizer()
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as exc:
        where = "the directory exists but holds no tokenizer" if Path(spec).is_dir() \
            else "it is not a local directory and not in the Hugging Face cache"
        raise DpclipError(f"cannot load tokenizer {spec!r}: {where} ({exc.__class__.__name__})",
                          "use tokenizer: byte, or save a tokenizer with save_pretrained(DIR) and give DIR; "
                          "loading by hub name needs network or a local cache") from None
    return HFTokenizer(hf_tokenizer, spec)
