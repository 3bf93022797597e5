"""A GGUF file's vocabulary as a `tokenizers.Tokenizer` (transformers' GGUF conversion), with the
BOS / EOS the model expects applied by its post-processor, and the tokenizer settings; the
conversion is cached by a hash of the metadata (models/gguf_loader.py reads the rest of the file).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, processors

from twostep.models.gguf_file import GGUFFile, StringArray, metadata_field

logger = logging.getLogger(__name__)

_TOKENIZER_CACHE_FORMAT = 1     # bump when build_tokenizer changes what it makes of the metadata


def _gguf_tokenizer_converter():
    """transformers' GGUF tokenizer conversion; it moved from integrations.ggml in transformers 5."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    return GGUF_TOKENIZER_MAPPING["tokenizer"], convert_gguf_tokenizer


def build_tokenizer(reader: GGUFFile, path: str, tokens: Sequence[str],
                     special: dict[str, int | None]) -> tuple[Tokenizer, dict]:
    strings = {name: None if special[name] is None else tokens[special[name]]
               for name in ("bos", "eos", "unk", "pad")}
    add_bos, add_eos = _add_bos_eos(reader, path, special)
    tokenizer_config = {
        "bos_token": strings["bos"],
        "eos_token": strings["eos"],
        "unk_token": strings["unk"],
        "pad_token": strings["pad"],
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": metadata_field(reader, "tokenizer.chat_template", path, None),
    }
    cache = _tokenizer_cache_file(reader)
    if cache is not None and cache.is_file():
        try:
            return Tokenizer.from_file(str(cache)), tokenizer_config
        except Exception:  # noqa: BLE001 - a damaged cache entry: convert again
            logger.warning("ignoring the unreadable cached tokenizer %s", cache)
    tokenizer = _convert_vocabulary(reader, path, special)
    # HF's tokenizer class registers these as special tokens on top of the vocabulary, so they are
    # matched whole in text and dropped by decode(skip_special_tokens=True); do the same.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in dict.fromkeys(strings.values()) if t is not None])
    bos = (strings["bos"], special["bos"]) if add_bos else None
    eos = (strings["eos"], special["eos"]) if add_eos else None
    tokenizer.post_processor = _special_token_template(bos, eos)
    if cache is not None:
        _save_atomically(tokenizer, cache)
    return tokenizer, tokenizer_config


def _tokenizer_cache_file(reader: GGUFFile) -> Path | None:
    """Where the tokenizer converted from this metadata is kept (the conversion imports transformers
    and takes seconds; reading it back, milliseconds): $TWOSTEP_CACHE_DIR, else
    $XDG_CACHE_HOME/twostep or ~/.cache/twostep, under a hash of the metadata and the versions of
    the libraries that convert it. None: caching switched off (TWOSTEP_CACHE_DIR="")."""
    root = os.environ.get("TWOSTEP_CACHE_DIR")
    if root == "":
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "twostep")
    versions = "-".join(_version(p) for p in ("transformers", "tokenizers"))
    key = hashlib.sha256(f"{reader.metadata_digest()} {versions} {_TOKENIZER_CACHE_FORMAT}".encode()).hexdigest()
    return Path(root) / "gguf-tokenizers" / f"{key[:32]}.json"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _save_atomically(tokenizer: Tokenizer, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        tokenizer.save(str(partial))
        os.replace(partial, target)
    except OSError as e:                # a read-only home: convert every time
        logger.info("tokenizer not cached (%s)", e)


def _convert_vocabulary(reader: GGUFFile, path: str, special: dict[str, int | None]) -> Tokenizer:
    """transformers' conversion of the file's vocabulary (and merges) into a fast tokenizer."""
    key_names, convert = _gguf_tokenizer_converter()
    # The same metadata transformers' from_pretrained hands to the converter, except that the
    # out-of-range special ids are dropped: transformers' own reading of them crashes.
    tokenizer_dict = {name: metadata_field(reader, f"tokenizer.{key}", path, None) for key, name in key_names.items()}
    tokenizer_dict = {name: list(value) if isinstance(value, StringArray) else value    # decoded, all
                      for name, value in tokenizer_dict.items()}
    tokenizer_dict = {name: value for name, value in tokenizer_dict.items()
                      if value is not None and not name.endswith("_token_id")}
    tokenizer_dict |= {f"{name}_token_id": special[name] for name in ("bos", "eos", "unk", "pad")
                       if special[name] is not None}
    tokenizer, _ = convert(metadata_field(reader, "general.architecture", path), tokenizer_dict)
    return tokenizer


def _add_bos_eos(reader: GGUFFile, path: str, special: dict[str, int | None]) -> tuple[bool, bool]:
    """Whether the model expects BOS / EOS around every text: the file's flags if it has them, else
    llama.cpp's defaults (BOS for a sentencepiece vocabulary only, never EOS)."""
    sentencepiece = metadata_field(reader, "tokenizer.ggml.model", path) == "llama"
    add_bos = bool(metadata_field(reader, "tokenizer.ggml.add_bos_token", path, sentencepiece))
    add_eos = bool(metadata_field(reader, "tokenizer.ggml.add_eos_token", path, False))
    # a flag naming a token the file does not have cannot be honoured
    return add_bos and special["bos"] is not None, add_eos and special["eos"] is not None


def _special_token_template(bos: tuple[str, int] | None,
                            eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """The post-processor HF's tokenizer uses: [BOS] text [EOS], each only if given.

    Set explicitly because the converted tokenizer's own template ignores the file's add_bos flag.
    """
    prefix = [bos[0]] if bos else []
    suffix = [eos[0]] if eos else []
    return processors.TemplateProcessing(
        single=prefix + ["$A:0"] + suffix,
        pair=prefix + ["$A:0"] + suffix + prefix + ["$B:1"] + suffix,
        # deduplicated: a few vocabularies use one token for both
        special_tokens=list(dict(t for t in (bos, eos) if t).items()),
    )
