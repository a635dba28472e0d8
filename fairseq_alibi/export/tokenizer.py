"""The exported tokenizer: ids exactly as fairseq's, fed as ``fairseq-eval-lm`` feeds them.

* Word-level dictionaries (no ``--bpe``): a ``tokenizers`` WordLevel model whose
  vocabulary is the fairseq ``Dictionary`` itself (``<s>`` 0, ``<pad>`` 1,
  ``</s>`` 2, ``<unk>`` 3, then ``dict.txt`` in order, ``madeupword`` padding
  included), split on whitespace as fairseq's ``tokenize_line``.
* GPT-2 BPE (``--bpe gpt2``): byte-level BPE with GPT-2's merges, each piece
  mapped to the fairseq id of its GPT-2 id (fairseq's dictionary holds GPT-2 ids
  as words).  A piece the dictionary lacks is ``<unk>`` in fairseq; a BPE
  vocabulary cannot give two pieces one id, so such pieces get the ids after
  the dictionary's, which the exported model reads as ``<unk>``
  (``unk_aliases`` in its config).

Either way a post-processor puts first the token fairseq's inference puts
before a prompt (``task.build_dataset_for_inference``): the end-of-sentence
token ``</s>``, which a fairseq LM reads before the first token of its data (and
of every line after the first), or ``<s>`` for a model trained with
``--add-bos-token``.  ``bos_token`` is that token too, so tools that prepend
the tokenizer's BOS prepend what fairseq does.  The special symbols are read
as whole words only, as fairseq reads them.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

from ..errors import ExportError, one_line
from ..inputs import check_text

#: The class ``tokenizer_config.json`` names: the stock fast tokenizer under the name
#: docs/export.md gives (transformers 5 saves its new name for the same class,
#: ``TokenizersBackend``, which older releases do not know).
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

#: The fairseq BPE schemes whose tokenizer can be exported, and the files each needs.
BPE_FILES = {"gpt2": ("gpt2_encoder_json", "gpt2_vocab_bpe")}


def fairseq_whitespace():
    """A pre-tokenizer that splits where fairseq's ``tokenize_line`` does: on runs of
    Python's whitespace (``str.isspace``), which includes four separators
    (U+001C..U+001F) that tokenizers' ``WhitespaceSplit`` keeps inside words."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Split(Regex(f"[{_python_spaces()}]+"), behavior="removed")


@functools.lru_cache(maxsize=None)
def _python_spaces() -> str:
    """Every code point ``str.isspace`` holds, as regex escapes (a scan of all
    of Unicode: a second or more, so once per process)."""
    return "".join(f"\\x{{{c:X}}}" for c in range(sys.maxunicode + 1) if chr(c).isspace())


def _finish(tokenizer, dictionary, start: int):
    """Specials, the post-processor that puts ``start`` (fairseq's token before a
    prompt) first, and the transformers wrapper."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    first = dictionary[start]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A", pair=f"{first} $A $B:1", special_tokens=[(first, start)])
    # fairseq reads "</s>" as a symbol only as a word of its own: "a</s>b" and "</s>." are one (unknown) word
    # each, and GPT-2's BPE never reads it as a symbol.  An added token matches by its neighbours' letters only
    # (single_word), so text is not split at the specials at all (split_special_tokens): they reach the
    # pre-tokenizer and the vocabulary as fairseq's words do.
    special = {word: AddedToken(word, special=True, single_word=True, normalized=False) for word in
               (dictionary.bos_word, dictionary.pad_word, dictionary.eos_word, dictionary.unk_word)}
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=special[first], eos_token=special[dictionary.eos_word],
        pad_token=special[dictionary.pad_word], unk_token=special[dictionary.unk_word], padding_side="left",
        additional_special_tokens=[special[w] for w in (dictionary.bos_word,) if w != first],
        split_special_tokens=True,
    )
    for word, index in ((first, start), (dictionary.eos_word, dictionary.eos()),
                        (dictionary.pad_word, dictionary.pad()), (dictionary.unk_word, dictionary.unk()),
                        (dictionary.bos_word, dictionary.bos())):
        if wrapped.convert_tokens_to_ids(word) != index:
            raise ExportError(f"the tokenizer maps {word} to {wrapped.convert_tokens_to_ids(word)}, "
                              f"fairseq to {index}: a bug, please report it")
    return wrapped


def word_level(dictionary, start: int):
    """A WordLevel tokenizer with the fairseq dictionary's ids, ``start`` first."""
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel(vocab=dict(dictionary.indices), unk_token=dictionary.unk_word))
    tokenizer.pre_tokenizer = fairseq_whitespace()
    return _finish(tokenizer, dictionary, start)


def read_gpt2_files(encoder_json: str, vocab_bpe: str) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    """GPT-2's ``encoder.json`` (piece -> GPT-2 id) and ``vocab.bpe`` merges, checked."""
    check_text(encoder_json, "GPT-2 encoder.json")
    check_text(vocab_bpe, "GPT-2 vocab.bpe")
    try:
        with open(encoder_json, encoding="utf-8") as f:
            encoder = json.load(f)
        with open(vocab_bpe, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read the GPT-2 BPE files: {one_line(exc)}") from None
    if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
        raise ExportError(f"{encoder_json} is not GPT-2's encoder.json (a JSON object of piece -> id)")
    merges = [tuple(line.split()) for line in lines[1:] if line.strip()]  # line 0: "#version"
    if not all(len(m) == 2 for m in merges):
        raise ExportError(f"{vocab_bpe} is not GPT-2's vocab.bpe (one merge 'a b' per line after #version)")
    return encoder, merges


def gpt2(dictionary, start: int, encoder_json: str, vocab_bpe: str):
    """Byte-level BPE whose pieces carry fairseq ids, ``start`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    encoder, merges = read_gpt2_files(encoder_json, vocab_bpe)
    vocab = {piece: dictionary.indices[str(index)] for piece, index in encoder.items()
             if str(index) in dictionary.indices}
    lacking = sorted((piece for piece in encoder if piece not in vocab), key=encoder.get)
    vocab.update({piece: len(dictionary) + k for k, piece in enumerate(lacking)})  # read as <unk>
    for index in range(dictionary.nspecial):
        vocab[dictionary[index]] = index
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=dictionary.unk_word))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return _finish(tokenizer, dictionary, start)


def bpe_paths(bpe_cfg, given: Dict[str, Optional[str]]) -> Dict[str, str]:
    """The files of the checkpoint's BPE: given on the command line, else the
    paths its config records if they exist here; one line naming what is missing."""
    name = bpe_cfg.get("_name")
    if name not in BPE_FILES:
        raise ExportError(f"this checkpoint was trained with --bpe {name}; alibi-export-hf writes tokenizers for "
                          f"word-level dictionaries and --bpe {', '.join(BPE_FILES)} only")
    found, missing = {}, []
    for field in BPE_FILES[name]:
        path = given.get(field) or bpe_cfg.get(field)
        if path and os.path.isfile(path):
            found[field] = path
        else:
            missing.append(f"--{field.replace('_', '-')} PATH" + (f" (recorded: {path})" if path else ""))
    if missing:
        raise ExportError(f"this checkpoint was trained with --bpe {name}; give its BPE files: {', '.join(missing)}")
    return found


def build_tokenizer(source, given_bpe: Dict[str, Optional[str]]):
    """The tokenizer of ``source``: word-level, or its BPE where the files are given."""
    bpe_cfg = source.cfg.get("bpe") if hasattr(source.cfg, "get") else None
    if not bpe_cfg or not bpe_cfg.get("_name"):
        return word_level(source.dictionary, source.start)
    paths = bpe_paths(bpe_cfg, given_bpe)
    return gpt2(source.dictionary, source.start, paths["gpt2_encoder_json"], paths["gpt2_vocab_bpe"])


def save_tokenizer(tokenizer, directory: str) -> None:
    """``tokenizer.save_pretrained(directory)``, its class named :data:`TOKENIZER_CLASS`."""
    tokenizer.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = TOKENIZER_CLASS
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
