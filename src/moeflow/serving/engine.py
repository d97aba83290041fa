"""Prompt log-probs of token sequences in vLLM, computed by the serving environment's own Python.

moeflow.serving.check starts this file as a script with the serving environment's interpreter (``make serve-env``:
.venvs/serve, whose pins differ from both stacks')::

    <serve python> engine.py --model DIR --sequences IN.json --output OUT.json --dtype float32

It imports vLLM and the standard library only: moeflow is not installed there. For each sequence it writes, at
every position after the first, the log-prob vLLM gives the sequence's token there and vLLM's top token.

With ``--generate REQUESTS.json`` it generates instead: one completion per prompt (token ids), greedy or sampled with
a seed per prompt, ending at EOS, a stop string or ``max_tokens``; it writes each completion's token ids and why it
ended (HumanEval through vLLM: moeflow.serving.generation).

With ``--lm-eval REQUEST.json`` it runs one lm-evaluation-harness task through lm-eval's own vLLM backend (its
``vllm`` model type, lm-eval installed beside vLLM) and writes lm-eval's results (``evaluate.lm_eval.engine: vllm``:
moeflow.serving.harness). The request carries what moeflow's HF engine does differently from lm-eval's defaults, so that
both score the same tokens: a document's exact token ids, and the perplexity task's first token as context.

With ``--adapter DIR --read OUT.safetensors`` it loads no model: it reads a LoRA adapter with vLLM's own adapter
loader (``LoRAModel.from_local_checkpoint``, the names the model class expects, and the stacking of each MoE layer's
per-expert adapters into its fused w13 and w2), and writes the factors vLLM holds per module and, in the record, their
names and scaling. vLLM's CPU build reads MoE adapters but cannot run them (no CPU MoE LoRA kernel).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="prompt log-probs of token sequences in vLLM")
    parser.add_argument("--model", required=True, help="the exported model folder")
    parser.add_argument("--sequences", help="JSON: a list of token id lists")
    parser.add_argument("--output", required=True, help="JSON written here: engine, version, device, log-probs")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--adapter", help="read this LoRA adapter with vLLM's loader instead (no model is loaded)")
    parser.add_argument("--read", help="with --adapter: the factors vLLM holds, written here (safetensors)")
    parser.add_argument(
        "--generate", help="JSON: prompts (token id lists), max_tokens, temperature, top_p, seeds, stop"
    )
    parser.add_argument("--lm-eval", help="JSON: one lm-eval task and its settings (moeflow.serving.harness)")
    args = parser.parse_args(argv)
    if args.adapter:
        read_adapter(args.model, args.adapter, args.read, args.output)
        return

    # One process: vLLM's engine core in a second interpreter costs its imports again and gains nothing here.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The CPU build reserves its KV cache up front (GiB); a check's sequences are few and short.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Its default pins its threads to chosen cores, where other jobs run too: a check took 22.7 s unpinned and 42 to
    # 65 s pinned on a 2-core machine, 137 to 236 s in CI beside the test suites (docs/benchmarks.md).
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if args.generate:
        generate(args.model, args.generate, args.dtype, args.output)
    elif args.lm_eval:
        lm_eval_task(args.model, args.lm_eval, args.dtype, args.output)
    else:
        prompt_logprobs(args.model, args.sequences, args.dtype, args.output)


def prompt_logprobs(model_dir: str, sequences_file: str, dtype: str, output: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    with open(sequences_file) as f:
        sequences = json.load(f)
    # The longest sequence and the one generated token vLLM insists on: within the model's positions when the
    # sequences were packed within its training context.
    max_model_len = max(map(len, sequences)) + 1
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0)
    # One log-prob per position (the sequence's token, and the top one): the whole vocabulary costs 10x the time.
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params, use_tqdm=False)
    result = []
    for ids, scored in zip(sequences, outputs):
        per_position = scored.prompt_logprobs[1:]  # the first token has no prediction
        result.append(
            {
                "token": [logprobs[token].logprob for token, logprobs in zip(ids[1:], per_position)],
                "top": [next(t for t, lp in logprobs.items() if lp.rank == 1) for logprobs in per_position],
            }
        )
    record = {
        "engine": "vllm",
        "version": vllm.__version__,
        "device": current_platform.device_type,
        "sequences": result,
    }
    with open(output, "w") as f:
        json.dump(record, f)


def generate(model_dir: str, requests_file: str, dtype: str, output: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    with open(requests_file) as f:
        requests = json.load(f)
    prompts = requests["prompts"]
    max_model_len = max(map(len, prompts)) + requests["max_tokens"]
    llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0)
    sampled = requests["temperature"] is not None
    params = [
        SamplingParams(
            max_tokens=requests["max_tokens"],
            temperature=requests["temperature"] if sampled else 0.0,
            top_p=requests["top_p"] if sampled else 1.0,
            seed=requests["seeds"][i] if sampled else None,
            stop=requests["stop"],
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    completions = [
        {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason} for o in outputs
    ]
    record = {"engine": "vllm", "version": vllm.__version__, "device": current_platform.device_type}
    with open(output, "w") as f:
        json.dump(record | {"completions": completions}, f)


def lm_eval_task(model_dir: str, request_file: str, dtype: str, output: str) -> None:
    _vllm_cpu_version_as_vllm()
    import vllm
    from lm_eval import simple_evaluate
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable
    from vllm.platforms import current_platform

    with open(request_file) as f:
        request = json.load(f)
    token_ids: dict[str, list[int]] = {}  # the running run's
    first_token_as_context, max_length, seed = request["first_token_as_context"], request["max_length"], request["seed"]

    class MoeflowVLLM(VLLM):
        def tok_encode(self, string, *args, **kwargs):
            # a perplexity document's text gives back the tokens the data stage made for it (decoding a segment and
            # encoding it again is not always the identity)
            if isinstance(string, str) and string in token_ids:
                return list(token_ids[string])
            return super().tok_encode(string, *args, **kwargs)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False):
            if first_token_as_context:
                # moeflow's evaluation scores a segment from its first token, which is context only: lm-eval's prefix
                # token goes, and the segment's first token becomes the context
                reshaped = []
                for key, context, continuation in requests:
                    if list(context) != [self.prefix_token_id]:
                        raise SystemExit(
                            "lm-eval split a perplexity document into several windows (or gave one without its "
                            "prefix): set evaluate.lm_eval.max_length to at least data.seq_len, or null"
                        )
                    reshaped.append((key, list(continuation[:1]), list(continuation[1:])))
                requests = reshaped
            return super()._loglikelihood_tokens(requests, disable_tqdm)

        def generate_until(self, requests, disable_tqdm: bool = False):
            # a prompt is cut to max_length less the tokens to generate, as moeflow's HF engine cuts it
            self._max_length = max_length
            try:
                return super().generate_until(requests, disable_tqdm)
            finally:
                self._max_length = max_length + 2

    # moeflow's HF engine scores at most max_length + 1 tokens per request and rolls perplexity windows of max_length
    # tokens; lm-eval's vLLM backend keeps one position for the token vLLM must generate and, in its rolling windows,
    # another for the prefix: two more positions score the same requests (the config check keeps them within the
    # model's positions).
    lm = MoeflowVLLM(
        pretrained=model_dir,
        dtype=dtype,
        max_model_len=max_length + 2,
        batch_size="auto",  # every request at once: vLLM schedules its own batches
        seed=seed,
        enforce_eager=True,
    )
    outputs = []
    for run in request["runs"]:  # one per evaluation corpus of moeflow's corpus tasks, one engine start
        token_ids.clear()
        token_ids.update(run["token_ids"] or {})
        manager = TaskManager(
            include_path=request["include_path"], include_defaults=request["include_defaults"], metadata=run["metadata"]
        )
        # the options are moeflow.evaluation.lm_eval_run.evaluation_options', as the HF engine passes them
        results = simple_evaluate(
            model=lm, tasks=[request["task"]], task_manager=manager, log_samples=False, **request["options"]
        )
        outputs.append({key: results[key] for key in ("results", "n-samples")})
    record = {
        "engine": "vllm",
        "version": vllm.__version__,
        "device": current_platform.device_type,
        "lm_eval": _version("lm_eval"),
        "outputs": outputs,
    }
    with open(output, "w") as f:
        json.dump(record, f, default=handle_non_serializable)


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


def _vllm_cpu_version_as_vllm() -> None:
    """lm-eval's vLLM backend asks for the version of the distribution ``vllm`` (on import, and when it starts the
    engine); the CPU build installs as ``vllm-cpu``. Where ``vllm`` is not installed, its version is vllm-cpu's with
    ``+cpu``, as vLLM's own platform detection reads it (vllm.platforms.vllm_version_matches_substr)."""
    import importlib.metadata as metadata

    version = metadata.version

    def vllm_or_cpu_build(distribution: str) -> str:
        try:
            return version(distribution)
        except metadata.PackageNotFoundError:
            if distribution != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = vllm_or_cpu_build


# The expert projections' names in a family's files, in the order vLLM's expert mapping takes them: gate, down, up.
EXPERT_NAMES = {"mixtral": ("w1", "w2", "w3")}
DEFAULT_EXPERT_NAMES = ("gate_proj", "down_proj", "up_proj")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# What vLLM's get_supported_lora_modules finds on an MoE decoder's layers besides the experts (it needs a built model).
SUPPORTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate", "experts")


def read_adapter(model_dir: str, adapter_dir: str, read_file: str, output: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models import ModelRegistry

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    model_class = ModelRegistry._try_load_model_cls(config["architectures"][0])
    experts = next(config[key] for key in EXPERT_COUNT_KEYS if config.get(key))
    names = EXPERT_NAMES.get(config["model_type"], DEFAULT_EXPERT_NAMES)
    # worker_manager._load_adapter's expected modules: the supported ones, the packed ones spelled out, and each
    # expert's projections as vLLM's expert mapping names them
    packed = dict(model_class.packed_modules_mapping)
    mapping = RoutedExperts.build_expert_params_mapping(*names, num_experts=experts, routed_experts_prefix="")
    packed["experts"] = [weight.rstrip(".") for _, weight, _, _ in mapping]
    expected = {*SUPPORTED, *packed["experts"], *(m for ms in packed.values() for m in ms)}
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    rename = mapper.get_rename_mapper() if mapper is not None else None
    helper = PEFTHelper.from_local_dir(adapter_dir, max_position_embeddings=config.get("max_position_embeddings"))
    lora = LoRAModel.from_local_checkpoint(
        adapter_dir, expected, helper, lora_model_id=1, device="cpu", dtype=torch.float32, weights_mapper=rename
    )
    read = {}
    for module, weights in lora.loras.items():
        read[f"{module}.lora_a"] = weights.lora_a.clone()
        read[f"{module}.lora_b"] = weights.lora_b.clone()  # as read: the packing below scales some in place
    scalings = {weights.scaling for weights in lora.loras.values()}
    # each file module's name in vLLM, as its loader parses the adapter's keys
    with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), framework="pt") as f:
        keys = [key for key in f.keys() if ".lora_A." in key]
    file_names = {
        key.removeprefix("base_model.model.").split(".lora_A.")[0]: parse_fine_tuned_lora_name(key, rename)[0]
        for key in keys
    }
    # each MoE layer's per-expert adapters stacked into w13 and w2 as the model manager does when the adapter is
    # activated (a bare manager: the packing needs no model); an expert missing its adapter fails here
    manager = LoRAModelManager.__new__(LoRAModelManager)
    manager.modules, manager.packed_modules, manager.packed_modules_mapping = {}, {}, packed
    manager.is_pooling_model = manager._enable_moe_shared_loras = manager._is_non_gated_moe = False
    manager._enable_mixed_moe_lora_format = False
    layers = sorted({module.split(".experts.")[0] + ".experts" for module in lora.loras if ".experts." in module})
    for layer in layers:
        manager._register_packed_modules(layer)
    manager._create_merged_loras_inplace(lora)
    stacked = {
        layer: [list(t.shape) for t in lora.loras[layer].lora_a] + [list(t.shape) for t in lora.loras[layer].lora_b]
        for layer in layers
    }
    save_file(read, read_file)
    import vllm

    record = {
        "engine": "vllm",
        "version": vllm.__version__,
        "scaling": scalings.pop() if len(scalings) == 1 else sorted(scalings),
        "names": file_names,
        "stacked": stacked,
    }
    with open(output, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
