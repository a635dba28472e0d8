"""Hugging Face ALiBi models (BLOOM, MPT, Falcon) in the evaluation grid.

Only the loader and the tokenizer differ from fairseq checkpoints: a
transformers model (a local directory or a hub name) loaded by
``hf.load_hf_model``, each method applied with ``hf.apply_alibi_scaling``, text
tokenized by the model's own tokenizer.  The grid, the cell identities, the
result store and the reports are the fairseq ones.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import List, Optional, Sequence, Tuple

from ..errors import EvaluationError
from .grid import CheckpointInfo, Method, parse_named

def parse_hf_models(specs: Sequence[str]) -> List[Tuple[str, str]]:
    """``[NAME=]MODEL`` (a directory or a hub name) -> (name, model)."""
    return parse_named(specs, lambda m: os.path.basename(os.path.normpath(m)) or m, "models")


def model_identity(model: str, train_length: Optional[int]) -> str:
    """A directory's files (names, sizes, mtimes) or a hub name, and the given
    training length: a stored cell is reused only while these are unchanged."""
    if not os.path.isdir(model):
        return f"hub:{model}|L={train_length}"
    parts = []
    for entry in sorted(os.listdir(model)):
        st = os.stat(os.path.join(model, entry))
        parts.append(f"{entry}={st.st_size}:{st.st_mtime_ns}")
    digest = hashlib.sha1(";".join(parts).encode()).hexdigest()[:16]
    return f"{os.path.abspath(model)}:{digest}|L={train_length}"


class HFModel:
    """One Hugging Face model: loaded once, every method applied in turn."""

    def __init__(self, name: str, model: str, train_length: Optional[int], cpu: bool, dtype=None):
        import torch

        from .. import hf

        device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
        self.model, self.tokenizer = hf.load_hf_model(model, device=device, dtype=dtype)
        family, _ = hf._resolve(self.model)  # refuses anything but BLOOM / MPT / Falcon-ALiBi
        recorded = hf.hf_train_length(self.model.config)
        self.train_length = train_length or recorded
        self.info = CheckpointInfo(
            name=name, path=model, model=f"hf:{family}", arch=type(self.model).__name__,
            alibi=True, train_length=self.train_length, identity=model_identity(model, train_length),
        )

    def scaled(self, method: Method):
        """Context manager: ``method`` applied to the model (undone on exit)."""
        from .. import hf

        if method.name != "none" and method.factor == 0 and not self.train_length:
            raise EvaluationError(
                f"{self.info.name}: dynamic {method.name} needs the training length, which the "
                "model's config does not record; pass --train-length L"
            )
        return hf.alibi_scaling(self.model, method.name, method.factor, self.train_length)

    def encode(self, text: str):
        """1-D LongTensor of the text's tokens (no special tokens added)."""
        import torch

        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def perplexity(self, tokens, length: int, stride: int, method: Method) -> dict:
        """Every token after the first scored once, in blocks of ``stride``
        tokens, each predicted with the ``length - stride`` tokens before the
        block as extra context (at most ``length`` inputs per window): the
        windows of ``fairseq-eval-lm --tokens-per-sample length --context-window
        (length - stride)``; nonoverlapping when ``stride == length``."""
        from .. import hf

        n = tokens.numel()
        if n < 2:
            raise EvaluationError(f"{self.info.name}: the text has fewer than 2 tokens")
        start_time = time.perf_counter()
        total, count = 0.0, 0
        context = length - stride
        with self.scaled(method):
            end = 1  # tokens before `end` are scored (token 0 has no context)
            while end < n:
                new_end = min(end + stride, n)  # this block scores tokens end .. new_end - 1
                begin = max(0, end - 1 - context)  # its inputs: begin .. new_end - 2
                logprobs = hf.token_log_probs(self.model, tokens[begin : new_end - 1],
                                              next_token=int(tokens[new_end - 1]))
                scored = logprobs[-(new_end - end):]
                total += float(scored.double().sum())
                count += scored.numel()
                end = new_end
        loss = -total / count / math.log(2)
        return {"loss": loss, "ppl": 2.0 ** loss, "tokens": count, "seconds": time.perf_counter() - start_time}

    def command(self, length: int, stride: int) -> str:
        return (f"alibi-sweep TEXT --hf {self.info.name}={self.info.path} --lengths {length}"
                + (f" --modes sliding --stride {stride}" if stride != length else ""))


class HFEncoder:
    """Text -> token ids through the model's own tokenizer (``alibi-retrieval
    --hf``), with the interface of ``retrieval.Encoder`` for a subword model."""

    subword = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def vocabulary(self):
        from .prompts import Vocabulary

        return Vocabulary(None)

    def check_words(self, words, where: str = "") -> None:
        """Any text encodes (no dictionary to check against)."""

    def encode(self, text: str, where: str = "") -> List[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            missing = sorted({w for w in text.split()
                              if unk in self.tokenizer(w, add_special_tokens=False)["input_ids"]})
            raise EvaluationError(
                f"{where}{len(missing)} word(s) the model's tokenizer reads as {self.tokenizer.unk_token}: "
                f"{', '.join(missing[:20])}; rewrite them with words it knows (none is silently unknown)"
            )
        return ids


class HFScorer:
    """``retrieval.Scorer`` for a Hugging Face model: greedy exact match and the
    answer's mean log-probability from one teacher-forced forward per sample,
    under one method (applied with ``hf.apply_alibi_scaling``)."""

    def __init__(self, model: HFModel, method: Method):
        self.info, self.method, self.hf_model = model.info, method, model
        bos = model.tokenizer.bos_token_id
        self.prefix = [bos] if bos is not None else []  # as fairseq prepends its eos

    def effective_factor(self, length: int) -> float:
        from ..alibi import resolve_scale_factor

        return resolve_scale_factor(self.method.name, self.method.factor, self.info.train_length, length)

    def score(self, samples) -> List[Tuple[bool, float, List[int]]]:
        import torch

        from .. import hf

        model = self.hf_model.model
        _, base = hf._resolve(model)
        head = model.get_output_embeddings()
        device = next(model.parameters()).device
        out = []
        with self.hf_model.scaled(self.method), torch.inference_mode():
            for s in samples:
                ids = torch.tensor(self.prefix + s.prompt + s.answer[:-1], device=device)[None]
                n = len(s.answer)  # answer token k is predicted at input position T - n + k
                hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0, -n:]
                logprobs = head(hidden).float().log_softmax(-1)
                answer = torch.tensor(s.answer, device=device)
                lp = logprobs.gather(-1, answer[:, None])[:, 0]
                greedy = logprobs.argmax(-1)
                out.append((bool((greedy == answer).all()), float(lp.double().mean()), greedy.tolist()))
        return out
