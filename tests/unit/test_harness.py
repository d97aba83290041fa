"""The lm-eval stage's library on a tiny model and tokenizer: the perplexity task agrees with moeflow's own
evaluation of the packed test split, the body-choice items are deterministic and well formed, task entries
resolve (or fail naming the key), and lm-eval's results become the result record's metrics."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch
from gloo_ranks import fsdp_layout, gloo_group, run_ranks
from tiny_models import tiny_model_cfg
from torch.utils._python_dispatch import TorchDispatchMode

from moeflow.data.packing import pack_documents
from moeflow.data.shards import open_split, write_split
from moeflow.data.tokenizer import train_tokenizer
from moeflow.evaluation import lm_eval_docs
from moeflow.evaluation import lm_eval_run as harness
from moeflow.evaluation import lm_eval_tasks as harness_tasks
from moeflow.evaluation.run_metrics import EvalSet, evaluate_model
from moeflow.loading.factory import make_model
from moeflow.model.settings import ModelSettings
from moeflow.parallel.process_group import Ranks
from moeflow.settings import DEFAULT_CONFIG, ConfigError, typed
from moeflow.workflow.load import load

SEQ_LEN = 96
SETTINGS = {"batch_size": 4, "limit": None, "num_fewshot": None, "bootstrap_iters": 0, "choices": 3}
WORDS = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "name", "total", "index"]


def module_text(rng: random.Random, n: int) -> str:
    """A small Python module: functions with docstrings and bodies of a few statements."""
    parts = []
    for i in range(n):
        a, b = rng.sample(WORDS, 2)
        body = "".join(f"    {a} = {a} + {rng.randint(1, 9)}\n" for _ in range(rng.randint(1, 3)))
        parts.append(f'def {a}_{b}_{i}({a}, {b}):\n    """Return the {b} of {a}."""\n{body}    return {a} * {b}\n')
    return "\n\n".join(parts)


def prose_text(rng: random.Random) -> str:
    """Words and single spaces only: no run of whitespace a segment could end inside."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "."


def write_corpus(folder: Path, texts: list[str], tokenizer) -> Path:
    eos = tokenizer.eos_token_id
    encoded = [tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
    write_split(folder / "test", pack_documents([(i, ids, None) for i, ids in enumerate(encoded)], SEQ_LEN, 8))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A trained byte-level BPE tokenizer and two packed test splits on disk (documents split across rows):
    Python modules, and prose."""
    rng = random.Random(0)
    code = [module_text(rng, rng.randint(2, 5)) for _ in range(12)]
    prose = [prose_text(rng) for _ in range(12)]
    tokenizer = train_tokenizer(code + prose, vocab_size=300)
    folders = {
        "code": write_corpus(tmp_path_factory.mktemp("code"), code, tokenizer),
        "prose": write_corpus(tmp_path_factory.mktemp("prose"), prose, tokenizer),
    }
    return tokenizer, folders, code


@pytest.fixture(scope="module")
def model(corpus):
    tokenizer = corpus[0]
    torch.manual_seed(0)
    m = make_model(
        typed(ModelSettings, tiny_model_cfg("sdpa", max_position_embeddings=128)), vocab_size=len(tokenizer), seed=1
    )
    return m.eval()


PERPLEXITY = harness_tasks.resolve("moeflow_perplexity", "evaluate.tasks[0]")
BODY_CHOICE = harness_tasks.resolve("moeflow_body_choice", "evaluate.tasks[1]")


def test_perplexity_task_agrees_with_moeflow_evaluation(corpus, model, tmp_path):
    tokenizer, folders, _ = corpus
    ours = {
        c: evaluate_model(
            model, [EvalSet(f"test/{c}", [c], open_split(f, "test"))], {"batch_size": 2, "max_sequences": None}
        )
        for c, f in folders.items()
    }
    documents = harness.corpus_documents(PERPLEXITY, folders, tokenizer, SETTINGS, SEQ_LEN, seed=0)
    record = harness.corpus_task_record(model, tokenizer, PERPLEXITY, documents, SETTINGS, SEQ_LEN, 0, "fp32", tmp_path)
    for c in folders:
        stats = ours[c][f"test/{c}"]
        docs = documents[c][0]
        assert sum(d["labels"] for d in docs) == stats.label_tokens == record["cross_check"][c]["label_tokens"]
        assert len(docs) > len(open_split(folders[c], "test"))  # documents were split across rows
        check = record["cross_check"][c]
        assert check["moeflow_perplexity"] == pytest.approx(stats.perplexity, rel=1e-6)
        assert check["lm_eval_token_perplexity"] == pytest.approx(
            record["metrics"][f"{c}/token_perplexity"]["value"], rel=1e-12
        )
        assert check["relative_difference"] < 1e-6  # the same tokens: the two agree to float rounding
    # code has segments cut inside a run of spaces, whose text encodes back to other tokens: lm-eval is given
    # the data stage's tokens for them (moeflow.evaluation.lm_eval_run.exact_tokens)
    code_docs = documents["code"][0]
    assert any(tokenizer.encode(d["text"], add_special_tokens=False) != d["input_ids"] for d in code_docs)
    assert record["num_samples"] == sum(len(docs) for docs, _ in documents.values())


class LargestLogits(TorchDispatchMode):
    """The most rows of any tensor with the vocabulary's width that an operation makes (not a view of its
    inputs: the output weight's transpose), and those tensors' dtypes."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows, self.dtypes = vocab, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            if t.dim() and t.shape[-1] == self.vocab and t.is_floating_point():
                self.rows = max(self.rows, t.numel() // self.vocab)
                self.dtypes.add(t.dtype)
        return out


def test_lm_eval_scores_a_bf16_model_by_fp32_chunks_of_logits(corpus, tmp_path):
    """lm-eval's requests are scored from the hidden states a chunk of tokens at a time: no tensor with the
    vocabulary's width has more rows than ``loss_chunk_tokens`` (HFLM builds the batch's [batch, length,
    vocabulary] logits, a copy and an fp32 log-softmax of them: 30 GB for 8 x 4,096 tokens of Qwen3-30B-A3B),
    and a bf16 model's chunks are scored in fp32 (the 1e-6 cross-check against moeflow's evaluation holds on
    GPU too)."""
    from moeflow.model.chunked_loss import install

    tokenizer, folders, _ = corpus
    bf16 = make_model(
        typed(ModelSettings, tiny_model_cfg("sdpa", max_position_embeddings=128)), vocab_size=len(tokenizer), seed=1
    )
    bf16 = install(bf16.to(torch.bfloat16).eval(), chunk_tokens=16)
    settings = {**SETTINGS, "limit": 4}
    documents = harness.corpus_documents(PERPLEXITY, {"prose": folders["prose"]}, tokenizer, settings, SEQ_LEN, 0)
    lm_eval_docs.write_docs(tmp_path / "prose.jsonl", documents["prose"][0])
    with LargestLogits(len(tokenizer)) as largest:
        output = harness.evaluate_task(
            bf16,
            tokenizer,
            PERPLEXITY,
            settings,
            SEQ_LEN,
            0,
            tmp_path / "prose.jsonl",
            True,
            {d["text"]: d["input_ids"] for d in documents["prose"][0]},
        )
    assert harness.num_samples(output) == 4
    assert 0 < largest.rows <= 16, largest.rows
    assert torch.float32 in largest.dtypes and torch.bfloat16 in largest.dtypes  # bf16 logits, scored in fp32


def test_continuation_scores_equal_lm_evals_own(corpus, model):
    """Chunked scores equal HFLM's whole-logits ``_loglikelihood_tokens`` (log-likelihood and greedy flag), for
    continuations of several lengths, batches that pad, and a request truncated from the left."""
    from lm_eval.models.huggingface import HFLM

    from moeflow.model.chunked_loss import install

    tokenizer = corpus[0]
    rng = random.Random(3)
    vocab = len(tokenizer)
    requests = []
    for i in range(9):
        context = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))]
        continuation = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        requests.append(((f"c{i}", f"x{i}"), context, continuation))
    requests.append((("long", "x"), [rng.randrange(3, vocab) for _ in range(SEQ_LEN + 10)], [7, 8]))
    # a continuation the model predicts: greedy decoding of 4 tokens after a context
    context = requests[0][1]
    with torch.no_grad():
        ids = torch.tensor([context])
        for _ in range(4):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    requests.append((("greedy", "x"), context, ids[0, len(context) :].tolist()))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=3, max_length=SEQ_LEN)
    want = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    got = harness.continuation_scores(install(model, chunk_tokens=7), requests, 3, SEQ_LEN, "cpu")
    assert [g for _, g in got] == [g for _, g in want] and got[-1][1]
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], rel=1e-5, abs=1e-5)


def test_perplexity_scoring_drops_the_prefix_and_refuses_windows_it_cannot_reproduce(corpus, model):
    """A perplexity window is scored from its first token at position 0, as moeflow's evaluation scores a
    segment: the prefix lm-eval puts before it is dropped and the first token counts as certain; a window
    without the prefix as its whole context (lm-eval split a document) is refused, naming the key."""
    with torch.no_grad():
        log_probs = model(torch.tensor([[6, 7, 9]])).logits[0].log_softmax(-1)
    want = float(log_probs[0, 7] + log_probs[1, 9])
    ((got, _),) = harness.continuation_scores(model, [(None, [5], [6, 7, 9])], 1, SEQ_LEN, "cpu", 5)
    assert got == pytest.approx(want, rel=1e-6)
    with pytest.raises(harness.HarnessError, match="max_length"):
        harness.continuation_scores(model, [(None, [9, 4], [6, 7])], 1, SEQ_LEN, "cpu", 5)


def test_perplexity_limit_compares_the_same_segments(corpus, model, tmp_path):
    tokenizer, folders, _ = corpus
    settings = {**SETTINGS, "limit": 3}
    documents = harness.corpus_documents(PERPLEXITY, {"prose": folders["prose"]}, tokenizer, settings, SEQ_LEN, 0)
    record = harness.corpus_task_record(model, tokenizer, PERPLEXITY, documents, settings, SEQ_LEN, 0, "fp32", tmp_path)
    assert record["num_samples"] == 3
    check = record["cross_check"]["prose"]
    assert check["label_tokens"] == sum(d["labels"] for d in documents["prose"][0][:3]) and check["segments"] == 3
    assert check["relative_difference"] < 1e-6


MODEL_SETTINGS = typed(ModelSettings, tiny_model_cfg("sdpa", max_position_embeddings=128))
# 7 perplexity documents per corpus, 4 and 3 per rank in batches of 3: one rank runs one forward fewer of its
# own, and a filler while the other finishes
RANKED = {**SETTINGS, "batch_size": 3, "limit": 7, "bootstrap_iters": 50}


def ranked_records(model, tokenizer, documents, ranks=None) -> dict:
    """Both of moeflow's tasks' records (perplexity with its cross-check, body choice with bootstrapped stderrs)."""
    return {
        task.spec: harness.corpus_task_record(
            model, tokenizer, task, documents[task.spec], RANKED, SEQ_LEN, 0, "fp32", documents["workdir"], ranks
        )
        for task in (PERPLEXITY, BODY_CHOICE)
    }


def _lm_eval_rank(rank: int, root: str, documents: dict, results: dict) -> None:
    """One of two gloo ranks: the saved model FSDP-sharded over both, both tasks with the requests shared."""
    from moeflow.model.folder import load_tokenizer

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)  # as torchrun sets it (lm-eval returns its output on LOCAL_RANK 0 only)
    folder = Path(root) / "model"
    with gloo_group(rank, root) as ranks:
        model = make_model(MODEL_SETTINGS, folder=folder, layout=fsdp_layout(ranks)).eval()
        tokenizer = load_tokenizer(folder)
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        inputs = []
        model.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.append((args[0] if args else kwargs["input_ids"]).tolist()),
            with_kwargs=True,
        )
        documents = {**documents, "workdir": str(Path(root) / f"rank{rank}")}
        Path(documents["workdir"]).mkdir()
        records = ranked_records(model, tokenizer, documents, ranks)
        fillers = sum(ids == [[prefix, prefix]] for ids in inputs)
        results[rank] = json.dumps({"records": records, "forwards": len(inputs), "fillers": fillers})


def test_two_fsdp_ranks_give_one_ranks_lm_eval_records(corpus, model, tmp_path):
    """lm_eval_task on evaluate.ranks: 2 in fsdp: each gloo rank holds half of every parameter and scores its
    share of lm-eval's requests; the records (metrics, bootstrapped stderrs, sample counts, the perplexity
    cross-check) equal one process's on the whole model, and both ranks ran the same number of forwards."""

    tokenizer, folders, _ = corpus
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    documents = {
        task.spec: harness.corpus_documents(task, folders, tokenizer, RANKED, SEQ_LEN, seed=0)
        for task in (PERPLEXITY, BODY_CHOICE)
    }
    whole = make_model(MODEL_SETTINGS, folder=tmp_path / "model").eval()
    (tmp_path / "one").mkdir()
    one = ranked_records(whole, tokenizer, {**documents, "workdir": str(tmp_path / "one")})
    reported = run_ranks(_lm_eval_rank, str(tmp_path), documents)
    results = {rank: json.loads(reported[rank]) for rank in (0, 1)}
    assert results[0]["forwards"] == results[1]["forwards"] > 0
    assert results[0]["fillers"] + results[1]["fillers"] > 0  # the counts of their own forwards differed
    assert results[0]["records"] == results[1]["records"]  # every rank gets the whole record
    two = results[0]["records"]
    assert sorted(two) == sorted(one)
    for spec in one:
        # The same documents, scored by the same weights: lm-eval batches each rank's share apart (other
        # paddings and matrix shapes, so a score can differ in its last bits: 1e-6 relative at most here),
        # and the sums over the ranks' evaluation batches of the cross-check are added in another order.
        # The metrics are computed from the scores in the same order on one and on two ranks.
        assert two[spec]["num_samples"] == one[spec]["num_samples"] > 0
        assert sorted(two[spec]["metrics"]) == sorted(one[spec]["metrics"])
        for name, want in one[spec]["metrics"].items():
            got = two[spec]["metrics"][name]
            assert got["value"] == pytest.approx(want["value"], rel=1e-6), (spec, name)
            assert (got["stderr"] is None) == (want["stderr"] is None), (spec, name)
            if want["stderr"] is not None:
                assert got["stderr"] == pytest.approx(want["stderr"], rel=1e-5), (spec, name)
    for corpus_name, want in one[PERPLEXITY.spec]["cross_check"].items():
        got = two[PERPLEXITY.spec]["cross_check"][corpus_name]
        assert (got["label_tokens"], got["segments"]) == (want["label_tokens"], want["segments"])
        assert got["moeflow_perplexity"] == pytest.approx(want["moeflow_perplexity"], rel=1e-6)
        assert got["relative_difference"] < 1e-6


def test_body_choice_items_are_deterministic_and_hold_the_real_body(corpus):
    tokenizer, folders, texts = corpus
    documents = lm_eval_docs.document_texts(open_split(folders["code"], "test"), tokenizer)
    assert documents == texts  # the split decodes back to the documents
    kwargs = {"choices": 3, "seed": 7, "max_tokens": SEQ_LEN}
    items = lm_eval_docs.body_choice_docs(documents, tokenizer, **kwargs)
    assert items and items == lm_eval_docs.body_choice_docs(documents, tokenizer, **kwargs)
    assert items != lm_eval_docs.body_choice_docs(documents, tokenizer, **{**kwargs, "seed": 8})
    bodies: dict[str, set[str]] = {}
    for f in (f for text in documents for f in lm_eval_docs.functions(text)):
        bodies.setdefault(f.prompt, set()).add(f.body)
    for item in items:
        assert len(item["choices"]) == 3 == len(set(item["choices"]))
        assert item["choices"][item["gold"]] in bodies[item["prompt"]]
        assert item["prompt"].startswith("def ") and item["prompt"].rstrip().endswith('"""')
    assert {item["gold"] for item in items} == {0, 1, 2}


def test_body_choice_task_runs_through_lm_eval(corpus, model, tmp_path):
    tokenizer, folders, _ = corpus
    assert BODY_CHOICE.files == [
        harness_tasks.TASKS_DIR / "moeflow_body_choice.yaml",
        harness_tasks.TASKS_DIR / "moeflow_tasks.py",
    ]
    settings = {**SETTINGS, "bootstrap_iters": 100}
    documents = harness.corpus_documents(BODY_CHOICE, {"c": folders["code"]}, tokenizer, settings, SEQ_LEN, seed=0)
    record = harness.corpus_task_record(
        model, tokenizer, BODY_CHOICE, documents, settings, SEQ_LEN, 0, "fp32", tmp_path
    )
    acc = record["metrics"]["c/acc"]
    assert 0.0 <= acc["value"] <= 1.0 and acc["stderr"] is not None
    assert record["num_samples"] == len(documents["c"][0]) and "cross_check" not in record
    # Prose has no functions: left out of the corpora, and a task that no corpus gives documents for fails.
    both = harness.corpus_documents(BODY_CHOICE, folders, tokenizer, settings, SEQ_LEN, seed=0)
    assert list(both) == ["code"]
    with pytest.raises(lm_eval_docs.TaskDataError, match="moeflow_body_choice.*evaluate.lm_eval.max_length"):
        harness.corpus_documents(BODY_CHOICE, {"prose": folders["prose"]}, tokenizer, settings, SEQ_LEN, seed=0)


def test_task_entries_resolve_or_name_the_key(tmp_path, monkeypatch):
    # lm-eval's registry takes seconds to index: a name it knows and one it does not stand in for it.
    monkeypatch.setattr(harness_tasks, "registry_has", lambda name: name == "wikitext")
    assert harness_tasks.resolve("wikitext", "evaluate.tasks[0]").registry
    assert PERPLEXITY.docs == lm_eval_docs.SEGMENTS and BODY_CHOICE.docs == lm_eval_docs.BODY_CHOICE
    assert harness_tasks.task_problems(["moeflow_perplexity", "moeflow_body_choice"], ["c"]) == []
    (problem,) = harness_tasks.task_problems(["wikitext", "moeflow_body_choice"], [])
    assert "evaluate.tasks[1]" in problem and "data.eval_corpora" in problem
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: [unclosed\n")
    nameless = tmp_path / "nameless.yaml"
    nameless.write_text("dataset_path: json\n")
    for entry, message in [
        ("no_such_task_anywhere", r"evaluate.tasks\[1\].*neither one of moeflow's tasks"),
        (str(broken), r"evaluate.tasks\[1\].*not a readable task YAML"),
        (str(nameless), r"evaluate.tasks\[1\].*defines no task"),
        (str(tmp_path / "missing.yaml"), r"evaluate.tasks\[1\].*does not exist"),
        ("moeflow_perplexity", r"evaluate.tasks\[1\].*same result file"),
    ]:
        (problem,) = harness_tasks.task_problems(["moeflow_perplexity", entry], ["c"])
        assert re.search(message, problem), problem


def test_missing_data_file_of_a_task_yaml_is_named(tmp_path):
    task_yaml = tmp_path / "mine.yaml"
    task_yaml.write_text(
        f"task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files: {{test: {tmp_path}/nope.jsonl}}\n"
    )
    task = harness_tasks.resolve(str(task_yaml), "evaluate.tasks[2]")
    (problem,) = harness_tasks.missing_data_files(task, "evaluate.tasks[2]")
    assert "evaluate.tasks[2]" in problem and "nope.jsonl" in problem
    (tmp_path / "nope.jsonl").write_text("{}\n")
    assert harness_tasks.missing_data_files(task, "evaluate.tasks[2]") == []


def test_metrics_from_lm_eval_results():
    output = {
        "results": {
            "t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "ppl,none": 3.0, "ppl_stderr,none": "N/A"}
        },
        "n-samples": {"t": {"original": 10, "effective": 4}},
    }
    assert harness.metrics(output, "c/") == {
        "c/acc": {"value": 0.5, "stderr": 0.1},
        "c/ppl": {"value": 3.0, "stderr": None},
    }
    assert harness.num_samples(output) == 4


def test_config_check_refuses_an_unknown_task_naming_the_key(monkeypatch):
    monkeypatch.setattr(harness_tasks, "registry_has", lambda name: False)
    tasks = ["moeflow_perplexity", "moeflow_body_choice", "not_a_task"]
    with pytest.raises(ConfigError, match=r"evaluate\.tasks\[2\].*'not_a_task'"):
        load(DEFAULT_CONFIG, overrides={"evaluate": {"tasks": tasks}})
    with pytest.raises(ConfigError, match=r"evaluate\.lm_eval\.max_length"):
        load(DEFAULT_CONFIG, overrides={"evaluate": {"lm_eval": {"max_length": 64}}})


def _generative_task(folder: Path, code: list[str], do_sample: bool = False) -> harness_tasks.TaskSpec:
    """A generate_until task of a YAML file and a JSON-lines dataset: continue each module's first line up to a
    line break (at most 12 tokens)."""
    docs = folder / "docs.jsonl"
    docs.write_text("".join(json.dumps({"prompt": text.split("\n")[0] + "\n", "target": "x"}) + "\n" for text in code))
    task_yaml = folder / "complete_line.yaml"
    task_yaml.write_text(
        "task: complete_line\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files: {{test: {docs}}}\ntest_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        f"generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 12\n  do_sample: {str(do_sample).lower()}\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return harness_tasks.resolve(str(task_yaml), "evaluate.tasks[0]")


def _generated(model, tokenizer, task, ranks=None) -> list[str]:
    settings = {**SETTINGS, "batch_size": 1}  # one request a batch: the same paddings on one and on two ranks
    output = harness.evaluate_task(model, tokenizer, task, settings, SEQ_LEN, 0, log_samples=True, ranks=ranks)
    return [sample["resps"][0][0] for sample in sorted(output["samples"]["complete_line"], key=lambda s: s["doc_id"])]


def _generating_rank(rank: int, root: str, results: dict) -> None:
    """One of two gloo ranks: the saved model FSDP-sharded over both, the generative task's requests shared."""
    from moeflow.model.folder import load_tokenizer
    from moeflow.model.wrappers import unwrap

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    folder = Path(root) / "model"
    with gloo_group(rank, root) as ranks:
        model = make_model(MODEL_SETTINGS, folder=folder, layout=fsdp_layout(ranks)).eval()
        forwards = []
        unwrap(model).register_forward_pre_hook(lambda module, args: forwards.append(1))
        task = harness_tasks.resolve(str(Path(root) / "complete_line.yaml"), "evaluate.tasks[0]")
        generated = _generated(model, load_tokenizer(folder), task, ranks)
        results[rank] = {"generated": generated, "forwards": len(forwards)}


def test_two_fsdp_ranks_generate_one_processs_lm_eval_completions(corpus, tmp_path):
    """A generate_until task on evaluate.ranks: 2 in fsdp: each gloo rank generates its share of 11 requests (6
    and 5, each stopping at its own line break), its forwards in step with the other's, and every rank gets
    one process's completions in order."""
    tokenizer, _, code = corpus
    taught = make_model(MODEL_SETTINGS, vocab_size=len(tokenizer), seed=5)  # the modules: varied continuations
    rows = [torch.tensor([tokenizer(text)["input_ids"][:SEQ_LEN]]) for text in code[:11]]
    optimizer = torch.optim.Adam(taught.parameters(), lr=1e-2)
    for _ in range(15):
        for ids in rows:
            taught(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    taught.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    task = _generative_task(tmp_path, code[:11])
    whole = make_model(MODEL_SETTINGS, folder=tmp_path / "model").eval()
    one = _generated(whole, tokenizer, task)
    assert len(one) == 11 and len(set(one)) > 1 and len({len(text) for text in one}) > 1
    results = run_ranks(_generating_rank, str(tmp_path), timeout_s=300)
    assert results[0]["generated"] == results[1]["generated"] == one
    assert results[0]["forwards"] == results[1]["forwards"] > 0


def test_sampled_lm_eval_generation_on_several_ranks_is_refused_naming_the_key(corpus, model, tmp_path):
    tokenizer, _, code = corpus
    task = _generative_task(tmp_path, code, do_sample=True)
    ranks = Ranks(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(harness.HarnessError, match=r"samples its generations.*'evaluate.ranks'"):
        _generated(model, tokenizer, task, ranks)


def test_the_task_functions_import_nothing_of_moeflow_and_name_the_stages_documents_key():
    # the serving environment's lm-eval imports them (evaluate.lm_eval.engine: vllm), where moeflow is not installed
    import ast
    import importlib.util

    path = harness_tasks.TASKS_DIR / "moeflow_tasks.py"
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert imported == {"json", "datasets"}, imported
    spec = importlib.util.spec_from_file_location("moeflow_tasks", path)
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    assert tasks.DOCS_FILE == lm_eval_docs.DOCS_FILE
