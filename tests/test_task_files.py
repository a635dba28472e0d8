"""Prompt files of ``alibi-retrieval --task FILE.jsonl`` (``evaluation/task_files.py``):
our own format, LongEval's lines and topics test cases and RULER's JSONL, written
here in exactly the published layouts; and one file of each through
``alibi-retrieval --hf`` against a direct computation on a tiny MPT."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from fairseq_alibi import hf
from fairseq_alibi.errors import EvaluationError, TextInputError
from fairseq_alibi.evaluation import retrieval
from fairseq_alibi.evaluation.task_files import LONGEVAL_LINES_CUE, LONGEVAL_TOPICS_CUE, read_task_file

ADJECTIVES = ["torpid", "righteous", "calm", "eager", "brave", "quiet", "swift", "gentle"]
NOUNS = ["kid", "ethernet", "river", "lamp", "stone", "cloud", "forest", "engine"]


def longeval_lines_case(rng: random.Random, n: int) -> dict:
    """A test case as LongChat's longeval writes it (LRT-NL line keys)."""
    keys = [f"{a}-{b}" for a, b in zip(rng.sample(ADJECTIVES, n), rng.sample(NOUNS, n))]
    lines = [f"line {k}: REGISTER_CONTENT is <{rng.randint(1, 50000)}>\n" for k in keys]
    pos = rng.randrange(n)
    number = int(lines[pos].split("<")[1].split(">")[0])
    header = ("Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
              "contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, "
              "memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve "
              "the corresponding <REGISTER_CONTENT> of a certain line index. Now the record start:\n\n")
    question = f"\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {keys[pos]}? I need the number."
    return {"random_idx": [keys[pos], pos], "expected_number": number, "num_lines": n, "correct_line": lines[pos],
            "prompt": header + "".join(lines) + question}


def longeval_topics_case(rng: random.Random, n: int) -> dict:
    topics = rng.sample(["the weather", "music", "travel", "cooking", "sports", "books"], n)
    convs = "".join(f" USER: I would like to discuss the topic of {t}. ASSISTANT: Sure, {t} is nice." for t in topics)
    prompt = (f"Below is a record of our previous conversation on {n} different topics. You are the ASSISTANT, and "
              "I am the USER. Now the record start. " + convs +
              " Now the record ends. What is the first topic(s) we discussed? Only give me the topic name. Do not "
              "summarize yourself.")
    return {"test_id": 0, "prompt": prompt, "topics": topics, "prompt_length": -1}


def ruler_case(rng: random.Random, index: int, outputs=None) -> dict:
    key, value = rng.choice(NOUNS), str(rng.randint(1000000, 9999999))
    text = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            f"The grass is green. One of the special magic numbers for {key} is: {value}. The sky is blue. "
            f"What is the special magic number for {key} mentioned in the provided text?")
    return {"index": index, "input": text, "outputs": outputs or [value], "length": 60, "length_w_model_temp": 60,
            "answer_prefix": f" The special magic number for {key} mentioned in the provided text is",
            "token_position_answer": 20}


def write(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_each_format_gives_its_prompt_answer_and_group(tmp_path):
    rng = random.Random(0)
    case = longeval_lines_case(rng, 4)
    [item] = read_task_file(str(write(tmp_path / "4_lines.jsonl", [case])))
    assert item.prompt == case["prompt"] + LONGEVAL_LINES_CUE.format(key=case["random_idx"][0])
    assert item.prompt.endswith(f"Line <{case['random_idx'][0]}>: <REGISTER_CONTENT> is")
    assert item.answer == f" <{case['expected_number']}>" and item.group == "4 lines"
    assert case["correct_line"].rstrip().endswith(item.answer.strip())  # the value as the record writes it
    topics = longeval_topics_case(rng, 3)
    [item] = read_task_file(str(write(tmp_path / "3_topics.jsonl", [topics])))
    assert item.prompt == topics["prompt"] + LONGEVAL_TOPICS_CUE and item.answer == " " + topics["topics"][0]
    assert item.group == "3 topics"
    ruler = ruler_case(rng, 0)
    [item] = read_task_file(str(write(tmp_path / "niah.jsonl", [ruler])))
    assert item.prompt == ruler["input"] + ruler["answer_prefix"] and item.answer == " " + ruler["outputs"][0]
    items = read_task_file(str(write(tmp_path / "own.jsonl", [{"prompt": "a b", "answer": "c", "group": 2}])))
    assert (items[0].prompt, items[0].answer, items[0].group) == ("a b", "c", "2")


@pytest.mark.parametrize("objs,message", [
    ([ruler_case(random.Random(1), 0, outputs=["1", "2", "1"])], "2 different outputs"),
    ([{"prompt": "x", "expected_number": "12", "random_idx": ["k", 0]}], "'expected_number' must be an integer"),
    ([{"prompt": "x", "topics": []}], "'topics' must be a non-empty list"),
    ([{"input": "x", "outputs": "y"}], "'outputs' must be a non-empty list"),
    ([{"prompt": "a", "answer": "b"}, {"prompt": "x", "topics": ["t"]}], "one format per file"),
    ([{"question": "a"}], "match no known format"),
    ([{"prompt": "the cat"}], "'answer' is missing"),
])
def test_bad_records_are_named_in_one_line(tmp_path, objs, message):
    with pytest.raises(EvaluationError, match=re.escape(message)) as error:
        read_task_file(str(write(tmp_path / "f.jsonl", objs)))
    assert "\n" not in str(error.value) and "f.jsonl:" in str(error.value)


def test_ruler_outputs_that_repeat_one_answer_are_that_answer(tmp_path):
    """RULER's qa_1 lists every SQuAD annotator's answer, often the same text:
    under either of RULER's metrics (all outputs, or any one) that is one answer."""
    case = ruler_case(random.Random(2), 0, outputs=["Denver Broncos", "Denver Broncos ", " Denver Broncos"])
    [item] = read_task_file(str(write(tmp_path / "qa_1.jsonl", [case])))
    assert item.answer == " Denver Broncos" and item.prompt == case["input"] + case["answer_prefix"]


def test_crlf_and_byte_order_mark_read_as_plain_lines(tmp_path):
    """Files saved on Windows: CRLF line ends, a UTF-8 byte-order mark, no final newline."""
    rng = random.Random(3)
    cases = [longeval_lines_case(rng, 3), longeval_lines_case(rng, 4)]
    plain = read_task_file(str(write(tmp_path / "lf.jsonl", cases)))
    windows = tmp_path / "crlf.jsonl"
    windows.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(c) for c in cases).encode())
    assert [(i.prompt, i.answer, i.group) for i in read_task_file(str(windows))] == \
        [(i.prompt, i.answer, i.group) for i in plain]


def test_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(TextInputError, match="is not UTF-8 text: byte 0xe9 at byte offset 15 "):
        read_task_file(str(path))


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def benchmark_files(tmp_path_factory):
    rng = random.Random(5)
    root = tmp_path_factory.mktemp("bench")
    files = {
        "lines": write(root / "4_lines.jsonl", [longeval_lines_case(rng, n) for n in (3, 4, 4, 6)]),
        "topics": write(root / "3_topics.jsonl", [longeval_topics_case(rng, n) for n in (2, 3, 3)]),
        "ruler": write(root / "niah_single_1.jsonl", [ruler_case(rng, i) for i in range(4)]),
    }
    return root, files


@pytest.fixture(scope="module")
def tiny_mpt(benchmark_files, tmp_path_factory):
    """A tiny MPT whose word-level tokenizer knows every word of the files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import MptConfig, MptForCausalLM, PreTrainedTokenizerFast

    _, files = benchmark_files
    texts = [item.prompt + item.answer for path in files.values() for item in read_task_file(str(path))]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>")
    torch.manual_seed(0)
    model = MptForCausalLM(MptConfig(vocab_size=tokenizer.get_vocab_size(), d_model=32, n_layers=2, n_heads=4,
                                     expansion_ratio=2, max_seq_len=64))
    path = tmp_path_factory.mktemp("mpt") / "mpt"
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lines", "topics", "ruler"])
def test_benchmark_files_through_alibi_retrieval(benchmark_files, tiny_mpt, tmp_path, monkeypatch, kind):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, files = benchmark_files
    out = tmp_path / "out"
    argv = ["--hf", f"mpt={tiny_mpt}", "--task", str(files[kind]), "--methods", "none,cap:0.25",
            "--output-dir", str(out), "--cpu", "--no-progress"]
    assert retrieval.main(argv) == 0
    cells = json.loads((out / "results.json").read_text())["cells"]
    model, tokenizer = hf.load_hf_model(str(tiny_mpt))
    items = read_task_file(str(files[kind]))
    for label, method in (("none", "none"), ("cap x0.25", "cap")):
        expected = {}
        with hf.alibi_scaling(model, method, 0.25 if method == "cap" else 0, 64):
            for item in items:
                prompt = tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
                answer = tokenizer(item.answer, add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logprobs = model(torch.tensor(prompt + answer[:-1])[None]).logits[0, -len(answer):]
                logprobs = logprobs.double().log_softmax(-1)
                ok = bool((logprobs.argmax(-1) == torch.tensor(answer)).all())
                lp = float(logprobs.gather(-1, torch.tensor(answer)[:, None]).mean())
                expected.setdefault((item.group, len(prompt + answer)), []).append((ok, lp))
        got = {(c["group"], c["length"]): c for c in cells if c["label"] == label}
        assert set(got) == set(expected)
        for key, values in expected.items():
            assert got[key]["n"] == len(values) and got[key]["correct"] == sum(ok for ok, _ in values)
            assert got[key]["answer_logprob"] == pytest.approx(sum(lp for _, lp in values) / len(values), abs=1e-5)
    if kind == "lines":
        assert {c["group"] for c in cells} == {"3 lines", "4 lines", "6 lines"}
    # cap changes the scores on these prompts (longer than C = 16 tokens): the comparison is not vacuous
    by_label = {label: [c["answer_logprob"] for c in cells if c["label"] == label] for label in ("none", "cap x0.25")}
    assert by_label["none"] != pytest.approx(by_label["cap x0.25"], abs=1e-6)


def test_builtin_options_are_refused_with_a_prompt_file(benchmark_files, tiny_mpt, tmp_path, capsys):
    _, files = benchmark_files
    with pytest.raises(SystemExit) as exit_info:
        retrieval.main(["--hf", str(tiny_mpt), "--task", str(files["ruler"]), "--lengths", "1x,2x",
                        "--depths", "3", "--output-dir", str(tmp_path), "--cpu", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.count("\n") == 1
    assert "--lengths, --depths apply to the built-in tasks" in err
