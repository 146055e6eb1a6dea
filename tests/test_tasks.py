"""Downstream tasks (eval.tasks: data/tasks.py reads them, training/tasks.py scores them): the
layouts and what they refuse, the pair's tokens, each pair's log-likelihood against one
computed here pair by pair, and in a run: the rows at world 1 and fsdp world 2, `scaletrain
eval` of the checkpoint, a model trained on the text it is tested on above chance."""

from __future__ import annotations

import glob
import json
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from scaletrain.config import load_config
from scaletrain.config.eval import TaskConfig
from scaletrain.config.parallel import dims_for
from scaletrain.data.tasks import Item, load_items, requests
from scaletrain.errors import UserError
from scaletrain.launch.distributed import ALONE
from scaletrain.models import model_spec
from scaletrain.models.llama import build_model
from scaletrain.models.presets import ModelShape
from scaletrain.telemetry.metrics import read_metrics
from scaletrain.training.tasks import Batching, open_tasks, score, task_row, tasks_problem

from helpers.launch import check, one_line_error, run, scaletrain, train
from helpers.runs import SMALL_CORPUS, base_overrides, checkpoint_model


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def task(path, **fields):
    return TaskConfig(name=fields.pop("name", "t"), path=str(path), kind=fields.pop("kind", "multiple_choice"), **fields)


@pytest.mark.unit
def test_each_layout_reads_its_records(tmp_path):
    mc = write(tmp_path / "mc.jsonl", [{"q": "2 + 2 =", "opts": ["4", "five"], "gold": 0}])
    [item] = load_items(task(mc, fields={"context": "q", "choices": "opts", "answer": "gold"}))
    assert item == Item(("2 + 2 =", "2 + 2 ="), (" 4", " five"), 0, (1, 4))
    lw = write(tmp_path / "lw.jsonl", [{"context": "the end of the", "continuation": "story"}])
    assert load_items(task(lw, kind="last_word")) == [Item(("the end of the",), (" story",), 0, (5,))]
    hs = {
        "activity_label": "Baking",
        "ctx_a": "A man mixes flour.",
        "ctx_b": "he",
        "endings": ["bakes [title] it", "x"],
        "label": "0",
    }
    [item] = load_items(task(write(tmp_path / "hs.jsonl", [hs]), layout="hellaswag"))
    assert item.contexts[0] == "Baking: A man mixes flour. He" and item.continuations == (" bakes. it", " x")
    arc = {"question": "Sky?", "choices": {"text": ["blue", "red"], "label": ["A", "B"]}, "answerKey": "B"}
    [item] = load_items(task(write(tmp_path / "arc.jsonl", [arc]), layout="arc"))
    assert (item.contexts[0], item.answer) == ("Question: Sky?\nAnswer:", 1)
    piqa = {"goal": "Open a jar", "sol1": "twist", "sol2": "sing", "label": 0}
    [item] = load_items(task(write(tmp_path / "piqa.jsonl", [piqa]), layout="piqa"))
    assert item.continuations == (" twist", " sing")
    wino = {"sentence": "Ann gave Bo the cup because _ was thirsty.", "option1": "Ann", "option2": "Bo", "answer": "2"}
    [item] = load_items(task(write(tmp_path / "wino.jsonl", [wino]), layout="winogrande"))
    assert item == Item(
        ("Ann gave Bo the cup because Ann", "Ann gave Bo the cup because Bo"), (" was thirsty.",) * 2, 1, (13, 13)
    )
    lam = write(tmp_path / "lam.jsonl", [{"text": "she opened the door"}])
    assert load_items(task(lam, kind="last_word", layout="lambada")) == [Item(("she opened the",), (" door",), 0, (4,))]


@pytest.mark.unit
def test_few_shot_examples_are_other_records_drawn_the_same_way_every_time(tmp_path):
    records = [{"context": f"q{i}", "choices": [f"a{i}", f"b{i}"], "answer": i % 2} for i in range(6)]
    path = write(tmp_path / "mc.jsonl", records)
    items = load_items(task(path, shots=2, limit=3))
    assert len(items) == 3 and items == load_items(task(path, shots=2, limit=3))
    for i, item in enumerate(items):
        shots = item.contexts[0].split("\n\n")
        assert len(shots) == 3 and shots[-1] == f"q{i}" and f"q{i} " not in item.contexts[0]
        for shot in shots[:-1]:  # each a record's context and its answer
            j = int(shot.split()[0][1:])
            assert shot == f"q{j} " + ("a", "b")[j % 2] + str(j)


@pytest.mark.unit
@pytest.mark.parametrize(
    "records, overrides, said",
    [
        ([{"context": "c", "answer": 0}], {}, r"mc.jsonl record 1 has no field 'choices' .*accepted: a record with it"),
        ([{"context": "c", "choices": [], "answer": 0}], {}, r"record 1 has no choices; accepted: a list of two or more"),
        ([{"context": "c", "choices": ["a", "b"], "answer": 2}], {}, r"record 1 answer 2 is out of range; accepted: 0 to 1"),
        (
            [{"context": "c", "choices": ["a", "b"], "answer": 0}] * 2,
            {"shots": 2},
            r"shots=2 but .* holds 2 record\(s\).*shots <= 1",
        ),
        ([{"context": 3, "choices": ["a"], "answer": 0}], {}, r"record 1 field 'context' is int; accepted: str"),
        (
            [{"context": "c", "continuation": "x"}],
            {"layout": "lambada"},
            r"layout lambada is a last word; accepted: kind=last_word",
        ),
    ],
)
def test_bad_records_are_one_line_naming_the_file_and_record(tmp_path, records, overrides, said):
    path = write(tmp_path / "mc.jsonl", records)
    with pytest.raises(UserError, match=r"^eval.tasks t: .*" + said):
        load_items(task(path, **overrides))


@pytest.mark.unit
def test_bad_files_and_layouts_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"missing.jsonl is not a file; accepted: a local .jsonl file"):
        load_items(task(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"context": "c"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl line 2 is not JSON"):
        load_items(task(tmp_path / "bad.jsonl"))
    with pytest.raises(UserError, match=r"eval.tasks names hs more than once"):
        load_config([], ["eval.tasks=[{name: hs, path: a, kind: last_word}, {name: hs, path: b, kind: last_word}]"])
    cfg = load_config([], ["eval.tasks=[{name: hs, path: a, kind: last_word}]", "parallel.strategy=fsdp", "parallel.tp=2"])
    assert "eval.tasks with parallel.tp=2: a pair's log-likelihood would be split over ranks" in tasks_problem(cfg)


class Chars:
    """A tokenizer of one token per character, but "ab" is one token: pairs that split inside it."""

    def __call__(self, text):
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(1)
                i += 2
            else:
                out.append(2 + ord(text[i]) % 60)
                i += 1
        return out


@pytest.mark.unit
def test_a_pair_is_split_as_lm_evaluation_harness_splits_it():
    enc = Chars()
    items = [Item(("xa ",), ("b",), 0, (1,)), Item(("xa",), ("b",), 0, (1,)), Item(("",), ("q",), 0, (1,))]
    pairs = requests(items, enc, 8, prefix=0, task="t")
    # The context's trailing space goes to the continuation; "a" + "b" join into one token
    # across the boundary, whose token is then the continuation's ("xa" + "b" = x, ab).
    assert pairs[0].tokens == tuple(enc("xa") + enc(" b")) and pairs[0].scored == 2
    assert pairs[1].tokens == (enc("x")[0], 1) and pairs[1].scored == 1
    assert pairs[2].tokens == (0, *enc("q")) and pairs[2].scored == 1  # an empty context: the prefix token
    long = requests([Item(("c" * 20,), ("d",), 0, (1,))], enc, 8, prefix=0, task="t")[0]
    assert long.tokens == tuple(enc("c" * 8 + "d")) and long.scored == 1  # cut from the left to the window + 1
    with pytest.raises(UserError, match=r"record 1 choice 0 is 9 tokens, more than data.seq_len=8"):
        requests([Item(("c",), ("d" * 9,), 0, (9,))], enc, 8, prefix=0, task="t")


class Engine:
    """Engine.evaluate's contract for one process: the model in eval mode, no gradient."""

    def __init__(self, model):
        self.model = model

    def evaluate(self, micro_batches, loss):
        with torch.no_grad():
            for inputs, targets in micro_batches:
                loss(self.model(inputs), targets)
        return torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)


@pytest.mark.unit
def builtin_model():
    shape = ModelShape(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=False,
                       rope_theta=10000.0, norm_eps=1e-5)  # fmt: skip
    return build_model(shape, 32, seed=0).eval()


def hf_model():
    """A tiny Hugging Face Llama: its output is an object holding the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.unit
@pytest.mark.parametrize("make", [builtin_model, hf_model], ids=["builtin", "hf"])
def test_each_pairs_figures_equal_one_forward_of_that_pair_alone(make):
    model = make()
    rng = random.Random(0)
    items = [Item((f"{i}" * rng.randint(1, 20),), ("x" * rng.randint(1, 6),), 0, (1,)) for i in range(11)]
    pairs = requests(items, lambda t: [ord(c) % 64 for c in t], 32, prefix=0, task="t")
    got = score(Engine(model), pairs, ALONE, dims_for(load_config([], []).parallel, 1), Batching(4, 32, 0), lambda: None)
    for pair, (ll, greedy) in zip(pairs, got, strict=True):
        tokens = torch.tensor(pair.tokens)
        with torch.no_grad():
            out = model(tokens[None, :-1])
        logp = torch.log_softmax(getattr(out, "logits", out).float(), -1)[0, -pair.scored :]
        want = logp.gather(-1, tokens[-pair.scored :, None]).sum().item()
        # fp32 log-softmax over 64 logits, summed over at most 6 tokens: a few ulps of each
        # term (~1e-6 of values ~4) apart where the padded batch's matmuls block differently.
        assert ll == pytest.approx(want, abs=1e-4)
        assert greedy == float(bool((logp.argmax(-1) == tokens[-pair.scored :]).all()))
    assert {len(p.tokens) for p in pairs} != {32}  # lengths differ: the batches were padded


class Successor(torch.nn.Module):
    """Logits that put token t + 1 (mod 64) first after token t: greedy decoding counts up."""

    def forward(self, inputs):
        return torch.nn.functional.one_hot((inputs + 1) % 64, 64).float() * 5.0


@pytest.mark.unit
def test_greedy_exact_match_is_every_continuation_token_the_likeliest():
    items = [Item(("a",), (tokens,), 0, (1,)) for tokens in ("bcd", "bcx", "b")]
    pairs = requests(items, lambda t: [ord(c) % 64 for c in t], 16, prefix=0, task="t")
    got = score(Engine(Successor()), pairs, ALONE, dims_for(load_config([], []).parallel, 1), Batching(2, 16, 0), lambda: None)
    assert [g for _, g in got] == [1.0, 0.0, 1.0]  # "x" does not follow "c"
    # log-softmax of 5 against 63 zeros for the likeliest token, of 0 for any other.
    hit, miss = 5 - np.log(np.exp(5) + 63), -np.log(np.exp(5) + 63)
    assert got[0][0] == pytest.approx(3 * hit) and got[1][0] == pytest.approx(2 * hit + miss)


@pytest.mark.unit
def test_accuracy_and_its_length_normalised_form():
    items = [Item(("c", "c"), (" a", " bbbb"), 1, (1, 4)), Item(("c", "c"), (" a", " bb"), 0, (1, 2))]
    t = type("T", (), {"config": TaskConfig(name="t", path="p", kind="multiple_choice"), "items": items})
    # Item 0: "a" likelier (wrong), "bbbb" likelier per character (right); item 1: "a" both ways (right).
    figures = np.array([[-2.0, 0], [-3.0, 0], [-1.0, 0], [-4.0, 0]])
    row = task_row(t, figures, 0.5)
    assert (row["acc"], row["acc_norm"], row["items"]) == (0.5, 1.0, 2)


def corpus_lines():
    lines = []
    for pattern in SMALL_CORPUS:
        for f in sorted(glob.glob(pattern)):
            text = open(f, encoding="utf-8").read()  # noqa: SIM115
            lines += [ln.strip() for ln in text.splitlines() if len(ln.split()) >= 4 and len(ln) < 80]
    return lines


def next_word_task(dataset, path, n=60, seed=0):
    """Multiple choice from the training text itself: a line's first tokens as the context,
    the word token that follows as the answer, three of the corpus's rarest word tokens as
    the other choices (each choice one token, so no choice is likelier for its length). A
    model that learned which words the text uses picks the real one; an untrained one is at
    chance (1 in 4)."""
    tok = Tokenizer.from_file(str(dataset / "tokenizer.json"))
    text = {i: tok.decode([i]) for i in range(tok.get_vocab_size())}
    words = [i for i, t in text.items() if t.startswith(" ") and t[1:].isalpha() and len(t) > 2]
    manifest = json.loads((dataset / "manifest.json").read_text())
    tokens = np.concatenate([np.fromfile(dataset / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]])
    counts = np.bincount(tokens.astype(np.int64), minlength=len(text))
    rare = sorted(words, key=lambda i: counts[i])[: len(words) // 4]
    rng, records = random.Random(seed), []
    for line in rng.sample(corpus_lines(), 800):
        ids = tok.encode(line, add_special_tokens=False).ids
        k = next((k for k in range(2, len(ids)) if ids[k] in words and ids[k] not in rare), None)
        if k is None:
            continue
        choices = [text[w][1:] for w in rng.sample(rare, 3)]
        answer = rng.randrange(4)
        choices.insert(answer, text[ids[k]][1:])
        records.append({"context": tok.decode(ids[:k]).rstrip(), "choices": choices, "answer": answer})
        if len(records) == n:
            break
    return write(path, records)


def last_word_task(path, n=24, seed=0):
    """Last word of a line of the training text (a 20-step tiny model gets none: the row's
    figures are what is compared across world sizes)."""
    lines = random.Random(seed).sample(corpus_lines(), n)
    return write(path, [{"context": " ".join(ln.split()[:-1]), "continuation": ln.split()[-1]} for ln in lines])


def task_rows(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl", events=True) if r.get("event") == "task"]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_tasks_in_the_loop_at_world_1_and_fsdp_2_and_from_the_checkpoint(small_dataset, tmp_path):
    nw, lw = next_word_task(small_dataset, tmp_path / "nw.jsonl"), last_word_task(tmp_path / "lw.jsonl")
    tasks = (
        f"eval.tasks=[{{name: next, path: {nw}, kind: multiple_choice, shots: 1}}, {{name: last, path: {lw}, kind: last_word}}]"
    )
    common = ["eval.every=10", f"eval.data={small_dataset}", "eval.batches=1", "eval.micro_batch=3", "checkpoint.every=20", tasks]
    one, two, zero3 = tmp_path / "one", tmp_path / "two", tmp_path / "zero3"
    check(train([*base_overrides(small_dataset, one, steps=20), "train.micro_batch=4", *common]))
    for run_dir, strategy in ((two, "fsdp"), (zero3, "zero3")):
        overrides = [*base_overrides(small_dataset, run_dir, steps=20), "train.micro_batch=2", f"parallel.strategy={strategy}"]
        check(train([*overrides, *common], nproc=2))
    rows = task_rows(one)
    assert [(r["step"], r["task"], r["items"], r["shots"]) for r in rows] == [
        (s, name, n, shots) for s in (10, 20) for name, n, shots in (("next", 60, 1), ("last", 24, 0))
    ]
    # The same pairs' figures at world 2, fsdp and DeepSpeed's ZeRO-3 (other ranks score
    # other batches; ZeRO-3 gathers its parameters in each forward, every rank in each): the same
    # accuracy, perplexity within the two runs' training differences (summation order:
    # their eval losses agree to ~1e-7 relative; exp of a sum of 24 log-likelihoods, 1e-4).
    for a, b in [*zip(rows, task_rows(two), strict=True), *zip(rows, task_rows(zero3), strict=True)]:
        assert (a["acc"], a.get("acc_norm")) == (b["acc"], b.get("acc_norm")), (a, b)
        assert a.get("perplexity", 0) == pytest.approx(b.get("perplexity", 0), rel=1e-4)
    # Trained 20 steps on this text, the model picks the word the text uses over its rarest
    # words far above the 1 in 4 of chance (60 items: chance's standard deviation is 0.056,
    # 0.6 is six of them above); the same model untrained does not (below).
    last = rows[-2]
    assert last["task"] == "next" and last["acc"] >= 0.6, last
    spec_model = checkpoint_model(one / "checkpoints" / "step_20", 64)
    for p in spec_model.parameters():  # the same shape, the weights at random
        torch.nn.init.normal_(p, std=0.02)
    cfg = load_config([], [*base_overrides(small_dataset, tmp_path / "unused"), tasks])
    taskset = open_tasks(cfg, str(small_dataset / "tokenizer.json"), 0)
    nothing = taskset.tasks[0]
    figures = score(Engine(spec_model), nothing.pairs, ALONE, dims_for(cfg.parallel, 1), taskset.how, lambda: None)
    untrained = [task_row(nothing, figures, 0.0)]
    assert untrained[0]["acc"] <= 0.45, untrained
    # The checkpoint scored by `scaletrain eval` (fsdp at world 2): the last in-loop rows.
    proc = check(scaletrain(["launch", "--nproc", "2", "eval", str(one), "parallel.strategy=fsdp", tasks]))
    said = re.findall(r"task (\w+) at step 20: acc ([0-9.]+)", proc.stdout)
    assert said == [(r["task"], f"{r['acc']:.4f}") for r in rows[-2:]], proc.stdout


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_bad_task_stops_the_run_before_training(small_dataset, tmp_path):
    bad = write(tmp_path / "bad.jsonl", [{"context": "c", "choices": ["a", "b"], "answer": 5}])
    proc = train([*base_overrides(small_dataset, tmp_path / "run", steps=2), "eval.every=1", f"eval.data={small_dataset}",
                  "eval.batches=1", f"eval.tasks=[{{name: bad, path: {bad}, kind: multiple_choice}}]"])  # fmt: skip
    one_line_error(proc, "eval.tasks bad: " + bad + " record 1 answer 5 is out of range; accepted: 0 to 1")
    assert not (tmp_path / "run" / "checkpoints").exists()


LM_EVAL = Path(__file__).resolve().parents[1] / ".venv" / "lm-eval"  # `make setup-test`: lm-eval in a directory of its own
LM_EVAL_TASKS = {
    "next": """output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]""",
    # lm-eval's loglikelihood tasks take the continuation as doc_to_target gives it (its
    # lambada puts the word's space there); our last_word layout puts one space before it.
    "last": """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{' ' + continuation}}"
metric_list: [{metric: perplexity}, {metric: acc}]""",
}


def lm_eval_samples(model_dir, files, tmp_path):
    """lm-evaluation-harness (its pinned release, from LM_EVAL: apart, so its pins do not touch
    ours) on each local jsonl task file with the Hugging Face model in `model_dir`, fp32 on
    the CPU, offline: each task's per-document samples."""
    tasks = tmp_path / "lm-eval-tasks"
    tasks.mkdir()
    for name, path in files.items():
        (tasks / f"{name}.yaml").write_text(
            f"task: st_{name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {path}}}}}\ntest_split: test\n"
            + LM_EVAL_TASKS[name]
        )
    out = tmp_path / "lm-eval-out"
    argv = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32", "--device", "cpu",
            "--tasks", ",".join(f"st_{n}" for n in files), "--include_path", str(tasks), "--batch_size", "4",
            "--output_path", str(out), "--log_samples"]  # fmt: skip
    code = f"import sys; sys.path.append({str(LM_EVAL)!r}); sys.argv = {argv!r}; from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    check(run([sys.executable, "-c", code], env=env, timeout=240))
    samples = {}
    for name in files:
        [path] = out.rglob(f"samples_st_{name}_*.jsonl")
        samples[name] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_same_figures_as_lm_evaluation_harness(small_dataset, tmp_path):
    """A Hugging Face model from a local directory and two local task files: each pair's
    log-likelihood and greedy match, and acc, acc_norm and perplexity, as lm-evaluation-harness
    computes them on the same files."""
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    assert LM_EVAL.is_dir(), "lm-eval is not installed: `make setup-test` installs it into .venv/lm-eval"
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(model_dir))
    PreTrainedTokenizerFast(tokenizer_file=str(small_dataset / "tokenizer.json"), eos_token="<|endoftext|>").save_pretrained(
        str(model_dir)
    )
    files = {
        "next": next_word_task(small_dataset, tmp_path / "next.jsonl", n=120),
        "last": last_word_task(tmp_path / "last.jsonl"),
    }
    theirs = lm_eval_samples(model_dir, files, tmp_path)

    # Ours: the model as a run builds it (model.source=hf), the files as eval.tasks reads them.
    tasks = ", ".join(
        f"{{name: {n}, path: {p}, kind: {'last_word' if n == 'last' else 'multiple_choice'}}}" for n, p in files.items()
    )
    cfg = load_config([], ["model.source=hf", f"model.path={model_dir}", "data.seq_len=64", f"eval.tasks=[{tasks}]"])
    spec = model_spec(cfg, None)
    model = spec.build_meta(64)
    spec.materialize(model, torch.device("cpu"), cfg.train.seed)
    taskset = open_tasks(cfg, str(model_dir / "tokenizer.json"), 0)
    for task in taskset.tasks:
        name = task.config.name
        figures = score(Engine(model.eval()), task.pairs, ALONE, dims_for(cfg.parallel, 1), taskset.how, lambda: None)
        docs = sorted(theirs[name], key=lambda s: s["doc_id"])
        # lm-eval's response per pair: (log-likelihood, is greedy), in our pairs' order.
        resps = [(float(r[0][0]), r[0][1] == "True") for d in docs for r in d["resps"]]
        assert len(resps) == len(figures)
        # Both are fp32 log-softmax sums of the same logits over at most a few tokens; the
        # batches differ (padding, order), so a few ulps of each term: 1e-4 of values ~6-30.
        assert figures[:, 0] == pytest.approx([ll for ll, _ in resps], abs=1e-4)
        assert [bool(g) for g in figures[:, 1]] == [g for _, g in resps]
        ours = task_row(task, figures, 0.0)
        for metric in ("acc", "acc_norm") if name == "next" else ("acc",):
            assert ours[metric] == pytest.approx(np.mean([d[metric] for d in docs]), abs=1e-4), metric
        if name == "last":  # exp(-mean log-likelihood per document)
            assert ours["perplexity"] == pytest.approx(np.exp(-np.mean([d["perplexity"] for d in docs])), rel=1e-4)


@pytest.mark.e2e
def test_the_plan_counts_what_evaluation_adds(small_dataset, tmp_path):
    import scaletrain

    nw = next_word_task(small_dataset, tmp_path / "nw.jsonl", n=30)
    tasks = f"eval.tasks=[{{name: next, path: {nw}, kind: multiple_choice}}]"
    plan = scaletrain.plan(load_config([], ["model.preset=1b", "eval.every=500", "eval.batches=4", tasks]))
    [line] = [n for n in plan.notes if n.startswith("evaluation:")]
    c = plan.chosen
    s = c.setup
    windows = 4 * s.micro_batch * s.grad_accum * s.dp  # eval.batches x the global batch
    # Forward only, at the chosen layout's forward rate per sequence; 30 records of 4 choices.
    each = c.time.phases["forward"] / (s.micro_batch * s.grad_accum) * (windows + 120) / s.dp
    assert line == (
        f"evaluation: about {each:.3g} s each (forward only: {windows:,} windows + at most 120 task pairs (eval.tasks), "
        f"a window each), every 500 steps: {100 * each / (500 * c.step_time):.1f}% on top of training"
    )
    bad = write(tmp_path / "bad.jsonl", [{"context": "c"}])
    with pytest.raises(UserError, match=r"eval.tasks b: .*bad.jsonl record 1 has no field 'choices'"):
        scaletrain.plan(
            load_config(
                [], ["model.preset=1b", "eval.every=500", f"eval.tasks=[{{name: b, path: {bad}, kind: multiple_choice}}]"]
            )
        )
