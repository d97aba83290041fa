"""HumanEval completions of one model of a run (base or fine-tuned): per problem one greedy completion and
``n_samples`` sampled ones, cut at the benchmark's stop sequences, into samples.jsonl (no code runs here). With
evaluate.humaneval.engine vllm they come from vLLM in the serving environment (moeflow.serving.generation), one
process; otherwise from moeflow's model as below.
Started through torchrun by its rule: ``evaluate.ranks`` ranks hold the model in evaluate.strategy's layout
(moeflow.loading.factory.Layout: fsdp shards it as training does) and generate their share of the batches in
step (moeflow.evaluation.generation); rank 0 writes the samples, the same as one process's."""

from functools import partial

from moeflow.evaluation import humaneval as he
from moeflow.evaluation.generation import Decoding, generate
from moeflow.evaluation.humaneval import HumanEvalGeneration
from moeflow.model.folder import load_tokenizer
from moeflow.parallel.process_group import teardown
from moeflow.runtime.job import Job
from moeflow.runtime.stage import Stage
from moeflow.serving.generation import engine_completions
from moeflow.settings import typed
from moeflow.stages.forward import HumanEvalGenerateStage, forward_layout, load_model

job = Job.from_argv(HumanEvalGenerateStage)
stage = Stage.start(job)
cfg = typed(HumanEvalGeneration, job.settings.humaneval)
problems = he.load_problems(cfg.problems)  # before the model loads: a bad count fails first
tokenizer = load_tokenizer(job.input.model, job.settings.model.trust_remote_code)

if cfg.engine == "vllm":  # the model as it will be served, in the serving environment's vLLM (one process)
    serving = cfg.serving
    complete = partial(
        engine_completions,
        serving["python"],
        job.input.model,
        tokenizer,
        stops=he.STOP_SEQUENCES,
        seed=cfg.seed,
        dtype=serving["dtype"],
        timeout_s=serving["timeout_s"],
    )
    is_main = True  # the one process
else:
    layout = forward_layout(job, stage, job.input.model)
    model = load_model(job, stage, layout, job.input.model)
    complete = partial(
        generate,
        model,
        tokenizer,
        stops=he.STOP_SEQUENCES,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        ranks=layout.ranks,
    )
    is_main = layout.ranks.is_main

greedy = complete([p.prompt for p in problems], Decoding(cfg.max_new_tokens))
sampled = complete(
    he.sampled_prompts(problems, cfg.n_samples), Decoding(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
)
if is_main:
    he.write_samples(job.output.samples, he.sample_records(problems, greedy, sampled, cfg.n_samples))
teardown()
