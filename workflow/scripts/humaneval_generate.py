"""HumanEval completions of one model of a run (base or fine-tuned): per problem one greedy completion and
``n_samples`` sampled ones, cut at the benchmark's stop sequences, into samples.jsonl (no code runs here)."""

from functools import partial

from moeflow.evaluation import humaneval as he
from moeflow.evaluation.generation import Decoding, generate
from moeflow.evaluation.humaneval import HumanEvalGeneration
from moeflow.model.factory import make_model
from moeflow.model.folder import load_tokenizer
from moeflow.model.settings import ModelSettings
from moeflow.runtime.hardware import compute_device, compute_dtype
from moeflow.runtime.stage import Stage
from moeflow.settings import typed

stage = Stage.start(snakemake)
params = snakemake.params
cfg = typed(HumanEvalGeneration, params.settings)
problems = he.load_problems(cfg.problems)  # before the model loads: a bad count fails first

model_settings = typed(ModelSettings, params.model)
model = make_model(
    model_settings,
    experts=snakemake.input.experts,
    folder=snakemake.input.model,
    device=compute_device(params.device),
    dtype=compute_dtype(stage.precision),
)
tokenizer = load_tokenizer(snakemake.input.model, model_settings.trust_remote_code)
complete = partial(generate, model, tokenizer, stops=he.STOP_SEQUENCES, batch_size=cfg.batch_size, seed=cfg.seed)

greedy = complete([p.prompt for p in problems], Decoding(cfg.max_new_tokens), desc="humaneval greedy")
sampled = complete(
    he.sampled_prompts(problems, cfg.n_samples),
    Decoding(cfg.max_new_tokens, cfg.temperature, cfg.top_p),
    desc="humaneval sampled",
)
he.write_samples(snakemake.output.samples, he.sample_records(problems, greedy, sampled, cfg.n_samples))
