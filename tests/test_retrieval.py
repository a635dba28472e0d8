"""``alibi-retrieval``: prompt builders, scoring against an independent full forward,
JSONL prompts, resuming, and bad input.

Checkpoints: the session ALiBi fixture (6 heads, trained at 32 tokens on the
conftest corpus; used with JSONL prompts written from that corpus's words) and
a tiny ALiBi LM trained here for a few updates on a synthetic ``lines`` corpus
(``examples/retrieval/corpus.py``), whose dictionary has the
built-in task's words and digits.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
import shutil
import sys

import pytest
import torch

from conftest import EXAMPLES, TRAIN_LENGTH, error_lines, run_cli, tool, train_args, wilson_by_hand

from fairseq_alibi.core.positions import POSITIONS
from fairseq_alibi.evaluation import backends
from fairseq_alibi.evaluation import prompts as P
from fairseq_alibi.evaluation import retrieval
from fairseq_alibi.evaluation.task_files import read_task_file

METHODS = "none,linear:2,ntk"  # none, a static and a dynamic method


# --------------------------------------------------------------------------- builders


@pytest.mark.parametrize("name", ["passkey", "lines"])
def test_builders_hit_length_and_depth(name):
    task = P.make_task(name, P.Vocabulary(None), digits=3)
    header = len(task.words["header"])
    if name == "passkey":
        unit = max(len(s) for s in task.filler)  # one filler sentence
    else:
        unit = len(task.record("k", ["0"] * 3))  # one record
    for length in (task.minimum_length(), 90, 257, 1000, 4096):
        for depth_bin in range(4):
            prompt = task.build(length, depth_bin, 4, random.Random(f"{length}/{depth_bin}"))
            assert length - unit < prompt.length <= length
            assert len(prompt.answer) == 3 and all(w in P.DIGITS for w in prompt.answer)
            # The needle / record holding the answer sits where meta says ...
            at = prompt.meta["needle_offset"]
            if name == "passkey":
                assert prompt.prompt[at:at + 4] == ["The", "pass", "key", "is"]
                assert prompt.prompt[at + 4:at + 7] == prompt.answer
                context = len(prompt.prompt) - header - len(task.words["question"]) - len(task.fill("needle", number=prompt.answer))
            else:
                key = prompt.meta["key"]
                assert prompt.prompt[at:at + 6] == ["line", key, ":", "REGISTER_CONTENT", "is", *prompt.answer[:1]]
                assert prompt.prompt[-5:] == ["line", key, ":", "REGISTER_CONTENT", "is"]
                assert sum(1 for i, w in enumerate(prompt.prompt[:-5]) if w == key) == 2  # record + question
                context = prompt.meta["lines"] * unit
            # ... and its relative position is in the requested depth bin (one unit of slack).
            relative = (at - header) / max(1, context)
            if length >= 257:
                assert depth_bin / 4 - unit / context <= relative <= (depth_bin + 1) / 4 + unit / context, (relative, depth_bin)
    # Deterministic: the same generator state gives the same prompt.
    a = task.build(500, 1, 3, random.Random(7))
    b = task.build(500, 1, 3, random.Random(7))
    assert (a.prompt, a.answer) == (b.prompt, b.answer)


def test_builders_fit_a_closed_vocabulary():
    words = ["line", ":", "REGISTER_CONTENT", "is", ".", "below", "a", "record", "of", "lines", "i", "want",
             "you", "to", "remember", "now", "the", "over", "tell", "me", "in", "apple", "pear", "plum", "fig",
             *P.DIGITS]
    task = P.Lines(P.Vocabulary(words), digits=2)
    assert set(task.keys) == {"apple", "pear", "plum", "fig"}  # dictionary words the template leaves free
    prompt = task.build(task.minimum_length() + 3 * 8, 0, 1, random.Random(1))
    assert prompt.meta["lines"] == 4 and set(prompt.prompt) <= set(words)
    with pytest.raises(P.PromptError, match="needs 5 distinct line keys, the dictionary offers 4"):
        task.build(task.minimum_length() + 4 * 8, 0, 1, random.Random(1))
    # Case adapts (the dictionary is lowercase), missing words are named.
    with pytest.raises(P.PromptError, match=r"not in the model's dictionary: There, an, important"):
        P.Passkey(P.Vocabulary(words + ["is"]))
    # joined numbers are drawn from the dictionary's own number words
    joined = P.Lines(P.Vocabulary(words + ["17", "42"]), digits=2, number_format="joined")
    assert joined.number(random.Random(0))[0] in ("17", "42")


# --------------------------------------------------------------------------- models


def load(path, overrides):
    """The checkpoint as a plain nn.Module, with fairseq's own loader (no plugin code path)."""
    from fairseq import checkpoint_utils

    import fairseq_alibi.models  # noqa: F401  (registers the models, applies patches.py)

    models, _ = checkpoint_utils.load_model_ensemble([str(path)], arg_overrides=overrides)
    return models[0].eval()


def independent_scores(model, eos, prompt, answer):
    """(correct, mean log-prob): full forward of [eos] + prompt + answer[:-1], all logits."""
    tokens = torch.tensor([[eos] + prompt + answer[:-1]])
    with torch.no_grad():
        logits, _ = model(tokens)
    logprobs = torch.log_softmax(logits.float(), dim=-1)[0]
    rows = logprobs[len(prompt):len(prompt) + len(answer)]
    target = torch.tensor(answer)
    correct = bool((rows.argmax(-1) == target).all())
    return correct, float(rows.gather(-1, target[:, None]).mean())


@pytest.fixture(scope="module")
def kv_data_bin(tmp_path_factory):
    """A small synthetic ``lines`` corpus (2-digit numbers, 64 keys), binarized."""
    raw = tmp_path_factory.mktemp("kv")
    run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", raw, "--max-length", "100",
             "--keys", "64", "--digits", "2", "--train-docs", "200", "--valid-docs", "10"])
    dest = raw / "data-bin"
    run_cli([tool("fairseq-preprocess"), "--only-source", "--trainpref", raw / "train.txt",
             "--validpref", raw / "valid.txt", "--destdir", dest, "--workers", "1"])
    return dest


@pytest.fixture(scope="module")
def kv_checkpoint(kv_data_bin, tmp_path_factory):
    """An ALiBi LM of the kv dictionary, trained at 32 tokens for a few updates."""
    save_dir = tmp_path_factory.mktemp("kv_model")
    run_cli([tool("alibi-train"), *train_args(kv_data_bin, save_dir, max_update=5)])
    return save_dir / "checkpoint_last.pt"


@pytest.fixture(scope="module")
def jsonl_prompts(tmp_path_factory):
    """Prompts from the fixture corpus's words at several lengths (some equal, batched together)."""
    from conftest import corpus_line

    rng = random.Random(3)
    items = []
    for i, clauses in enumerate((1, 1, 1, 4, 7, 7, 12, 16)):
        text = " ".join(corpus_line(rng) for _ in range(clauses)).split()
        # the answer: the subject of the last clause ("the cat"), given after its number word
        items.append({"prompt": " ".join(text[:-6]), "answer": " ".join(text[-6:-4]), "group": "ab"[i % 2]})
    path = tmp_path_factory.mktemp("jsonl") / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path, items


@pytest.fixture(scope="module")
def jsonl_run(lm_data_bin, alibi_checkpoint, jsonl_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("ret_jsonl")
    argv = [str(lm_data_bin), "-c", f"alibi={alibi_checkpoint}", "--task", str(jsonl_prompts[0]),
            "--methods", METHODS, "--output-dir", str(out), "--cpu", "--no-progress"]
    assert retrieval.main(argv) == 0
    return out, json.loads((out / "results.json").read_text())["cells"]


@pytest.mark.slow
def test_scores_equal_an_independent_full_forward(jsonl_run, jsonl_prompts, alibi_checkpoint):
    out, cells = jsonl_run
    _, items = jsonl_prompts
    d = load(alibi_checkpoint, {}).decoder.dictionary
    encoded = [([d.index(w) for w in x["prompt"].split()], [d.index(w) for w in x["answer"].split()], x["group"])
               for x in items]
    assert all(d.unk() not in p + a for p, a, _ in encoded)
    checked = 0
    for label, overrides in (("none", {"alibi_interpolation": "none", "alibi_scale_factor": 0.0}),
                             ("linear x2", {"alibi_interpolation": "linear", "alibi_scale_factor": 2.0}),
                             ("ntk dynamic", {"alibi_interpolation": "ntk", "alibi_scale_factor": 0.0})):
        model = load(alibi_checkpoint, overrides)
        for cell in (c for c in cells if c["label"] == label):
            mine = [e for e in encoded if e[2] == cell["group"] and len(e[0]) + len(e[1]) == cell["length"]]
            assert len(mine) == cell["n"] > 0
            expected = [independent_scores(model, d.eos(), p, a) for p, a, _ in mine]
            assert cell["sample_correct"] == [ok for ok, _ in expected]
            assert cell["sample_logprob"] == pytest.approx([lp for _, lp in expected], abs=1e-4)
            assert cell["correct"] == sum(ok for ok, _ in expected)
            assert cell["answer_logprob"] == pytest.approx(sum(lp for _, lp in expected) / len(expected), abs=1e-4)
            checked += len(mine)
    assert checked == 3 * len(items)
    # The prompts go past the training length, where the methods must differ...
    longest = max(c["length"] for c in cells)
    assert longest > 3 * TRAIN_LENGTH
    at = {c["label"]: c for c in cells if c["length"] == longest}
    assert len({round(c["answer_logprob"], 6) for c in at.values()}) == 3
    # ... and dynamic NTK at length T is exactly static NTK with factor T / L.
    static = load(alibi_checkpoint, {"alibi_interpolation": "ntk", "alibi_scale_factor": longest / TRAIN_LENGTH})
    p, a, _ = next(e for e in encoded if len(e[0]) + len(e[1]) == longest)
    assert at["ntk dynamic"]["effective_factor"] == pytest.approx(longest / TRAIN_LENGTH)
    assert at["ntk dynamic"]["sample_logprob"][0] == pytest.approx(independent_scores(static, d.eos(), p, a)[1], abs=1e-4)
    # The model retrieves something and misses something: the comparison above is not vacuous.
    flags = [ok for c in cells for ok in c["sample_correct"]]
    assert any(flags) and not all(flags)


@pytest.mark.slow
def test_an_adaptive_softmax_model_is_scored_by_its_own_softmax(lm_data_bin, jsonl_prompts, tmp_path):
    """The paper's architecture (adaptive softmax, as its published checkpoints): the
    output layer hands back the features and the adaptive softmax gives the log-probs.
    A log_softmax of the features was one over the hidden dimensions: 0% with exit 0
    where every answer id was below d, a traceback where one was not."""
    from conftest import EMBED_DIM

    save = tmp_path / "adaptive"
    run_cli([tool("alibi-train"), *train_args(lm_data_bin, save, max_update=40), "--criterion", "adaptive_loss",
             "--ddp-backend", "legacy_ddp", "--adaptive-softmax-cutoff", "10,20"])
    checkpoint = save / "checkpoint_last.pt"
    out = tmp_path / "ret"
    assert retrieval.main([str(lm_data_bin), "-c", f"a={checkpoint}", "--task", str(jsonl_prompts[0]),
                           "--methods", "none", "--output-dir", str(out), "--cpu", "--no-progress"]) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    model = load(checkpoint, {})
    d = model.decoder.dictionary
    assert model.decoder.adaptive_softmax is not None
    encoded = [([d.index(w) for w in x["prompt"].split()], [d.index(w) for w in x["answer"].split()], x["group"])
               for x in jsonl_prompts[1]]
    assert max(i for _, a, _ in encoded for i in a) < EMBED_DIM  # every answer id below d: the old path's exit 0
    checked = 0
    for cell in cells:
        mine = [e for e in encoded if e[2] == cell["group"] and len(e[0]) + len(e[1]) == cell["length"]]
        for (prompt, answer, _), logprob, correct in zip(mine, cell["sample_logprob"], cell["sample_correct"]):
            tokens = torch.tensor([[d.eos()] + prompt + answer[:-1]])
            with torch.no_grad():
                rows = model.get_normalized_probs(model(tokens), log_probs=True)[0, len(prompt):].float()
            target = torch.tensor(answer)
            assert logprob == pytest.approx(float(rows.gather(-1, target[:, None]).mean()), abs=1e-4)
            assert correct == bool((rows.argmax(-1) == target).all())
            checked += 1
    assert checked == len(encoded)


@pytest.mark.slow
def test_jsonl_outputs_and_groups(jsonl_run, jsonl_prompts):
    out, cells = jsonl_run
    _, items = jsonl_prompts
    assert sum(c["n"] for c in cells) == 3 * len(items)
    assert {c["group"] for c in cells} == {"a", "b"}
    assert all(c["depth"] is None and c["task"] == "prompts.jsonl" for c in cells)
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(cells)
    for field in ("checkpoint", "task", "method", "factor", "length", "depth", "n", "correct", "accuracy",
                  "answer_logprob"):
        assert field in rows[0]
    for row in rows:
        assert float(row["accuracy"]) == pytest.approx(int(row["correct"]) / int(row["n"]), abs=1e-5)
        low, high = wilson_by_hand(int(row["correct"]), int(row["n"]))
        assert (float(row["accuracy_low"]), float(row["accuracy_high"])) == pytest.approx((low, high), abs=1e-5)
    md = (out / "results.md").read_text()
    assert "accuracy % by group" in md
    for label in ("none", "linear x2", "ntk dynamic"):
        pooled = [c for c in cells if c["label"] == label]
        k = sum(c["correct"] for c in pooled if c["group"] == "a")
        n = sum(c["n"] for c in pooled if c["group"] == "a")
        low, high = wilson_by_hand(k, n)  # the interval beside the unchanged accuracy
        assert f"| alibi | {label} | {100 * k / n:.0f} [{100 * low:.0f}, {100 * high:.0f}] ({n}) |" in md
    assert (out / "accuracy.png").stat().st_size > 0
    assert not (out / "depth.png").exists()  # no depths in JSONL prompts


def test_read_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b", "answer": "c", "group": 3}\n\n{"prompt": "d", "answer": "e f"}\n')
    items = read_task_file(str(path))
    assert [(x.prompt, x.answer, x.group, x.line) for x in items] == [("a b", "c", "3", 1), ("d", "e f", "", 3)]


@pytest.mark.slow
def test_builtin_lines_grid_and_resume(kv_data_bin, kv_checkpoint, tmp_path):
    out = tmp_path / "ret"
    argv = [str(kv_data_bin), "-c", f"kv={kv_checkpoint}", "--task", "lines", "--digits", "2",
            "--lengths", "48,2x,100", "--methods", METHODS, "--depths", "2", "--samples", "2",
            "--output-dir", str(out), "--cpu", "--no-progress"]
    assert retrieval.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert {(c["label"], c["length"], c["depth"]) for c in cells} == {
        (m, n, round(d, 6)) for m in ("none", "linear x2", "ntk dynamic") for n in (48, 64, 100)
        for d in (0.25, 0.75)}
    assert all(c["n"] == 2 for c in cells)
    for name in ("results.csv", "results.md", "accuracy.png", "depth.png"):
        assert (out / name).stat().st_size > 0
    # Scores of the built-in prompts equal the independent computation too (one method).
    model = load(kv_checkpoint, {"alibi_interpolation": "linear", "alibi_scale_factor": 2.0})
    d = model.decoder.dictionary
    encoder = backends.Encoder(d)
    task = P.Lines(encoder.vocabulary(), digits=2)
    built = retrieval.builtin_samples(task, encoder, [100], 2, 2, seed=1)
    for b in range(2):
        cell = next(c for c in cells if c["label"] == "linear x2" and c["length"] == 100
                    and c["depth"] == round(P.bins(2)[b], 6))
        expected = [independent_scores(model, d.eos(), s.prompt, s.answer)[1] for s in built[(100, b)]]
        assert all(s.length <= 100 for s in built[(100, b)])
        assert cell["sample_logprob"] == pytest.approx(expected, abs=1e-4)
        # needle_distance: from the queried record ("line KEY ...", KEY first seen) to the prompt's end
        keys = [s.prompt[-4] for s in built[(100, b)]]
        distances = [len(s.prompt) - (s.prompt.index(k) - 1) for s, k in zip(built[(100, b)], keys)]
        assert cell["needle_distance"] == pytest.approx(sum(distances) / len(distances))
    assert [c["depth"] for c in cells if c["label"] == "none" and c["length"] == 100] == [0.25, 0.75]
    near, far = (next(c for c in cells if c["label"] == "none" and c["length"] == 100 and c["depth"] == d)
                 for d in (0.75, 0.25))
    assert near["needle_distance"] < far["needle_distance"]  # deeper = later = closer to the question
    # Resume: nothing is recomputed; other samples -> everything is.
    calls = []
    real = retrieval.score

    def counting(model, samples, max_tokens):
        calls.append(len(samples))
        return real(model, samples, max_tokens)

    retrieval.score = counting
    try:
        assert retrieval.main(argv) == 0
        assert calls == []
        assert retrieval.main(argv[:-6] + ["--samples", "1"] + argv[-4:]) == 0
        assert len(calls) == len(cells) and set(calls) == {1}
    finally:
        retrieval.score = real


@pytest.mark.slow
def test_bad_input_fails_clearly(lm_data_bin, alibi_checkpoint, kv_data_bin, kv_checkpoint, tmp_path, capsys):
    out = tmp_path / "o"

    def fails(argv, *messages):
        with pytest.raises(SystemExit) as exit_info:
            retrieval.main([str(a) for a in argv] + ["--output-dir", str(out), "--cpu", "--no-progress"])
        assert exit_info.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        for message in messages:
            assert message in err, err

    def jsonl(name, text):
        path = tmp_path / name
        path.write_text(text)
        return path

    base = [lm_data_bin, "-c", alibi_checkpoint]
    fails([*base, "--task", jsonl("empty.jsonl", "\n")], "empty.jsonl holds no text")
    fails([*base, "--task", jsonl("nofield.jsonl", '{"prompt": "the cat"}\n')], "nofield.jsonl:1", "'answer' is missing")
    fails([*base, "--task", jsonl("bad.jsonl", '{"prompt": "the cat", "answer": "sees"}\n[1]\n')], "bad.jsonl:2")
    fails([*base, "--task", jsonl("words.jsonl", '{"prompt": "the zebra sees", "answer": "a unicorn"}\n')],
          "words.jsonl:1", "2 words not in the model's dictionary: unicorn, zebra")
    fails([*base, "--task", tmp_path / "none.jsonl"], "prompt file not found")
    fails([*base, "--task", "haystack"], "unknown task 'haystack'")
    # Built-in tasks on a dictionary without their words: the missing words are named.
    fails([*base, "--task", "lines"], "28 words are not in the model's dictionary: below, is,", "REGISTER_CONTENT",
          "--template FIELD=TEXT")
    kv = [kv_data_bin, "-c", kv_checkpoint]
    fails([*kv, "--task", "passkey", "--digits", "2"], "not in the model's dictionary", "pass", "--filler dictionary")
    # header 12 words + one record 8 + question 19 + answer 2 = 41
    fails([*kv, "--task", "lines", "--digits", "2", "--lengths", "1x"],
          "length 32 is shorter than the shortest lines prompt (41 tokens")
    fails([*kv, "--task", "lines", "--methods", "cubic"], "method='cubic' is not valid; allowed values")
    fails([*kv, "--task", "lines", "--template", "answer=x"], "unknown template field answer")
    # templates whose prompts could not be built (a KeyError, a ZeroDivisionError) or answered (no number, no key)
    lines = [*kv, "--task", "lines", "--digits", "2", "--lengths", "64", "--samples", "1", "--depths", "1"]
    fails([*lines, "--template", "line=line {key} : REGISTER_CONTENT is {nmbr} ."], "unknown placeholder {nmbr}")
    fails([*lines, "--template", "line=line {key} : REGISTER_CONTENT is ."], "template line of task lines: no {number}")
    fails([*lines, "--template", "line="], "no {key}, {number}")
    fails([*lines, "--template", "question=tell me the REGISTER_CONTENT ."], "template question of task lines: no {key}")
    fails([*lines, "--template", "line=line {key}:{number} ."], "a placeholder must be a word of its own")
    fails([*lines, "--template", "header=a", "--template", "header=b"], "--template header is given twice")
    # keys that would make the question ambiguous, or be silently replaced
    fails([*lines, "--keys", "k1,k1,k1"], "--keys repeats k1")
    fails([*lines, "--keys", ","], "--keys names no key")
    fails([*lines, "--max-tokens", "1"], "--max-tokens 1 is smaller than the longest prompt of")
    assert not (out / "results.json").exists()


@pytest.mark.slow
def test_console_module(kv_data_bin, kv_checkpoint, tmp_path):
    """``python -m`` runs main() (the console script's target): one error line, status 1."""
    bad = run_cli([sys.executable, "-m", "fairseq_alibi.evaluation.retrieval", kv_data_bin, "-c", kv_checkpoint,
                   "--task", "lines", "--lengths", "10", "--output-dir", tmp_path, "--cpu"], expect_ok=False)
    last = bad.output.strip().splitlines()[-1]
    assert bad.returncode == 1 and last.startswith("error: ") and "length 10 is shorter" in last
    assert "Traceback" not in bad.output


@pytest.mark.slow
def test_passkey_fitted_to_a_vocabulary(kv_data_bin, kv_checkpoint, tmp_path):
    """The kv dictionary lacks the classic passkey words: templates and a dictionary filler fit it."""
    out = tmp_path / "pk"
    argv = [str(kv_data_bin), "-c", f"kv={kv_checkpoint}", "--task", "passkey", "--digits", "2",
            "--filler", "dictionary", "--template", "header=below is a record .",
            "--template", "needle=line k1 : REGISTER_CONTENT is {number} .",
            "--template", "question=tell me the REGISTER_CONTENT in line k1 . line k1 : REGISTER_CONTENT is",
            "--lengths", "60,90", "--methods", "none", "--depths", "2", "--samples", "2",
            "--output-dir", str(out), "--cpu", "--no-progress"]
    assert retrieval.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    assert sorted((c["length"], c["depth"]) for c in cells) == [(60, 0.25), (60, 0.75), (90, 0.25), (90, 0.75)]
    # the filler is made of dictionary words: whole sentences fill the prompt to within one sentence
    from fairseq.data import Dictionary

    d = Dictionary.load(str(kv_data_bin / "dict.txt"))
    encoder = backends.Encoder(d)
    task = retrieval.build_task(retrieval.get_parser().parse_args(argv), encoder.vocabulary())
    longest_sentence = max(len(s) for s in task.filler)
    built = retrieval.builtin_samples(task, encoder, [90], 2, 2, seed=1)
    for samples in built.values():
        for s in samples:
            assert 90 - longest_sentence < s.length <= 90 and d.unk() not in s.prompt


@pytest.mark.slow
def test_heads_example_runs(kv_data_bin, kv_checkpoint):
    """examples/retrieval/heads.py (the heads table of docs/retrieval.md) on the tiny
    model: a row per layer and head, attention masses in [0, 1]; within the cap
    (C = 64 >= every distance at 48 tokens) cap gives plain ALiBi's numbers."""
    result = run_cli([sys.executable, EXAMPLES / "retrieval" / "heads.py", kv_data_bin, kv_checkpoint,
                      "--digits", "2", "--lengths", "48", "--methods", "none,cap:2,ntk:4", "--samples", "2"])
    tables = result.stdout.split("\nmethod ")[1:]
    assert [t.split(":", 1)[0] for t in tables] == ["none", "cap x2", "ntk x4"]
    rows = {}
    for table in tables:
        lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
        rows[table.split(":", 1)[0]] = lines
        assert len(lines) == 2 * 6  # 2 layers x 6 heads (conftest's tiny model)
        for line in lines:
            mass = float(line.split("|")[4])
            assert 0.0 <= mass <= 1.0
    assert rows["none"] == rows["cap x2"] and rows["none"] != rows["ntk x4"]
    # --top K: the K rows of the full table with the most mass, most first
    top = run_cli([sys.executable, EXAMPLES / "retrieval" / "heads.py", kv_data_bin, kv_checkpoint,
                   "--digits", "2", "--lengths", "48", "--methods", "none", "--samples", "2", "--top", "3"])
    top_rows = [line for line in top.stdout.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    expected = sorted(rows["none"], key=lambda line: -float(line.split("|")[4]))[:3]
    assert [float(r.split("|")[4]) for r in top_rows] == [float(r.split("|")[4]) for r in expected]
    assert set(top_rows) <= set(rows["none"])


def test_own_key_mass_by_hand():
    """key_heads.own_key_mass: two records (keys at 1 and 4, records end at 4
    and 7), one head, weights chosen per row; the means by hand."""
    sys.path.insert(0, str(EXAMPLES / "retrieval"))
    try:
        import key_heads
    finally:
        sys.path.pop(0)
    spans = [(1, 4), (4, 7)]
    weights = torch.zeros(1, 8, 8)
    weights[0, 2, 1], weights[0, 3, 1] = 0.5, 0.25  # record 1's rows 2, 3 on their own key
    weights[0, 5, 4], weights[0, 6, 1], weights[0, 6, 4] = 1.0, 0.25, 0.5  # record 2's rows 5, 6
    own, other = key_heads.own_key_mass(weights, spans, shift=0)
    assert own.tolist() == [pytest.approx((0.5 + 0.25 + 1.0 + 0.5) / 4)]
    assert other.tolist() == [pytest.approx(0.25 / 4)]
    shifted = torch.zeros(1, 9, 9)
    shifted[:, 1:, 1:] = weights
    assert key_heads.own_key_mass(shifted, spans, shift=1)[0].tolist() == own.tolist()
    # previous token: rows 3 (record 1) and 6 (record 2), two or more after their keys
    weights[0, 3, 2], weights[0, 6, 5], weights[0, 2, 1] = 0.75, 0.25, 0.5  # row 2's token before is the key
    assert key_heads.previous_token_mass(weights, spans, shift=0).tolist() == [pytest.approx((0.75 + 0.25) / 2)]
    shifted[:, 1:, 1:] = weights
    assert key_heads.previous_token_mass(shifted, spans, shift=1).tolist() == [pytest.approx(0.5)]


def test_token_kinds_by_hand():
    """token_losses.token_kinds: keys after `line` new or repeated, a record's
    digits new until the key has had a record, then retrieved (first digit
    apart); template words, the question's words and full stops are rest.
    token_losses.record_guess: minus the log of the share of earlier records
    whose first digit is the retrieved one."""
    sys.path.insert(0, str(EXAMPLES / "retrieval"))
    try:
        import token_losses
    finally:
        sys.path.pop(0)
    words = ("line k1 : REGISTER_CONTENT is 1 2 . line k2 : REGISTER_CONTENT is 3 4 . tell me the "
             "REGISTER_CONTENT in line k2 . line k2 : REGISTER_CONTENT is 3 4 . line k1 : REGISTER_CONTENT is 1 2 .")
    kinds = token_losses.token_kinds(words.split())
    r, n, first, later = "rest", "new digit", "retrieved 1st digit", "retrieved later digit"
    record = [r, "{key}", r, r, r, "{d1}", "{d2}", r]
    expected = ([k.format(key="new key", d1=n, d2=n) for k in record] * 2
                + [r, r, r, r, r, r, "repeated key", r]
                + [k.format(key="repeated key", d1=first, d2=later) for k in record] * 2)
    assert kinds == expected
    # the no-key guess: two earlier records, first digits 1 and 3 (then 1 and 1: no doubt left)
    assert token_losses.record_guess(words.split()) == [pytest.approx(math.log(2))] * 2
    assert token_losses.record_guess(words.replace("3 4", "1 4").split()) == [0.0, 0.0]


@pytest.mark.slow
def test_token_losses_example_by_kind(kv_data_bin, kv_checkpoint, tmp_path):
    """examples/retrieval/token_losses.py on the tiny ALiBi model: the kinds'
    shares sum to 100%, the `all` column is their share-weighted mean and
    equals the mean loss of every word computed here (a full forward per
    document, in nats); a missing text is one error line."""
    from fairseq import checkpoint_utils

    import fairseq_alibi.models  # noqa: F401
    text = kv_data_bin.parent / "valid.txt"
    result = run_cli([sys.executable, EXAMPLES / "retrieval" / "token_losses.py", kv_data_bin,
                      "--text", text, "-c", f"tiny={kv_checkpoint}"])
    header, guess, row = markdown_rows(result.stdout, "Mean loss")[:3]
    assert guess[0].startswith("(no model") and 0 <= float(guess[1]) < math.log(10)
    shares = [float(cell.rsplit("(", 1)[1].rstrip("%)")) for cell in header[1:-1]]
    cells = [float(c) if c != "n/a" else 0.0 for c in row[1:-1]]
    assert row[0] == "tiny" and abs(sum(shares) - 100) <= 3
    assert float(row[-1]) == pytest.approx(sum(s * c for s, c in zip(shares, cells)) / 100, abs=0.03)
    models, _ = checkpoint_utils.load_model_ensemble([str(kv_checkpoint)], arg_overrides={"data": str(kv_data_bin)})
    model, losses = models[0].eval(), []
    d = model.decoder.dictionary
    for line in text.read_text().splitlines():
        ids = [d.eos()] + [d.index(w) for w in line.split()]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids]))[0][0].float(), -1)
        losses += [-float(logprobs[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    assert float(row[-1]) == pytest.approx(sum(losses) / len(losses), abs=0.0015)
    missing = run_cli([sys.executable, EXAMPLES / "retrieval" / "token_losses.py", kv_data_bin,
                       "-c", f"tiny={kv_checkpoint}"], expect_ok=False)
    lines = missing.stderr.splitlines()
    assert missing.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: cannot read the held-out documents")


@pytest.mark.slow
def test_key_heads_example_agrees_with_heads(kv_data_bin, kv_checkpoint):
    """examples/retrieval/key_heads.py on the tiny ALiBi model: a row per layer,
    masses in [0, 1], own plus other keys at most 1; its step-2 column (the
    model's own attention weights, the reference kernel) is heads.py's largest
    mass per layer (scores by hand, the same prompts)."""
    args = ["--digits", "2", "--samples", "2"]
    result = run_cli([sys.executable, EXAMPLES / "retrieval" / "key_heads.py", kv_data_bin,
                      "-c", f"tiny={kv_checkpoint}", "--length", "48", *args])
    rows = markdown_rows(result.stdout, "`lines` at")[1:]
    assert [r[1] for r in rows] == ["1", "2"] and rows[0][0] == "tiny" and rows[0][6].endswith("%")
    for row in rows:
        own, other, record = float(row[2].split(": ")[1]), float(row[3]), float(row[4].split(": ")[1])
        previous = float(row[5].split(": ")[1])
        assert 0 <= own <= 1 and 0 <= other <= 1 and own + other <= 1.005 and 0 <= record <= 1 and 0 <= previous <= 1
    by_hand = run_cli([sys.executable, EXAMPLES / "retrieval" / "heads.py", kv_data_bin, kv_checkpoint,
                       "--lengths", "48", "--methods", "none", *args])
    table = [line.split("|") for line in by_hand.stdout.splitlines()
             if line.startswith("| ") and not line.startswith("| layer")]
    for layer, row in zip((1, 2), rows):
        masses = [float(cells[4]) for cells in table if int(cells[1]) == layer]
        assert float(row[4].split(": ")[1]) == pytest.approx(max(masses), abs=0.011)


@pytest.mark.parametrize("script,missing", [
    ("retrieval/key_heads.py", "data"), ("retrieval/heads.py", "checkpoint"),
    ("retrieval/token_losses.py", "data"), ("language_model/far_attention.py", "data"),
])
def test_analysis_scripts_check_their_inputs_before_printing(tmp_path, script, missing):
    """A data directory or a checkpoint that is not there: one ``error:`` line
    that names it, exit 1, nothing on stdout (no table header before it), no
    traceback.  Case "data": neither is there, and the data directory, checked
    first, is named; case "checkpoint": a data directory with a dict.txt,
    and the checkpoint is named."""
    data = tmp_path / "data"
    if missing == "checkpoint":
        data.mkdir()
        (data / "dict.txt").write_text("w 1\n")
    checkpoint = tmp_path / "model.pt"
    given = [checkpoint] if script.endswith(("/heads.py", "far_attention.py")) else ["-c", f"m={checkpoint}"]
    result = run_cli([sys.executable, EXAMPLES / script, data, *given], expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.output and not result.stdout.strip()
    [line] = error_lines(result)
    assert str(data if missing == "data" else checkpoint) in line, line


def test_key_heads_names_the_layout_when_the_template_is_not_in_the_dictionary(tmp_path):
    """A model of an adjacent-layout corpus (no ``:`` in its dictionary) read
    with the default --layout record: one ``error:`` line that names the
    model and the option to give, exit 1, no traceback; with --layout
    adjacent the same model is read."""
    raw = tmp_path / "raw"
    run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", raw, "--max-length", "100",
             "--keys", "64", "--digits", "2", "--train-docs", "200", "--valid-docs", "10", "--layout", "adjacent"])
    data = raw / "data-bin"
    run_cli([tool("fairseq-preprocess"), "--only-source", "--trainpref", raw / "train.txt",
             "--validpref", raw / "valid.txt", "--destdir", data, "--workers", "1"])
    assert ":" not in [line.split()[0] for line in (data / "dict.txt").read_text().splitlines()]
    run_cli([tool("alibi-train"), *train_args(data, tmp_path / "model", max_update=1)])
    argv = [sys.executable, EXAMPLES / "retrieval" / "key_heads.py", data, "-c", f"adj={tmp_path / 'model' / 'checkpoint_last.pt'}",
            "--digits", "2", "--samples", "1", "--length", "40"]
    result = run_cli(argv, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.output
    [line] = error_lines(result)
    assert line.startswith("error: adj: ") and "--layout adjacent" in line
    rows = markdown_rows(run_cli(argv + ["--layout", "adjacent"]).stdout, "`lines` at")[1:]
    assert [r[1] for r in rows] == ["1", "2"] and rows[0][0] == "adj"


def markdown_rows(text: str, title: str):
    """The rows (lists of cells, header first, separator dropped) of the Markdown
    table that follows the first line starting with ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    table = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    return [table[0]] + table[2:]


def spread_by_hand(per_run):
    """'mean [lowest, highest] (pooled low-high)' of runs' (correct, n), the
    Wilson interval of the pooled prompts from its formula."""
    values = [100 * k / n for k, n in per_run]
    low, high = wilson_by_hand(sum(k for k, _ in per_run), sum(n for _, n in per_run))
    return (f"{sum(values) / len(values):.0f} [{min(values):.0f}, {max(values):.0f}] "
            f"(pooled {100 * low:.0f}-{100 * high:.0f})")


def counts(cells, label, length):
    these = [c for c in cells if c["label"] == label and c["length"] == length]
    return sum(c["correct"] for c in these), sum(c["n"] for c in these)


@pytest.mark.slow
def test_seed_summary_example(kv_data_bin, kv_checkpoint, tmp_path):
    """examples/retrieval/summary.py pools runs: each method's accuracy at each
    length is the mean [lowest, highest] of the runs' accuracies and the Wilson
    interval of their pooled prompts, computed here from the runs' cells; rows
    in the --methods order, one per method (two alphas of one method and factor
    are two rows); each run's accuracy with its own Wilson interval."""
    runs = {}
    for seed in (1, 2):
        out = tmp_path / f"seed{seed}"
        argv = [str(kv_data_bin), "-c", f"kv={kv_checkpoint}", "--task", "lines", "--digits", "2", "--lengths",
                "48,100", "--methods", "ntk,none,cap,log:1:0.25,log:1:2", "--depths", "1", "--samples", "3",
                "--seed", str(seed),
                "--output-dir", str(out), "--cpu", "--no-progress"]
        assert retrieval.main(argv) == 0
        runs[f"s{seed}"] = json.loads((out / "results.json").read_text())["cells"]
    plot = tmp_path / "methods.png"
    result = run_cli([sys.executable, EXAMPLES / "retrieval" / "summary.py", "--checkpoint", "kv", "--plot", plot,
                      *(f"{name}={tmp_path / ('seed' + name[1:])}/results.json" for name in runs)])
    header, *rows = markdown_rows(result.stdout, "Accuracy % by prompt length")
    assert header == ["method", f"kv 48 ({48 / TRAIN_LENGTH:g}x)", f"kv 100 ({100 / TRAIN_LENGTH:g}x)"]
    assert [row[0] for row in rows] == ["ntk dynamic", "none", "cap x1", "log x1 a0.25", "log x1 a2"]
    for label, *shown in rows:
        assert shown == [spread_by_hand([counts(cells, label, n) for cells in runs.values()]) for n in (48, 100)]
    header, *per_run = markdown_rows(result.stdout, "Accuracy % by prompt length in each run")
    assert len(per_run) == 5 * len(runs)
    for label, name, *shown in per_run:
        for length, cell in zip((48, 100), shown):
            k, n = counts(runs[name], label, length)
            low, high = wilson_by_hand(k, n)
            assert cell == f"{100 * k / n:.0f} [{100 * low:.0f}, {100 * high:.0f}] ({n})"
    assert plot.stat().st_size > 0


@pytest.mark.slow
def test_summary_puts_each_method_under_its_family(tmp_path):
    """summary.py on hand-made results of three runs: an ALiBi model (none, cap),
    a RoPE one (none, yarn:2, ntk:2) and a sinusoidal one in the first run only.
    A column per model at each length, each number the mean [lowest, highest]
    over the runs that hold the model and the Wilson interval of their pooled
    prompts (computed here); n/a where the method does not apply to the model's
    position method, blank where it applies and was not evaluated (ntk:2 on
    ALiBi); by needle distance the same per model; --checkpoint keeps one model;
    a checkpoint no run holds is one error line."""
    from fairseq_alibi.core.scaling import Scaling

    rng = random.Random(3)
    grid = {"alibi": ("transformer_lm_alibi", ["none", "cap"]),
            "rotary": ("transformer_lm_rotary", ["none", "yarn:2", "ntk:2"]),
            "sinusoidal": ("transformer_lm", ["none"])}
    runs = {}
    for run in ("r1", "r2", "r3"):
        cells = []
        for name, (model, methods) in grid.items():
            if name == "sinusoidal" and run != "r1":
                continue
            for spelling in methods:
                s = Scaling.parse(spelling)
                for length in (64, 512):
                    for distance in (10, length - 20):
                        n = rng.randint(5, 20)
                        cells.append(dict(checkpoint=name, model=model, method=s.method, factor=s.factor,
                                          label=s.label, spelling=s.spelling, train_length=64, length=length,
                                          needle_distance=distance, n=n, correct=rng.randint(0, n),
                                          answer_logprob=-rng.random()))
        runs[run] = cells
        _fake_cells(tmp_path / run / "results.json", cells)
        data = json.loads((tmp_path / run / "results.json").read_text())
        data["meta"] = {"methods": ["none", "cap", "yarn:2", "ntk:2"]}
        (tmp_path / run / "results.json").write_text(json.dumps(data))
    specs = [f"{run}={tmp_path / run / 'results.json'}" for run in runs]

    def expected(name, label, match):
        per_run = [(sum(c["correct"] for c in these), sum(c["n"] for c in these))
                   for these in ([c for c in cells if c["checkpoint"] == name and c["label"] == label and match(c)]
                                 for cells in runs.values()) if these]
        return spread_by_hand(per_run)

    out = run_cli([sys.executable, EXAMPLES / "retrieval" / "summary.py", *specs]).stdout
    header, *rows = markdown_rows(out, "Accuracy % by prompt length")
    columns = [(name, length) for length in (64, 512) for name in grid]
    assert header == ["method"] + [f"{name} {length} ({length // 64}x)" for name, length in columns]
    labels = [Scaling.parse(m).label for m in ("none", "cap", "yarn:2", "ntk:2")]
    assert [row[0] for row in rows] == labels
    applies = {"alibi": {"none", "cap", "ntk"}, "rotary": {"none", "yarn", "ntk"}, "sinusoidal": {"none"}}
    for (label, *shown), spelling in zip(rows, ("none", "cap", "yarn:2", "ntk:2")):
        for (name, length), cell in zip(columns, shown):
            if spelling.split(":")[0] not in applies[name]:
                assert cell == "n/a", (label, name, length)
            elif spelling not in grid[name][1]:
                assert cell == "", (label, name, length)
            else:
                assert cell == expected(name, label, lambda c: c["length"] == length), (label, name, length)
    header, *rows = markdown_rows(out.split("## rotary (transformer_lm_rotary): 3 runs (r1, r2, r3)")[1],
                                  "Accuracy % by needle distance")
    assert header == ["method", "0-31", "32-63", "384-511"]  # needles 10 and 44 tokens away (64), 10 and 492 (512)
    bins = [(0, 32), (32, 64), (384, 512)]
    for label, *shown in rows:
        assert shown == [expected("rotary", label, lambda c, lo=lo, hi=hi: lo <= c["needle_distance"] < hi)
                         for lo, hi in bins]
    assert "## sinusoidal (transformer_lm): 1 run (r1)" in out
    only = run_cli([sys.executable, EXAMPLES / "retrieval" / "summary.py", "--checkpoint", "rotary", *specs]).stdout
    assert markdown_rows(only, "Accuracy % by prompt length")[0] == ["method", "rotary 64 (1x)", "rotary 512 (8x)"]
    assert "## alibi" not in only
    wrong = run_cli([sys.executable, EXAMPLES / "retrieval" / "summary.py", "--checkpoint", "rope", *specs],
                    expect_ok=False)
    assert wrong.returncode == 1 and error_lines(wrong) == ["error: no run holds cells of checkpoint rope"]


@pytest.mark.slow
def test_recipe_runs_every_family_of_the_registry(tmp_path):
    """The retrieval recipe at toy size with every model (sinusoidal and each
    position method of the registry, two layers for rnope's hybrid): each is
    trained, each evaluated under ``none`` and ``logn`` (``logn`` where it applies: not
    to the stock sinusoidal model nor to stick-breaking, which has no softmax) at 1x, and
    the summary has a column per model."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out = tmp_path / "out"
    models = ["sinusoidal", *POSITIONS]
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(tmp_path / "data"), SEEDS="1", L="64",
                    LAYERS="2", DIM="16", FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="2",
                    WARMUP="2", MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="families",
                    MODELS=" ".join(models), METHODS="none,logn", LENGTHS="1x")
    run = subprocess.run([str(EXAMPLES / "retrieval" / "run.sh")], capture_output=True, text=True,
                         env=cli_env(**settings), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.parent.name for p in out.glob("seed1/*/trained.ok")) == sorted(models)
    cells = json.loads((out / "seed1" / "families" / "results.json").read_text())["cells"]
    for name in models:  # logn applies to every position method with a softmax (its entry's extensions)
        mine = [c for c in cells if c["checkpoint"] == name]
        applies = {"none"} if name == "sinusoidal" else {"none", "logn"} & set(POSITIONS[name].extensions)
        assert {c["method"] for c in mine} == applies, name
        assert all(0.0 <= c["accuracy"] <= 1.0 for c in mine), name
    header = markdown_rows((out / "summary-families.md").read_text(), "Accuracy % by prompt length")[0]
    assert header == ["method"] + [f"{name} 64 (1x)" for name in sorted(models)]  # the summary sorts by name


@pytest.mark.slow
def test_recipe_filler_corpus_passkey_and_one_models_own_arguments(tmp_path):
    """The retrieval recipe with FILLER_SHARE (the corpus has filler documents),
    PASSKEY=1 (the passkey at 1x for every model, beside `lines`) and
    EXTRA_TRAIN_ARGS_fox (FoX's option reaches FoX's trainer alone: ALiBi's
    would refuse it), in LAYOUT=adjacent (records `line KEY N .` in the
    corpus and in both evaluations' prompts); PASSKEY takes 0 or 1 only,
    FILLER_WORDS keys or non-keys, and non-keys only with filler, LAYOUT
    record or adjacent."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out, data = tmp_path / "out", tmp_path / "data"
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(data), SEEDS="1", L="64", LAYERS="1", DIM="16",
                    FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="2", WARMUP="2",
                    MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="families",
                    MODELS="alibi fox", METHODS="none", LENGTHS="1x", FILLER_SHARE="0.5", PASSKEY="1",
                    EXTRA_TRAIN_ARGS_fox="--fox-weight-delay 1", LAYOUT="adjacent")
    script = str(EXAMPLES / "retrieval" / "run.sh")
    run = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    documents = (data / "raw" / "train.txt").read_text().splitlines()
    plain_start = "below is a record of lines i want you to remember . line"
    assert 0 < sum(not d.startswith(plain_start) for d in documents) < len(documents)
    assert all(re.search(r" line k\d+ \d \d \.", d) and ":" not in d.split() for d in documents)
    assert "fox_weight_delay': 1" in (out / "seed1" / "fox" / "train.log").read_text()
    for task in ("families", "passkey"):
        cells = json.loads((out / "seed1" / task / "results.json").read_text())["cells"]
        assert sorted(c["checkpoint"] for c in cells) == ["alibi", "fox"], task
    assert {c["task"] for c in json.loads((out / "seed1" / "passkey" / "results.json").read_text())["cells"]} == {
        "passkey"}
    templates = {task: json.loads((out / "seed1" / task / "results.json").read_text())["meta"]["template"]
                 for task in ("families", "passkey")}  # the prompts' fields that the layout replaces
    assert templates["families"]["line"] == "line {key} {number} ." and templates["passkey"]["needle"] == (
        "line k1 {number} .")
    assert all(t["question"].endswith(" line {key}".replace("{key}", k)) for t, k in (
        (templates["families"], "{key}"), (templates["passkey"], "k1")))
    wrong = subprocess.run([script], capture_output=True, text=True, timeout=600,
                           env=cli_env(**dict(settings, PASSKEY="yes", OUT=str(tmp_path / "wrong"))))
    assert wrong.returncode == 1 and wrong.stderr.splitlines() == [
        "error: PASSKEY=yes is not allowed: 1 (evaluate the passkey at 1x too) or 0"]
    share = subprocess.run([script], capture_output=True, text=True, timeout=600,
                           env=cli_env(**dict(settings, FILLER_SHARE="1.5", OUT=str(tmp_path / "wrong"))))
    assert share.returncode == 1 and share.stderr.splitlines() == [
        "error: FILLER_SHARE=1.5 is not a share of the documents: give a number from 0 to 1, e.g. 0.25"]
    layout = subprocess.run([script], capture_output=True, text=True, timeout=600,
                            env=cli_env(**dict(settings, LAYOUT="packed", OUT=str(tmp_path / "wrong"))))
    assert layout.returncode == 1 and layout.stderr.splitlines() == [
        "error: LAYOUT=packed is not allowed: record (the default) or adjacent"]
    for words, share, message in (("nouns", "0.5", "is not allowed: keys (the default) or non-keys"),
                                  ("non-keys", "0", "needs filler: give FILLER_SHARE too, e.g. 0.25")):
        refused = subprocess.run([script], capture_output=True, text=True, timeout=600,
                                 env=cli_env(**dict(settings, FILLER_WORDS=words, FILLER_SHARE=share,
                                                    OUT=str(tmp_path / "wrong"))))
        assert refused.returncode == 1 and refused.stderr.splitlines() == [f"error: FILLER_WORDS={words} {message}"]
    digits = subprocess.run([script], capture_output=True, text=True, timeout=600,
                            env=cli_env(**dict(settings, DIGITS="two", OUT=str(tmp_path / "wrong"))))
    assert digits.returncode == 1 and digits.stderr.splitlines() == ["error: DIGITS=two is not a positive whole number"]
    assert not (tmp_path / "wrong").exists()  # refused before anything ran
    # The corpus DATA holds was built with 16 keys: a run with 17 is refused before it trains (DATA
    # named, so the keys do not change its directory's name).
    keys = subprocess.run([script], capture_output=True, text=True, timeout=600,
                          env=cli_env(**dict(settings, KEYS="17", OUT=str(tmp_path / "keys"))))
    assert keys.returncode == 1, keys.stdout[-2000:] + keys.stderr
    assert keys.stderr.splitlines() == [
        f"error: {data} holds a corpus built with max-length 63 keys 16 digits 2 train-docs 200 seed 1 filler-share "
        f"0.5 filler-words keys layout adjacent, not with max-length 63 keys 17 digits 2 train-docs 200 seed 1 "
        f"filler-share 0.5 filler-words keys layout adjacent; give another DATA, or remove {data} to build it again"]
    assert not list((tmp_path / "keys").glob("seed1/*/train.log"))


@pytest.mark.slow
def test_every_family_recipe_gives_each_family_its_own_settings(tmp_path):
    """RECIPE=every-family: every position method of the registry, in the adjacent
    layout with filler in a quarter of the training documents and the passkey; T5,
    FoX and RNoPE get their own arguments, RoPE and NoPE their own update counts
    and NoPE its third layer (UPDATES_<model>, LAYERS_<model> replace the recipe's
    for that model alone; the models' logs and trained.ok say so); RoPE trains
    on a corpus of its own with filler in a tenth (FILLER_SHARE_rotary), under
    the run's dictionary; every extension method applies where it may (logn to
    each family); a rerun that would take RoPE for trained on the run's corpus
    is refused. A per-model setting that names no model, a count that is no
    whole number or a share that is none, is refused before anything runs, and
    a model's own corpus with words the run's dictionary lacks before it
    trains."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out, data = tmp_path / "out", tmp_path / "data"
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(data), SEEDS="1", L="64", LAYERS="2", DIM="16",
                    FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="2", WARMUP="2",
                    MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="every-family",
                    LENGTHS="1x", UPDATES_rotary="3", UPDATES_nope="4", UNTIL="",  # fixed counts (staged: below)
                    FILLER_SHARE_nope="0.10",  # RoPE's share, spelt otherwise: one corpus for the two
                    **{f"UPDATES_{name}": "" for name in ("fire", "kerple", "t5bias", "fox", "rnope")})  # "": UPDATES
    script = str(EXAMPLES / "retrieval" / "run.sh")
    run = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    updates = {p.parent.name: p.read_text().strip() for p in out.glob("seed1/*/trained.ok")}
    assert updates == {**{name: "2" for name in POSITIONS}, "rotary": "3", "nope": "4"}
    logs = {name: (out / "seed1" / name / "train.log").read_text() for name in POSITIONS}
    assert {name for name, log in logs.items() if "'decoder_layers': 3" in log} == {"nope"}
    assert all("'decoder_layers': 2" in log for name, log in logs.items() if name != "nope")
    own = {"t5bias": "'t5_init_slopes': 1", "fox": "'fox_weight_delay': 1000", "rnope": "'rnope_window': 8"}
    for name, setting in own.items():
        assert {n for n, log in logs.items() if setting in log} == {name}, setting
    documents = (data / "raw" / "train.txt").read_text().splitlines()
    assert all(re.search(r" line k\d+ \d \d \.", d) for d in documents)  # adjacent records
    with_filler = lambda docs: sum(not d.startswith("below is a record of lines i want you to remember . line") for d in docs)
    assert 0 < with_filler(documents) < len(documents)
    # RoPE's corpus of its own: the seed's records with filler in a tenth of the documents, not a
    # quarter, binarized with the run's dictionary (the checks and the evaluation read that one)
    rope_data = data / "filler-0.1"
    data_of = {name: re.search(r"'data': '([^']*)'", log).group(1) for name, log in logs.items()}
    assert data_of == {name: str(rope_data if name in ("rotary", "nope") else data) for name in POSITIONS}
    assert run.stdout.count(f"-> {rope_data}\n") == 1 and "already binarized" not in run.stdout  # built once
    assert (rope_data / "dict.txt").read_bytes() == (data / "dict.txt").read_bytes()
    rope_documents = (rope_data / "raw" / "train.txt").read_text().splitlines()
    assert len(rope_documents) == len(documents) and 0 < with_filler(rope_documents) < with_filler(documents)
    # a FILLER_SHARE given is RoPE's too, and a model goes on only on the corpus it was trained on (here:
    # RoPE, trained on its own, asked to count as trained on the run's)
    moved = subprocess.run([script], capture_output=True, text=True, timeout=600,
                           env=cli_env(**dict(settings, FILLER_SHARE="0.25")))
    assert moved.returncode == 1 and (
        f"error: seed 1 rotary: {out}/seed1/rotary holds a model trained on {rope_data}, not on {data}; give "
        f"another OUT, or remove {out}/seed1/rotary to train it again") in moved.stderr.splitlines(), moved.stderr
    cells = json.loads((out / "seed1" / "families" / "results.json").read_text())["cells"]
    assert all({"none", "logn"} & set(POSITIONS[name].extensions) <= {c["method"] for c in cells
                                                                     if c["checkpoint"] == name}
               for name in POSITIONS)  # logn where the method takes it (stick-breaking has no softmax)
    assert {c["method"] for c in cells if c["checkpoint"] == "alibi"} >= {"cap", "log", "power", "capnorm", "ntk"}
    passkeys = json.loads((out / "seed1" / "passkey" / "results.json").read_text())["cells"]
    assert {c["checkpoint"] for c in passkeys} == set(POSITIONS)
    for extra, message in ((dict(UPDATES_rope="5"), "error: UPDATES_rope names 'rope', which is not a model; "
                            "allowed suffixes: sinusoidal " + " ".join(POSITIONS)),
                           (dict(LAYERS_nope="three"), "error: LAYERS_nope=three is not a positive whole number"),
                           (dict(UPDATES="0"), "error: UPDATES=0 is not a positive whole number"),
                           (dict(FILLER_SHARE_rope="0.1"), "error: FILLER_SHARE_rope names 'rope', which is not "
                            "a model; allowed suffixes: sinusoidal " + " ".join(POSITIONS)),
                           (dict(FILLER_SHARE_rotary="2"), "error: FILLER_SHARE_rotary=2 is not a share of the "
                            "documents: give a number from 0 to 1, e.g. 0.1, or leave it empty for FILLER_SHARE")):
        refused = subprocess.run([script], capture_output=True, text=True, timeout=600,
                                 env=cli_env(**dict(settings, OUT=str(tmp_path / "wrong"), **extra)))
        assert refused.returncode == 1 and refused.stderr.splitlines() == [message], refused.stderr
    assert not (tmp_path / "wrong").exists()  # refused before anything ran
    # a model's own corpus with words the run's dictionary lacks (filler of non-keys where the run's
    # corpus holds almost none) would train on <unk>: refused before it trains
    lacking = dict(settings, OUT=str(tmp_path / "lacking"), DATA=str(tmp_path / "lacking-data"), MODELS="rotary",
                   FILLER_SHARE="0.005", FILLER_WORDS="non-keys", FILLER_SHARE_rotary="1")
    refused = subprocess.run([script], capture_output=True, text=True, timeout=600, env=cli_env(**lacking))
    own = tmp_path / "lacking-data" / "filler-1"
    assert refused.returncode == 1 and re.fullmatch(
        rf"error: the corpus in {own} has words the dictionary of {tmp_path / 'lacking-data'} lacks \(train "
        rf"[0-9.]+%, valid [0-9.]+% of its tokens <unk>; log: {own}/preprocess.log\): give its model the "
        r"run's FILLER_SHARE or FILLER_WORDS=keys\n", refused.stderr), refused.stderr
    assert not (own / "train.bin").exists() and not (tmp_path / "lacking" / "seed1").exists()


@pytest.mark.slow
def test_recipe_trains_in_stages_until_the_model_retrieves(tmp_path):
    """UNTIL=P (every-family's default, 90): each model trains in stages of
    CHECK_EVERY updates up to its budget (UPDATES), checked at 1x after each
    (`lines` and the passkey, on prompts of another seed than the final
    evaluation's; checks.tsv, stages.md): a toy model that never
    reaches P trains to its budget, checked at 2, 4 and 5 updates; a rerun
    trains and checks nothing again; a model whose check at its own count
    reached P stops there (no training towards a larger budget) while the other
    trains on, checked again where its check lacked the passkey; UNTIL must be
    a whole percentage."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out, data = tmp_path / "out", tmp_path / "data"
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(data), SEEDS="1", L="64", LAYERS="1", DIM="16",
                    FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="5", WARMUP="2",
                    MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="every-family",
                    MODELS="alibi kerple", METHODS="none", LENGTHS="1x", CHECK_EVERY="2", SAVE_EVERY="1")
    script = str(EXAMPLES / "retrieval" / "run.sh")
    run = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("alibi", "kerple"):
        model = out / "seed1" / name
        assert [row.split("\t")[0] for row in (model / "checks.tsv").read_text().splitlines()] == ["2", "4", "5"]
        assert (model / "trained.ok").read_text().strip() == "5"
        assert sorted(p.name for p in (model / "checks" / "4").iterdir()) == ["lines", "passkey"]
        for task in ("lines", "passkey"):  # prompts of their own: the final evaluation's are the seed's
            assert json.loads((model / "checks" / "4" / task / "results.json").read_text())["meta"]["seed"] == 1001
        assert f"seed 1 {name}: below 90% at its last check, 5 updates (its budget)" in run.stdout
    stages = (out / "stages.md").read_text()
    assert re.search(r"\| alibi \| not by 5 \(\d+ / \d+\) \|", stages) and (out / "stages.png").stat().st_size > 0
    again = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=600)
    assert again.returncode == 0 and "2/3 training" not in again.stdout and not re.search(r"check at \d+ updates", again.stdout)

    checks = out / "seed1" / "alibi" / "checks.tsv"  # as if ALiBi had answered everything at its last check
    checks.write_text(checks.read_text().replace(checks.read_text().splitlines()[-1], "5\t100.0\t100.0"))
    kerple = out / "seed1" / "kerple" / "checks.tsv"  # as if its last check had been made without the passkey
    kerple.write_text(kerple.read_text().replace(kerple.read_text().splitlines()[-1], "5\t100.0\t-"))
    longer = subprocess.run([script], capture_output=True, text=True, timeout=600,
                            env=cli_env(**dict(settings, UPDATES="7")))
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-3000:]
    assert "seed 1 alibi: retrieves at 5 updates" in longer.stdout
    assert (out / "seed1" / "alibi" / "trained.ok").read_text().strip() == "5"
    assert (out / "seed1" / "kerple" / "trained.ok").read_text().strip() == "7"
    assert [row.split("\t")[0] for row in kerple.read_text().splitlines()] == ["2", "4", "5", "6", "7"]
    assert "-" not in kerple.read_text()  # checked again at 5 with the passkey (a check without it stood for none)
    assert "seed 1 kerple: check at 5 updates" in longer.stdout
    assert "| alibi | **5** (100 / 100) |" in (out / "stages.md").read_text()
    for until in ("0", "ninety", "101"):
        refused = subprocess.run([script], capture_output=True, text=True, timeout=600,
                                 env=cli_env(**dict(settings, UNTIL=until, OUT=str(tmp_path / "wrong"))))
        assert refused.returncode == 1 and refused.stderr.splitlines() == [
            f"error: UNTIL={until} is not allowed: a whole percentage from 1 to 100 (e.g. 90), or empty to train "
            "every model to its UPDATES"], refused.stderr
    assert not (tmp_path / "wrong").exists()


@pytest.mark.slow
def test_recipe_restarts_a_model_below_its_bar_under_another_seed(tmp_path):
    """RESTART_AT=U (with UNTIL): a model whose `lines` check at U updates is
    below RESTART_BELOW% starts again from scratch under the seed plus 10000,
    at most RESTARTS times; the discarded attempt is kept whole in
    seedS/restarts/MODEL.N, stages.md shows it and the updates of both
    attempts; a rerun trains and restarts nothing; each trainer's progress
    lines are shown once (a follower of one stage does not outlive it); a
    restart that is no check, or without UNTIL, is refused before anything runs."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out, data = tmp_path / "out", tmp_path / "data"
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(data), SEEDS="1", L="64", LAYERS="1", DIM="16",
                    FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="4", WARMUP="2",
                    MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="every-family",
                    MODELS="rotary", UPDATES_rotary="", METHODS="none", LENGTHS="1x", CHECK_EVERY="2",
                    SAVE_EVERY="1", UNTIL="100", RESTART_AT_rotary="2", RESTART_BELOW="100", RESTARTS="1")
    script = str(EXAMPLES / "retrieval" / "run.sh")
    run = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    first, model = out / "seed1" / "restarts" / "rotary.1", out / "seed1" / "rotary"
    assert "'seed': 1," in (first / "train.log").read_text() and (first / "checkpoint_last.pt").is_file()
    assert [row.split("\t")[0] for row in (first / "checks.tsv").read_text().splitlines()] == ["2"]
    assert "'seed': 10001," in (model / "train.log").read_text() and "'seed': 1," not in (model / "train.log").read_text()
    assert [row.split("\t")[0] for row in (model / "checks.tsv").read_text().splitlines()] == ["2", "4"]
    assert (model / "trained.ok").read_text().strip() == "4"
    assert re.search(r"seed 1 rotary: lines [\d.]+% at 2 updates, below 100%: restart 1 of at most 1, training seed "
                     rf"10001 \(the attempt kept in {re.escape(str(first))}\)", run.stdout)
    assert "below 100%, and its RESTARTS=1 restarts are spent: it trains on" in run.stdout
    assert "restart 1: training seed 10001" in run.stdout  # the training's own line says which seed
    done = [line for line in run.stdout.splitlines() if line.startswith("[seed 1 rotary]") and "done training" in line]
    assert len(done) == 3  # three trainers (2 updates, then 2 and 4 of the second attempt), each shown once
    assert re.search(r"\| rotary \| not by 4 \([\d /]+\) after 1 restart \([\d /]+ at 2\); 6 updates in all \|",
                     (out / "stages.md").read_text())
    again = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=600)
    assert again.returncode == 0 and "2/3 training" not in again.stdout and "restart 1 of" not in again.stdout
    assert sorted(p.name for p in (out / "seed1" / "restarts").iterdir()) == ["rotary.1"]
    # numbered past the last attempt kept (not counted: an attempt removed by hand leaves a gap)
    (out / "seed1" / "restarts" / "rotary.1").rename(out / "seed1" / "restarts" / "rotary.2")
    shutil.rmtree(model)
    gap = subprocess.run([script], capture_output=True, text=True, timeout=600,
                         env=cli_env(**dict(settings, UPDATES="2", RESTART_AT_rotary="", UNTIL="")))
    assert gap.returncode == 0 and "restart 2: training seed 20001" in gap.stdout, gap.stdout[-2000:] + gap.stderr
    assert "'seed': 20001," in (model / "train.log").read_text()
    for extra, message in (
            (dict(UNTIL=""), "error: RESTART_AT=2 (rotary) needs checks: give UNTIL too (e.g. UNTIL=90), or leave "
                             "RESTART_AT empty"),
            (dict(RESTART_AT_rotary="3"), "error: RESTART_AT=3 (rotary) is not one of its checks: a multiple of "
                                          "CHECK_EVERY=2 below its budget of 4 updates"),
            (dict(RESTART_AT_rotary="4"), "error: RESTART_AT=4 (rotary) is not one of its checks: a multiple of "
                                          "CHECK_EVERY=2 below its budget of 4 updates"),
            (dict(RESTART_AT_rope="2"), "error: RESTART_AT_rope names 'rope', which is not a model; allowed suffixes: "
                                        "sinusoidal " + " ".join(POSITIONS)),
            (dict(RESTART_BELOW="0"), "error: RESTART_BELOW=0 is not allowed: a whole percentage from 1 to 100 "
                                      "(e.g. 10)"),
            (dict(RESTARTS="-1"), "error: RESTARTS=-1 is not allowed: the most restarts of one model, a whole number "
                                  "(e.g. 3)")):
        refused = subprocess.run([script], capture_output=True, text=True, timeout=600,
                                 env=cli_env(**dict(settings, OUT=str(tmp_path / "wrong"), **extra)))
        assert refused.returncode == 1 and refused.stderr.splitlines() == [message], refused.stderr
    assert not (tmp_path / "wrong").exists()  # refused before anything ran


@pytest.mark.slow
def test_every_family_allows_six_restarts(tmp_path):
    """RECIPE=every-family allows six restarts where RESTARTS is not given
    (three in the other recipes): the first restart's line says "of at most 6".
    The run is stopped there (Ctrl-C), which the recipe reports as such."""
    import os
    import signal
    import subprocess

    from conftest import cli_env, ctrl_c_restored, recipe_bin

    settings = dict(VENV_BIN=recipe_bin(), OUT=str(tmp_path / "out"), DATA=str(tmp_path / "data"), SEEDS="1",
                    L="64", LAYERS="1", DIM="16", FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2",
                    UPDATES="4", WARMUP="2", MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1",
                    RECIPE="every-family", MODELS="rotary", UPDATES_rotary="", METHODS="none", LENGTHS="1x",
                    CHECK_EVERY="2", UNTIL="100", RESTART_AT_rotary="2", RESTART_BELOW="100")
    run = subprocess.Popen([str(EXAMPLES / "retrieval" / "run.sh")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=cli_env(**settings), start_new_session=True,
                           preexec_fn=ctrl_c_restored)
    try:
        restart = next((line for line in run.stdout if "restart 1 of at most" in line), "")
    finally:
        os.killpg(run.pid, signal.SIGINT)
        rest = run.communicate(timeout=300)[0]
    assert "below 100%: restart 1 of at most 6, training seed 10001" in restart, restart
    assert run.returncode == 130 and "interrupted" in rest, rest[-2000:]


@pytest.mark.slow
def test_recipe_script_trains_every_model_and_summarizes_by_family(tmp_path):
    """examples/retrieval/run.sh at toy size, RECIPE=families plus the sinusoidal
    baseline: an ALiBi and a RoPE model per seed, the sinusoidal one for the
    first seed only, one retrieval run per seed with each model under the
    methods that apply to it (cap: ALiBi's only; yarn:2: RoPE's only); the
    summary has a column per model at each length, each method's numbers under
    the models it applies to (equal to the cells') and n/a under the others; a
    re-run trains nothing again; an unknown model or recipe is refused before anything runs."""
    import subprocess

    from conftest import cli_env, recipe_bin

    out, data = tmp_path / "out", tmp_path / "data"
    settings = dict(VENV_BIN=recipe_bin(), OUT=str(out), DATA=str(data), SEEDS="1 2", L="64", LAYERS="1", DIM="16",
                    FFN="32", HEADS="2", DOCS="200", KEYS="16", DIGITS="2", UPDATES="3", WARMUP="2",
                    MAX_TOKENS="256", DEPTHS="1", SAMPLES="2", EVAL_THREADS="1", RECIPE="families",
                    MODELS="alibi rotary sinusoidal", METHODS="none,cap,yarn:2", LENGTHS="1x,2x")
    script = str(EXAMPLES / "retrieval" / "run.sh")
    first = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    trained = sorted(p.parent.relative_to(out).as_posix() for p in out.glob("seed*/*/trained.ok"))
    assert trained == ["seed1/alibi", "seed1/rotary", "seed1/sinusoidal", "seed2/alibi", "seed2/rotary"]
    runs, applies = {}, {"alibi": {"none", "cap"}, "rotary": {"none", "yarn"}, "sinusoidal": {"none"}}
    for seed in (1, 2):
        cells = json.loads((out / f"seed{seed}" / "families" / "results.json").read_text())["cells"]
        runs[f"seed{seed}"] = cells
        for name in {c["checkpoint"] for c in cells}:
            assert {c["method"] for c in cells if c["checkpoint"] == name} == applies[name]
            assert {c["model"] for c in cells if c["checkpoint"] == name} == {
                "transformer_lm" if name == "sinusoidal" else f"transformer_lm_{name}"}
    summary = (out / "summary-families.md").read_text()
    header, *rows = markdown_rows(summary, "Accuracy % by prompt length")
    columns = [(name, length) for length in (64, 128) for name in ("alibi", "rotary", "sinusoidal")]
    assert header == ["method"] + [f"{name} {length} ({length // 64}x)" for name, length in columns]
    labels = {c["method"]: c["label"] for cells in runs.values() for c in cells}
    assert [row[0] for row in rows] == [labels["none"], labels["cap"], labels["yarn"]]
    for (label, *shown), method in zip(rows, ("none", "cap", "yarn")):
        for (name, length), cell in zip(columns, shown):
            if method not in applies[name]:
                assert cell == "n/a", (label, name, length)
                continue
            mine = [[c for c in cells if c["checkpoint"] == name] for cells in runs.values()]
            assert cell == spread_by_hand([counts(cs, label, length) for cs in mine if cs]), (label, name, length)
    assert "## alibi (transformer_lm_alibi): 2 runs" in summary
    assert "## rotary (transformer_lm_rotary): 2 runs" in summary
    assert "## sinusoidal (transformer_lm): 1 run (seed1)" in summary
    assert (out / "summary-families.png").stat().st_size > 0
    again = subprocess.run([script], capture_output=True, text=True, env=cli_env(**settings), timeout=600)
    assert again.returncode == 0
    assert again.stdout.count("already trained") == 5 and "2/3 training" not in again.stdout
    failing = subprocess.run([script], capture_output=True, text=True, timeout=600, env=cli_env(**dict(
        settings, MODELS="t5bias", METHODS="none", SEEDS="1", EXTRA_TRAIN_ARGS="--t5-max-distance 16",
        OUT=str(tmp_path / "failing"))))
    log = tmp_path / "failing" / "seed1" / "t5bias" / "train.log"
    assert failing.returncode == 1 and failing.stderr.splitlines()[-1] == (
        "error: training seed 1 t5bias failed (exit 1): t5_max_distance=16 is not valid with t5_buckets=32; "
        f"it must be > 16 (the exact buckets, half of t5_buckets) (log: {log})")
    assert "3/3 retrieval" not in failing.stdout
    wrong = subprocess.run([script], capture_output=True, text=True, timeout=600,
                           env=cli_env(**dict(settings, MODELS="alibi rope", OUT=str(tmp_path / "wrong"))))
    assert wrong.returncode == 1 and not (tmp_path / "wrong").exists()
    assert wrong.stderr.splitlines() == [
        "error: MODELS names 'rope', which is not a position method; allowed values: "
        + " ".join(["sinusoidal", *POSITIONS])]
    recipe = subprocess.run([script], capture_output=True, text=True, timeout=600,
                            env=cli_env(**dict(settings, RECIPE="both", OUT=str(tmp_path / "wrong"))))
    assert recipe.returncode == 1 and recipe.stderr.splitlines() == [
        "error: RECIPE=both is not a recipe; allowed values: methods, families, every-family"]


def test_corpus_generator_refuses_a_length_that_holds_no_record(tmp_path):
    result = run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", tmp_path,
                      "--max-length", "20", "--digits", "2"], expect_ok=False)
    assert result.returncode == 2 and "Traceback" not in result.output
    assert "--max-length 20 is too short" in result.stderr and "at least 41 words" in result.stderr


def test_corpus_filler_documents_hold_their_answer_and_fit(tmp_path):
    """corpus.py --filler-share: about that share of documents put filler
    sentences (5-9 corpus words and a full stop) between their records; every
    document fits in --max-length words and ends with the question about one of
    its own records and that record's number (read back from the text, as a
    model would); share 0 writes the plain corpus, share 1 only filler
    documents; a share outside [0, 1] is refused.  With --filler-words
    non-keys the sentences hold no key, only words of their own pool."""
    def documents(share, name, *extra):
        run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", tmp_path / name, "--max-length",
                 "90", "--keys", "40", "--digits", "2", "--train-docs", "400", "--valid-docs", "5",
                 "--filler-share", str(share), *extra])
        return [line.split() for line in (tmp_path / name / "train.txt").read_text().splitlines()]

    header = "below is a record of lines i want you to remember .".split()
    question = "now the record is over . tell me the REGISTER_CONTENT in line".split()
    keys = {f"k{i}" for i in range(40)}

    def parse(words):
        """(records {key: number}, filler sentences, queried key, its answer) of a filler document."""
        assert words[:len(header)] == header
        at = next(i for i in range(len(words)) if words[i:i + len(question)] == question)
        body, tail = words[len(header):at], words[at + len(question):]
        records, fillers, i = {}, [], 0
        while i < len(body):
            if body[i] == "line" and body[i + 2:i + 5] == [":", "REGISTER_CONTENT", "is"]:  # line KEY : ... D D .
                assert body[i + 7] == ".", body[i:i + 8]
                records[body[i + 1]] = body[i + 5:i + 7]
                i += 8
            else:
                end = body.index(".", i)
                fillers.append(body[i:end])
                i = end + 1
        key = tail[0]
        assert tail[1:7] == [".", "line", key, ":", "REGISTER_CONTENT", "is"]
        return records, fillers, key, tail[7:9]

    def filler_count(docs, pool=keys):
        count, used = 0, set()
        for words in docs:
            assert len(words) <= 90
            records, fillers, key, answer = parse(words)
            assert records and key in records and answer == records[key], words
            assert all(5 <= len(f) <= 9 and set(f) <= pool | set(header + question) for f in fillers), fillers
            count += bool(fillers)
            used.update(w for f in fillers for w in f)
        return count, used

    assert filler_count(documents(0, "plain"))[0] == 0
    count, used = filler_count(documents(0.5, "mixed"))
    assert 140 < count < 220 and len(used & keys) > 30  # about half of 400 (a few too long for a sentence)
    assert filler_count(documents(1, "all"))[0] > 320
    non_keys = {f"f{i}" for i in range(40)}
    count, used = filler_count(documents(0.5, "non-keys", "--filler-words", "non-keys"), pool=non_keys)
    assert 140 < count < 220 and not used & keys and len(used & non_keys) > 30

    refused = run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", tmp_path / "x",
                       "--max-length", "90", "--filler-share", "1.5"], expect_ok=False)
    assert refused.returncode == 2 and "--filler-share must be between 0 and 1" in refused.stderr
    refused = run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", tmp_path / "x",
                       "--max-length", "90", "--filler-words", "non-keys"], expect_ok=False)
    assert refused.returncode == 2 and "--filler-words non-keys needs filler documents" in refused.stderr


def test_corpus_adjacent_layout_documents_and_prompts_answer_their_question(tmp_path):
    """corpus.py --layout adjacent: every record is `line KEY D D .`, every
    document (filler or not) ends with `line KEY` and that record's number;
    the layout's --template-args give alibi-retrieval's lines prompts the same
    records and question, and token_losses' kinds find the answer's first
    digit after its key."""
    sys.path.insert(0, str(EXAMPLES / "retrieval"))
    try:
        import token_losses
    finally:
        sys.path.pop(0)
    from fairseq_alibi.evaluation import prompts as P
    from fairseq_alibi.evaluation.retrieval import _template

    run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--destdir", tmp_path, "--max-length", "60",
             "--keys", "30", "--digits", "2", "--train-docs", "50", "--valid-docs", "2", "--filler-share", "0.5",
             "--layout", "adjacent"])
    header = token_losses.record_header("adjacent")
    assert header == ("line", "{key}")

    def check(words, answer_at):
        records = {words[i + 1]: words[i + 2:i + 4] for i in range(len(words) - 4)
                   if words[i] == "line" and words[i + 2].isdigit() and words[i + 4] == "."}
        key = words[answer_at - 1]
        assert words[answer_at - 2] == "line" and records[key] == words[answer_at:answer_at + 2], words
        kinds = token_losses.token_kinds(words, header)
        assert kinds[answer_at:answer_at + 2] == ["retrieved 1st digit", "retrieved later digit"], words

    documents = [line.split() for line in (tmp_path / "train.txt").read_text().splitlines()]
    assert any(len(d) > 40 and "REGISTER_CONTENT" in d[:-8] for d in documents)
    for words in documents:
        assert ":" not in words and len(words) <= 60
        check(words, next(i for i in range(len(words)) if words[i - 7:i - 2] == "tell me the REGISTER_CONTENT in".split()
                          ) + 3)
    args = run_cli([sys.executable, EXAMPLES / "retrieval" / "corpus.py", "--layout", "adjacent",
                    "--template-args", "lines"]).stdout.splitlines()
    assert args[::2] == ["--template"] * 2
    vocabulary = P.Vocabulary(sorted({w for d in documents for w in d}))
    task = P.make_task("lines", vocabulary, digits=2, template=_template(args[1::2]))
    prompt = task.build(50, 0, 1, random.Random(3))
    check(prompt.prompt + prompt.answer, len(prompt.prompt))


def _fake_cells(path, cells):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {}, "cells": cells}))


@pytest.mark.slow
def test_frontier_example_tables_choice_goal_and_plot(tmp_path):
    """examples/retrieval/frontier.py on hand-made results: accuracies pooled per
    seed (mean [min, max] over seeds), costs against none on the same windows
    (point and paired interval), the family member chosen on the tune side, the
    goal judged on the report side, and the figure."""
    import random

    rng = random.Random(0)
    methods = {"none": (0.30, 0.0), "cap": (0.80, 0.020), "log:1:0.25": (0.78, 0.004), "log": (0.60, 0.001),
               "capnorm": (0.50, 0.009)}  # (accuracy, perplexity cost)
    base = [rng.uniform(4.0, 6.0) for _ in range(40)]  # per-window summed loss (bits), 10 tokens each

    def sweep_cells(name, jitter):
        cells = []
        for spelling, (_, cost) in methods.items():
            from fairseq_alibi.core.scaling import Scaling

            s = Scaling.parse(spelling)
            losses = [b + 10 * math.log2(1 + cost) + jitter * rng.uniform(-0.01, 0.01) for b in base]
            loss = sum(losses) / (10 * len(losses))
            cells.append(dict(checkpoint=name, method=s.method, factor=s.factor, alpha=s.alpha, mode="nonoverlapping",
                              length_ratio=16.0, ppl=2 ** loss, window_loss=losses, window_tokens=[10] * len(losses)))
        return cells

    def side(root, seeds, shift):
        for i, seed in enumerate(seeds):
            for task in ("lines", "passkey"):
                cells = []
                for spelling, (acc, _) in methods.items():
                    from fairseq_alibi.core.scaling import Scaling

                    s = Scaling.parse(spelling)
                    correct = round(100 * min(1.0, acc + shift + 0.02 * i))
                    for ratio in (1.0, 8.0):
                        cells.append(dict(checkpoint="alibi", method=s.method, factor=s.factor, alpha=s.alpha,
                                          length_ratio=ratio, correct=correct if ratio == 8.0 else 100, n=100))
                _fake_cells(root / f"seed{seed}" / task / "results.json", cells)
        _fake_cells(root / "sweep" / "results.json", sum((sweep_cells(f"seed{s}", 1) for s in seeds), []))

    side(tmp_path / "tune", ["1", "2"], 0.0)
    side(tmp_path / "report", ["5", "6", "7"], 0.01)
    # the demo windows vary a little between methods (a shift alike on every window has no interval)
    _fake_cells(tmp_path / "demo.json", sweep_cells("demo-s1", 0.1) + sweep_cells("demo-s2", 0.1))
    out = run_cli([sys.executable, EXAMPLES / "retrieval" / "frontier.py", "--methods", ",".join(methods),
                   "--tune", tmp_path / "tune", "--tune-seeds", "1 2", "--report", tmp_path / "report",
                   "--report-seeds", "5 6 7", "--demo-sweep", tmp_path / "demo.json", "--output", tmp_path / "fig"]).stdout
    rows = {line.split("`")[1]: [c.strip() for c in line.split("|")[2:-1]]
            for line in out.split("## Report")[1].splitlines() if line.startswith("| `")}
    # log:1:0.25 is the log family's best tune retrieval within 0.5 % (log:1:0.25 costs 0.4 %)
    assert "Chosen per family" in out and "log: `log:1:0.25`" in out and "capnorm: `capnorm`" in out
    assert rows["log:1:0.25"][-1] == "yes"  # within 5 points of cap at <= 0.5 %
    assert rows["cap"][-1] == "cost" and rows["log"][-1] == "retrieval" and rows["capnorm"][-1] == "neither"
    # lines at 8x on the report seeds: 79, 81, 83 % -> mean 81 [79, 83]
    assert rows["log:1:0.25"][0].startswith("81 [79, 83]")
    # the demo cost: the point from the perplexities, and a paired interval around it
    cost, interval = rows["cap"][2].split(" ", 1)
    low, high = (float(x.strip("%")) for x in interval.strip("[]").split(", "))
    assert cost == "+2.00%" and low <= 2.0 + 1e-9 and high >= 2.0 - 1e-9 and high - low < 0.01
    assert (tmp_path / "fig" / "frontier.png").stat().st_size > 0


def test_learning_curves_from_the_recipes_logs(tmp_path):
    """examples/retrieval/curves.py: the held-out loss per update from a
    model directory's train.log (the last value where a resumed run
    validated one update twice) and from a log file (a diverged "inf"
    kept); the table every --every updates plus each curve's last, blank
    where a curve has no value; the plot written; one error line and exit 1
    for a log without a validation line, one with a loss that is no number,
    an unreadable path and a non-UTF-8 log."""
    def valid(loss, updates):
        return (f"2026-11-29 01:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss {loss} | "
                f"ppl 4.0 | wps 1.0 | wpb 1.0 | bsz 36 | num_updates {updates} | best_loss {loss}\n")

    model = tmp_path / "rotary"
    model.mkdir()
    (model / "train.log").write_text(
        "2026-11-29 | INFO | train_inner | epoch 001: loss=9.0, num_updates=50\n"
        + valid(2.5, 250) + valid(2.25, 500) + valid(2.125, 750)
        + "resuming from checkpoint_last.pt\n" + valid(2.0, 750) + valid(1.75, 1000))
    other = tmp_path / "nope.log"
    other.write_text(valid(2.75, 500) + valid("inf", 1000) + valid(2.5, 1500))
    script = str(EXAMPLES / "retrieval" / "curves.py")
    out = tmp_path / "out" / "curves"
    result = run_cli([sys.executable, script, "-c", f"rope={model}", "-c", f"nope={other}",
                      "--output", str(out), "--every", "500"])
    table = result.stdout.strip().splitlines()
    assert table[0] == "| updates | rope | nope |"
    assert table[2:] == ["| 500 | 2.250 | 2.750 |", "| 1,000 | 1.750 | inf |", "| 1,500 |  | 2.500 |"]
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0
    assert "| 1,000 | 1.750 | inf |" in (tmp_path / "out" / "curves.md").read_text()
    sys.path.insert(0, str(EXAMPLES / "retrieval"))
    try:
        import curves
    finally:
        sys.path.pop(0)
    assert curves.read_curve(str(model)) == {250: 2.5, 500: 2.25, 750: 2.0, 1000: 1.75}

    (tmp_path / "empty.log").write_text("2026-11-29 | INFO | train_inner | num_updates=50\n")
    (tmp_path / "latin1.log").write_bytes(b"caf\xe9 " + valid(2.0, 500).encode())
    (tmp_path / "garbled.log").write_text(valid("2.0x", 500))
    for path, message in ((tmp_path / "empty.log", "has no validation line"),
                          (tmp_path / "garbled.log", "whose loss is not a number"),
                          (tmp_path / "missing", "cannot read"),
                          (tmp_path / "latin1.log", "is not UTF-8 text")):
        bad = run_cli([sys.executable, script, "-c", f"x={path}", "--output", str(out)], expect_ok=False)
        assert bad.returncode == 1 and len(error_lines(bad)) == 1 and message in error_lines(bad)[0], bad.output
    twice = run_cli([sys.executable, script, "-c", f"a={other}", "-c", f"a={other}", "--output", str(out)],
                    expect_ok=False)
    assert twice.returncode == 2 and "given twice" in twice.output


def test_stage_checks_record_and_report_the_updates_each_model_took(tmp_path):
    """examples/retrieval/stages.py: a stage's check is each task's accuracy at
    1x without an extension method, every depth pooled (cells at 2x or under
    another method left out), one row per stage (a stage checked again
    replaced); the report gives the first check at which every task reached
    UNTIL, or "not by" the last, and the plot is written; one error line and
    exit 1 for results without a 1x cell, a malformed checks.tsv and an OUT
    without checks."""
    def results(path, checkpoint, cells):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": {}, "cells": [
            dict(checkpoint=checkpoint, length_ratio=ratio, method=method, correct=correct, n=n)
            for ratio, method, correct, n in cells]}))
        return str(path)

    script = str(EXAMPLES / "retrieval" / "stages.py")
    out = tmp_path / "out"
    alibi, rope = out / "seed7" / "alibi", out / "seed7" / "rotary"
    lines = results(tmp_path / "a" / "lines.json", "alibi", [(1.0, "none", 9, 10), (1.0, "none", 8, 10),
                                                             (2.0, "none", 0, 10), (1.0, "logn", 0, 10)])
    passkey = results(tmp_path / "a" / "passkey.json", "alibi", [(1.0, "none", 10, 10), (1.0, "none", 9, 10)])
    alibi.mkdir(parents=True)
    assert run_cli([sys.executable, script, "record", str(alibi), "1500", lines, passkey]).stdout == "1500\t85.0\t95.0\n"
    better = results(tmp_path / "b" / "lines.json", "alibi", [(1.0, "none", 19, 20)])
    run_cli([sys.executable, script, "record", str(alibi), "3000", better, passkey])
    run_cli([sys.executable, script, "record", str(alibi), "1500", lines, passkey])  # the same stage again: one row
    assert (alibi / "checks.tsv").read_text() == "1500\t85.0\t95.0\n3000\t95.0\t95.0\n"
    rope.mkdir(parents=True)
    (rope / "checks.tsv").write_text("1500\t2.0\t30.0\n3000\t40.0\t88.0\n")
    report = run_cli([sys.executable, script, "report", str(out), "--until", "90", "--plot",
                      str(tmp_path / "stages.png")]).stdout
    assert "| alibi | **3,000** (95 / 95) |" in report and "| rotary | not by 3,000 (40 / 88) |" in report
    assert "| rotary | seed7 | 1,500: 2 / 30, 3,000: 40 / 88 |" in report
    assert (tmp_path / "stages.png").stat().st_size > 0
    lower = run_cli([sys.executable, script, "report", str(out), "--until", "85"]).stdout
    assert "| alibi | **1,500** (85 / 95) |" in lower
    # 1,799 of 2,000 is 89.95%: kept as computed, it does not reach 90 (rounded to 90.0 it did)
    close = results(tmp_path / "d" / "lines.json", "alibi", [(1.0, "none", 1799, 2000)])
    row = run_cli([sys.executable, script, "record", str(alibi), "4500", close, passkey]).stdout
    assert row.split("\t")[:2] == ["4500", repr(100.0 * 1799 / 2000)]
    near = run_cli([sys.executable, script, "report", str(out), "--until", "90"]).stdout
    assert "| alibi | **3,000** (95 / 95) |" in near and "4,500: 89.95 / 95" in near
    run_cli([sys.executable, script, "record", str(alibi), "3000", close, passkey])  # 3,000 now at 89.95 too
    assert "| alibi | not by 4,500 (89.95 / 95) |" in run_cli(
        [sys.executable, script, "report", str(out), "--until", "90"]).stdout
    (alibi / "checks.tsv").write_text("1500\t85.0\t95.0\n3000\t95.0\t95.0\n")

    # a model started again (RESTART_AT): its discarded attempts beside the one that stands
    for number, rows in ((1, "1500\t1.0\t20.0\n3000\t4.0\t30.0\n"), (2, "1500\t0.0\t10.0\n3000\t2.0\t25.0\n")):
        (out / "seed7" / "restarts" / f"rotary.{number}").mkdir(parents=True, exist_ok=True)
        (out / "seed7" / "restarts" / f"rotary.{number}" / "checks.tsv").write_text(rows)
    # the training seeds, as fairseq's config lines give them (each stage logs its config); attempt 2 has no log
    (out / "seed7" / "restarts" / "rotary.1" / "train.log").write_text("{'common': {'seed': 7}}\n" * 2)
    (rope / "train.log").write_text("{'common': {'seed': 20007, 'fixed_validation_seed': None}}\n")
    (rope / "checks.tsv").write_text("1500\t30.0\t70.0\n3000\t91.0\t96.0\n")
    restarted = run_cli([sys.executable, script, "report", str(out), "--until", "90"]).stdout
    assert ("| rotary | **3,000** (91 / 96) after 2 restarts (4 / 30 at 3,000; 2 / 25 at 3,000); "
            "9,000 updates in all |") in restarted
    assert "| rotary | seed7, attempt 1 (training seed 7, discarded) | 1,500: 1 / 20, 3,000: 4 / 30 |" in restarted
    assert "| rotary | seed7, attempt 2 (discarded) | 1,500: 0 / 10, 3,000: 2 / 25 |" in restarted
    assert "| rotary | seed7, attempt 3 (training seed 20,007) | 1,500: 30 / 70, 3,000: 91 / 96 |" in restarted
    assert "| alibi | seed7 | 1,500: 85 / 95, 3,000: 95 / 95 |" in restarted  # one attempt: as before
    (rope / "checks.tsv").unlink()  # the third attempt before its first check
    assert ("| rotary | training (no check yet) after 2 restarts (4 / 30 at 3,000; 2 / 25 at 3,000); "
            "6,000 updates in all |") in run_cli([sys.executable, script, "report", str(out), "--until", "90",
                                                  "--plot", str(tmp_path / "restarts.png")]).stdout
    assert (tmp_path / "restarts.png").stat().st_size > 0
    shutil.rmtree(out / "seed7" / "restarts")

    far = results(tmp_path / "c" / "lines.json", "alibi", [(2.0, "none", 1, 10)])
    (rope / "checks.tsv").write_text("1500\t2.0\n")
    for args, message in ((["record", str(alibi), "4500", far], "holds no cell at 1x without an extension method"),
                          (["report", str(out), "--until", "90"], "is not a check"),
                          (["report", str(tmp_path / "none"), "--until", "90"], "holds no staged training")):
        bad = run_cli([sys.executable, script, *args], expect_ok=False)
        assert bad.returncode == 1 and len(error_lines(bad)) == 1 and message in error_lines(bad)[0], bad.output


# ------------------------------------------------------- subword tokenizers
def byte_level_encoder():
    """An HF encoder over a byte-level BPE trained here (the kind BLOOM, MPT and
    Falcon use: a word's leading space is part of its token)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from fairseq_alibi.evaluation.hf_backend import HFEncoder

    text = " ".join(P.Passkey.template.values()).replace("|", " ").replace("{number}", "1 2 3 4 5 6 7 8 9 0")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text] * 20, vocab_size=300, min_frequency=1, show_progress=False)
    return HFEncoder(PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer))


def test_a_subword_answer_is_spelled_as_the_prompt_continues_into_it():
    """Byte-level BPE spells '1' after 'is ' as 'Ġ1', alone as '1': the answer's
    ids are those the whole text has after the prompt's, the first of them the
    space-carrying one a model would write (scored against the bare '1', no
    greedy answer could be right)."""
    encoder = byte_level_encoder()
    prompt, answer = "What is the pass key ? The pass key is", "4 2 7"
    ids, answer_ids = retrieval.prompt_and_answer(encoder, prompt, answer)
    tokens = encoder.tokenizer.convert_ids_to_tokens
    assert ids + answer_ids == encoder.encode(f"{prompt} {answer}") and ids == encoder.encode(prompt)
    assert tokens(answer_ids)[0] == "Ġ4" and tokens(encoder.encode(answer))[0] == "4"


def test_built_in_prompts_fit_their_length_in_a_subword_tokenizer_s_tokens():
    """A tokenizer that spells words in several tokens gets prompts of at most
    the cell's length in its own tokens (built to that many words they ran far
    past it), close to it, the answer the continuation's ids; a word-level
    dictionary's prompts are the words themselves, as before."""
    encoder = byte_level_encoder()
    task = P.make_task("passkey", encoder.vocabulary())
    built = retrieval.builtin_samples(task, encoder, [200, 500], depths=2, samples=3, seed=0)
    for (length, _), samples in built.items():
        for s in samples:
            assert length - 40 <= s.length <= length, (length, s.length)
            assert encoder.tokenizer.convert_ids_to_tokens(s.answer)[0].startswith("Ġ")
    unfitted = task.build(500, 0, 2, random.Random("0:passkey:500:0/2:0"))
    assert len(encoder.encode(" ".join(unfitted.prompt))) > 500  # what a word budget alone gave
    spelled = {w for ws in task.words.values() for w in ws} | {w for s in task.filler for w in s} | set(P.DIGITS)
    words = P.Vocabulary(sorted(spelled))
    word_task = P.make_task("passkey", words)
    fitted, ids, answer = retrieval.fitted_prompt(word_task, WordEncoder(words), 120, 0, 2, "k")
    assert fitted == word_task.build(120, 0, 2, random.Random("k")) and len(ids) == len(fitted.prompt)


class WordEncoder:
    """One id per word of a closed vocabulary (a word-level dictionary)."""

    subword = False

    def __init__(self, vocab):
        self.ids = {w: i for i, w in enumerate(vocab.ordered)}

    def encode(self, text, where=""):
        return [self.ids[w] for w in text.split()]


def test_a_fairseq_checkpoint_s_bpe_spells_built_in_prompts():
    """A checkpoint with a BPE reads a built-in task's words through it (they
    were looked up in its dictionary of BPE ids as words: every one <unk>)."""
    from fairseq.data import Dictionary

    class IdsBPE:  # GPT-2's BPE writes ids as words
        table = {"The": "464", "pass": "1208", "key": "1994", "is": "318", "4": "19", "2": "17"}

        def encode(self, text):
            return " ".join(self.table[w] for w in text.split())

    dictionary = Dictionary()
    for symbol in IdsBPE.table.values():
        dictionary.add_symbol(symbol)
    encoder = backends.Encoder(dictionary, bpe=IdsBPE())
    ids = encoder.words("The pass key is 4 2".split())
    assert dictionary.unk() not in ids and [dictionary[i] for i in ids] == "464 1208 1994 318 19 17".split()


def test_each_depth_panel_holds_one_method_also_when_only_alpha_differs(tmp_path, monkeypatch):
    """log:1 and log:1:0.25 share method and factor: each panel is its own label's
    cells (they were pooled, the later overwriting the earlier in both panels)."""
    from matplotlib.axes import Axes

    from fairseq_alibi.evaluation import report

    grids = []
    stock = Axes.imshow
    monkeypatch.setattr(Axes, "imshow", lambda self, grid, **kw: grids.append(grid) or stock(self, grid, **kw))
    cells = [dict(checkpoint="m", task="passkey", method="log", factor=1.0, label=label, length=64, depth=0.5,
                  accuracy=accuracy, correct=round(10 * accuracy), n=10) for label, accuracy in (("log x1 a1", 0.2), ("log x1 a0.25", 0.9))]
    report.plot_retrieval_depth(str(tmp_path / "depth.png"), cells, lambda c: 0)
    assert sorted(g[0][0] for g in grids) == [20.0, 90.0]
