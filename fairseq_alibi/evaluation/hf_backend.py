"""The Hugging Face backend of the evaluation runner (``--hf``).

A transformers model (a local directory or a hub name: BLOOM, MPT, Falcon
with ALiBi, or a model exported by ``alibi-export-hf``) loaded by
``hf.load_hf_model``, each method applied with ``hf.apply_alibi_scaling``,
text read through the model's own tokenizer.  For perplexity, DATA is a raw
text file or a ``fairseq-preprocess`` directory (its ``--subset`` split, read
back as words), scored in the windows ``fairseq-eval-lm`` would use.

The perplexity text of an exported fairseq model is read as fairseq reads it:
each line, then ``</s>`` (as ``fairseq-preprocess`` binarizes a line), with
``</s>`` before the first (what ``fairseq-eval-lm`` feeds before the data), and
words its tokenizer does not know are ``<unk>``, scored as ``fairseq-eval-lm``
scores them (their count is logged): the checkpoint and its export give the
same numbers on the same text.  Prompts (``alibi-retrieval``) never hold an
unknown word: an unanswerable prompt is refused, never scored.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

from ..core.scaling import Scaling
from ..errors import EvaluationError, plural
from ..inputs import check_text
from .data_dir import split_text
from .prompts import Vocabulary
from .axes import parse_named
from .protocols import Described, ModelInfo, ScoredWindow, answer_result
from .store import file_identity

logger = logging.getLogger("fairseq_alibi.evaluation")


def model_identity(model: str) -> str:
    """A directory's files (names, sizes, mtimes) or a hub name: a stored cell
    is reused only while these are unchanged."""
    if not os.path.isdir(model):
        return f"hub:{model}"
    parts = []
    for entry in sorted(os.listdir(model)):
        st = os.stat(os.path.join(model, entry))
        parts.append(f"{entry}={st.st_size}:{st.st_mtime_ns}")
    return f"{os.path.abspath(model)}:{hashlib.sha1(';'.join(parts).encode()).hexdigest()[:16]}"


class HFEncoder:
    """Text -> token ids through the model's own tokenizer (no dictionary to check);
    ``by_lines``: the perplexity text as fairseq reads it (an exported fairseq model)."""

    subword = True

    def __init__(self, tokenizer, by_lines: bool = False):
        self.tokenizer = tokenizer
        bos = tokenizer.bos_token_id
        self.prefix = [bos] if bos is not None else []  # as fairseq prepends its eos
        self.by_lines = by_lines and tokenizer.eos_token_id is not None
        self._text: Optional[Tuple[str, List[int]]] = None

    def encode_text(self, text: str) -> List[int]:
        """The perplexity text's ids, encoded once: the plan counts them, the cells score them.
        Unknown words are the tokenizer's unknown token here (scored, as fairseq-eval-lm
        scores ``<unk>``); ``by_lines``: ``</s>``, then each line followed by ``</s>``."""
        if self._text is None or self._text[0] is not text:
            if self.by_lines:
                eos = self.tokenizer.eos_token_id
                lines = text.split("\n")  # the lines fairseq-preprocess reads (after universal newlines)
                if lines[-1] == "":
                    lines.pop()
                ids = [eos]
                for line in lines:
                    ids += self._ids(line) + [eos]
            else:
                ids = self._ids(text)
            self._text = (text, ids)
        return self._text[1]

    def unknown(self, ids: Sequence[int]) -> int:
        """How many of ``ids`` are the tokenizer's unknown token."""
        unk = self.tokenizer.unk_token_id
        return 0 if unk is None else sum(1 for i in ids if i == unk)

    def _ids(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def vocabulary(self) -> Vocabulary:
        return Vocabulary(None)

    def words(self, words: Sequence[str]) -> List[int]:
        return self.encode(" ".join(words))

    def encode(self, text: str, where: str = "") -> List[int]:
        """A prompt's ids; a word the tokenizer reads as unknown is refused (an unanswerable
        or altered prompt is never scored)."""
        ids = self._ids(text)
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            missing = sorted({w for w in text.split()
                              if unk in self.tokenizer(w, add_special_tokens=False)["input_ids"]})
            raise EvaluationError(
                f"{where}{len(missing)} {plural(len(missing), 'word')} the model's tokenizer reads as "
                f"{self.tokenizer.unk_token}: "
                f"{', '.join(missing[:20])}; rewrite them with words it knows (none is silently unknown)"
            )
        return ids


class HFBackend:
    """Hugging Face causal LMs with ALiBi; for perplexity DATA is a text file or a data directory."""

    def __init__(self, args, subset: Optional[str] = None, beside_checkpoints: bool = False):
        """``subset``: perplexity, DATA a text file or a fairseq-preprocess directory (its
        ``subset``); without, prompts, and DATA only beside fairseq checkpoints (their dictionary)."""
        self.cpu, self.dtype, self.train_length = args.cpu, args.dtype, args.train_length
        self.quiet = getattr(args, "no_progress", False) or not sys.stderr.isatty()  # no bars in a log
        if args.train_length is not None and args.train_length < 1:
            raise EvaluationError(f"--train-length {args.train_length} is not valid: a positive number of tokens")
        self.text = None
        if subset is not None:
            if args.data and os.path.isdir(args.data):
                self.text, read = split_text(args.data, subset), os.path.join(args.data, f"{subset}.bin")
            else:
                self.text, read = read_text(args.data), args.data
            self.data_identity = f"{os.path.abspath(read)}={file_identity(read)}|{args.dtype}"
        elif args.data and not beside_checkpoints:
            raise EvaluationError("--hf models read their prompts through their own tokenizer: give no DATA "
                                  "directory with --hf")
        else:
            self.data_identity = f"hf|{args.dtype}"

    def specs(self, args) -> List[Tuple[str, str]]:
        """``[NAME=]MODEL`` (a directory or a hub name)."""
        return parse_named(args.hf, lambda m: os.path.basename(os.path.normpath(m)) or m, "models")

    def describe(self, name: str, spec: str) -> Described:
        """The model's config and tokenizer only: its weights are loaded by ``load``,
        one model at a time."""
        from .. import hf

        config, tokenizer = hf.load_hf_config(spec, progress=not self.quiet)
        family = hf.config_family(config)  # refuses anything but the supported ALiBi families
        train_length = self.train_length or hf.hf_train_length(config)
        arch = (getattr(config, "architectures", None) or [config.model_type])[0]
        position = hf.position_method(config)
        info = ModelInfo(name, spec, f"hf:{family}", arch, None if position == "sinusoidal" else position, train_length,
                         f"{model_identity(spec)}|L={self.train_length}",
                         " (the model's config does not record its training length: pass --train-length L)",
                         hf.extensions_of(family, position))
        return Described(info, HFEncoder(tokenizer, by_lines=family == hf.EXPORTED))

    def text_tokens(self, described: Described) -> int:
        """Tokens of the text after its first (which no window scores): the longest window."""
        ids = described.encoder.encode_text(self.text)
        unknown = described.encoder.unknown(ids)
        if unknown:
            logger.info("%s: %d of the text's %d tokens are %s (words its tokenizer does not know); they are scored, "
                        "as fairseq-eval-lm scores <unk>", described.info.name, unknown, len(ids) - 1,
                        described.encoder.tokenizer.unk_token)
        return len(ids) - 1

    def load(self, described: Described, max_length: int) -> "HFModel":
        from .. import hf

        model, _ = hf.load_hf_model(described.info.path, device="cpu" if self.cpu else _device(),
                                    dtype=self.dtype, progress=not self.quiet)
        hf.resolve(model)  # a Falcon loaded with flash attention is refused before any cell runs
        note, warning = hf.loaded_notes(described.info.path, model)  # what the numbers are of
        logger.info("%s: %s", described.info.name, note)
        if warning:
            logger.warning("%s: %s", described.info.name, warning)
        return HFModel(described, model, self.text)


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def read_text(path: Optional[str]) -> str:
    """The text of ``alibi-sweep --hf DATA`` (``inputs.check_text``: UTF-8, not empty;
    a UTF-8 byte-order mark is skipped)."""
    if not path or not os.path.exists(path):
        raise EvaluationError(f"with --hf, DATA is a raw text file or a fairseq-preprocess directory; {path} is "
                              "neither")
    check_text(path, "text file", bom_ok=True)
    with open(path, encoding="utf-8-sig") as handle:
        return handle.read()


class HFModel:
    """One Hugging Face model, loaded once, under one method at a time."""

    def __init__(self, described: Described, model, text: Optional[str] = None):
        self.info, self.model, self.encoder = described.info, model, described.encoder
        self.text = text  # the perplexity text (alibi-sweep), encoded on first use
        self.method = Scaling()
        self.tokens = None

    def use(self, method: Scaling) -> None:
        """Evaluate under ``method`` (complete: the runner's ``methods_for``) from now on."""
        from .. import hf

        hf.apply_alibi_scaling(self.model, method)
        self.method = method

    def close(self) -> None:
        from .. import hf

        hf.remove_alibi_scaling(self.model)
        self.model = None

    def effective_factor(self, length: int) -> float:
        return self.method.factor_at(length)

    def answer_scores(self, batch: Sequence[Tuple[List[int], List[int]]]) -> List[Tuple[bool, float, List[int]]]:
        """Greedy exact match and the answer's mean log-probability, one teacher-forced
        forward per sequence (the tokenizer's bos prepended where it has one)."""
        import torch

        from .. import hf

        _, base = hf.resolve(self.model)
        head = self.model.get_output_embeddings()
        device = next(self.model.parameters()).device
        out = []
        with torch.inference_mode():
            for prompt, answer in batch:
                ids = torch.tensor(self.encoder.prefix + list(prompt) + list(answer[:-1]), device=device)[None]
                hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0, -len(answer):]
                out.append(answer_result(head(hidden).float().log_softmax(-1), answer))
        return out

    def windows(self, length: int, stride: int, max_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> Tuple[int, Iterator]:
        """(tokens to score, iterator of :class:`ScoredWindow`, in the text's order), one
        window per forward (``max_tokens`` and ``batch_size`` do not apply):
        every token after the first scored once, in blocks of ``stride`` tokens,
        each predicted with the ``length - stride`` tokens before the block as
        extra context (at most ``length`` inputs per window): the windows of
        ``fairseq-eval-lm --tokens-per-sample length --context-window (length - stride)``."""
        if self.tokens is None:
            import torch

            self.tokens = torch.tensor(self.encoder.encode_text(self.text), dtype=torch.long)
        if self.tokens.numel() < 2:
            raise EvaluationError(f"{self.info.name}: the text has fewer than 2 tokens")
        return self.tokens.numel() - 1, self._scored(length, stride)

    def _scored(self, length: int, stride: int):
        import torch

        from .. import hf

        tokens, n, context = self.tokens, self.tokens.numel(), length - stride
        end, index = 1, 0  # tokens before `end` are scored (token 0 has no context)
        while end < n:
            new_end = min(end + stride, n)  # this window scores tokens end .. new_end - 1
            begin = max(0, end - 1 - context)  # its inputs: begin .. new_end - 2
            logprobs = token_log_probs(self.model, tokens[begin: new_end - 1], next_token=int(tokens[new_end - 1]))
            scored = logprobs[-(new_end - end):]
            positions = torch.arange(logprobs.numel() - scored.numel(), logprobs.numel())
            yield ScoredWindow(index, scored, positions, tokens[end:new_end])
            end, index = new_end, index + 1

    def command(self, length: int, stride: int, max_tokens: Optional[int] = None,
                batch_size: Optional[int] = None) -> str:
        return (f"alibi-sweep TEXT --hf {self.info.name}={self.info.path} --lengths {length}"
                + (f" --modes sliding --stride {stride}" if stride != length else ""))


def token_log_probs(model, input_ids, chunk: int = 1024, next_token: Optional[int] = None):
    """float32 ``[T-1]``: log-probability of each next token, teacher-forced, one forward.

    ``input_ids`` is ``[T]`` or ``[1, T]`` (a tensor or a list of ids).  With ``next_token`` (the token
    after the input) the result is ``[T]``: the last position's prediction is
    scored too, so a window of T tokens scores T of them over T keys (what a
    fairseq LM window does).  For BLOOM, MPT and Falcon the
    vocabulary projection runs ``chunk`` positions at a time, so long inputs do
    not materialize ``T x vocab`` logits in float32 at once.
    """
    import torch

    from .. import hf
    from ..errors import UnsupportedModelError

    input_ids = torch.as_tensor(input_ids, dtype=torch.long) if not isinstance(input_ids, torch.Tensor) else input_ids
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"token_log_probs takes one sequence, got a batch of {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() < (1 if next_token is not None else 2):
        raise ValueError(f"token_log_probs needs a [T] sequence of at least 2 tokens, got {tuple(input_ids.shape)}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no language-model head; load it with AutoModelForCausalLM")
    device = next(model.parameters()).device
    tokens = input_ids.to(device)[None, :]
    targets = tokens[0, 1:]
    keep = tokens.shape[1] - 1  # positions whose prediction is scored
    if next_token is not None:
        targets = torch.cat([targets, torch.tensor([next_token], device=device)])
        keep += 1
    try:
        family, base = hf.resolve(model)
    except UnsupportedModelError:
        family = None
    with torch.inference_mode():
        if family is None:  # any other causal LM: its own logits
            logits = model(input_ids=tokens, use_cache=False).logits[0, :keep].float()
            return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0].cpu()
        hidden = base(input_ids=tokens, use_cache=False).last_hidden_state[0, :keep]
        pieces = []
        for start in range(0, hidden.shape[0], chunk):
            logits = head(hidden[start : start + chunk]).float()
            pieces.append(logits.log_softmax(-1).gather(-1, targets[start : start + chunk, None])[:, 0])
        return torch.cat(pieces).cpu()
