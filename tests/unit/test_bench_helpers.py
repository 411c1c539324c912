"""The benchmark modules' parsers and pure helpers (no runs, no timing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.benchmarks import async_speedup, generator_overhead, parity, trainer
from rlfleet.workers import cli
from rlfleet.workers.spec import load_job

from conftest import make_job

ROOT = Path(__file__).resolve().parents[2]
OWN_TASK = "manifests/examples/own-task.yaml"


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_benchmark_answers_help_through_rlfleet_bench(name, capsys):
    """`rlfleet bench NAME --help` goes through the registry, imports the module and reaches its own parser."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_the_benchmarks_behind_the_readme_are_registered():
    assert {"async", "generator", "parity", "weight-sync"} <= set(cli.BENCHMARKS)


def test_trainer_rows_in_several_dtypes_are_each_held_to_the_matmul_of_their_dtype():
    rows = [{"path": path, "dtype": dtype, "seconds": seconds, "tokens": 1000, "flops": 4e11, "model_flops": 2e11,
             "peak_bytes": 2**30, "loss": 0.5} for path, dtype, seconds in
            (("today", "float32", 8.0), ("new", "float32", 4.0), ("new", "bfloat16", 2.0))]
    rows.append({"path": "today", "dtype": "bfloat16", "error": "out of memory"})
    matmuls = {"float32": 2e11, "bfloat16": 8e11}
    text = trainer.markdown([trainer.with_mfu(row, matmuls[row["dtype"]]) for row in rows], matmuls, "x", 2048)
    assert "| new | float32 | 4.000 | 250 | 400.0 | 100.0 | 50% | 2.00 | 200.0 | 25% | 1,024 | 1,048.6 |" in text
    assert "| new | bfloat16 | 2.000 | 500 | 400.0 | 200.0 | 25% | 2.00 | 200.0 | 12% |" in text
    assert "| today | bfloat16 | out of memory |" in text
    assert "Speed-up of new bfloat16 over today float32: 4.00x" in text
    assert "Plain 2048x2048 matmul" in text
    assert trainer._parser().parse_args(["--dtype", "float32", "bfloat16"]).dtype == ["float32", "bfloat16"]


def test_trainer_mfu_is_model_flops_per_second_over_the_matmul_and_memory_is_per_token():
    row = trainer.with_mfu({"path": "new", "dtype": "bfloat16", "seconds": 2.0, "tokens": 500, "flops": None,
                            "flops_error": "out of memory", "model_flops": 1.5e12, "peak_bytes": 10_000, "loss": 0.0},
                           1e12)
    assert row["mfu"] == pytest.approx(0.75) and row["peak_bytes_per_token"] == 20.0
    text = trainer.markdown([row], {"bfloat16": 1e12}, "x", 8192)
    assert "| new | bfloat16 | 2.000 | 250 | ? | ? | ? | ? | 1,500.0 | 75% |" in text
    assert "Executed FLOPs of new bfloat16 unknown: the count out of memory." in text
    assert trainer.with_mfu({"error": "out of memory"}, 1e12) == {"error": "out of memory"}


def _tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
                                           "num_attention_heads": 2, "num_key_value_heads": 2,
                                           "intermediate_size": 128, "tie_word_embeddings": False} | overrides))


def _sample(prompt: int, completion: int, trained: int | None = None):
    from rlfleet.workers.trainer.sample import Sample

    trained = completion if trained is None else trained
    return Sample(list(range(1, prompt + 1)), [7] * completion, [0.0] * completion, [True] * completion,
                  [True] * trained + [False] * (completion - trained), [], 1.0, [])


def test_model_flops_count_a_shared_prompt_once_and_no_padding():
    """Hand-computed: prompt A (3 tokens) answered by completions of 2 and 4 tokens, prompt B (2 tokens) by one of 1.
    Decoder matmuls per layer: q, k, v, o 4 x 64 x 64 = 16,384, MLP 3 x 64 x 128 = 24,576, two layers 81,920
    weights; output layer 64 x 100 = 6,400."""
    samples = [_sample(3, 2), _sample(3, 4), _sample(2, 1)]
    # Decoder positions: prompts 3 + 2, completions without their last token 1 + 3 + 0 = 9; predicted tokens 7.
    # Keys attended: prompt A 1+2+3, prompt B 1+2, the 2-token completion's position 3 sees 4, the 4-token one's
    # positions 3, 4, 5 see 4+5+6: 28, at 4 x 2 layers x 64 FLOPs each, times 3 for the backward.
    expected = 6 * 81_920 * 9 + 6 * 6_400 * 7 + 3 * 4 * 2 * 64 * 28
    lm = _tiny_llama()
    assert trainer.model_flops(lm, samples) == expected == 4_735_488
    # Padding is no work: the longest completion does not stretch the others.
    assert trainer.model_flops(lm, samples + [_sample(2, 1)]) == expected + 6 * 6_400
    # An untrained completion token is context (decoder, attention) but needs no output layer.
    assert trainer.model_flops(lm, [_sample(3, 2), _sample(3, 4, trained=3), _sample(2, 1)]) == expected - 6 * 6_400
    # Grouped-query attention has as many query heads: the scores cost the same, k and v are narrower.
    assert trainer.model_flops(_tiny_llama(num_key_value_heads=1), samples) == expected - 6 * 2 * 2 * 64 * 32 * 9


def test_model_flops_of_frozen_weights_leave_out_their_gradient():
    lm = _tiny_llama(tie_word_embeddings=True)
    assert trainer.linear_flops(lm.lm_head) == 6 * 6_400  # tied to the embedding, still a matmul
    lm.model.requires_grad_(False)
    assert trainer.linear_flops(lm.model) == 4 * 81_920


class _Parts(list):
    put = list.append


def test_a_step_of_each_path_runs_and_executes_at_least_the_model_flops(model_cache):
    """One step of the bench's own batch through `_path` in this process: the trainer takes the bench's samples, and
    the model FLOPs are a lower bound of what torch counted (both paths pad, and today's also reruns each prompt
    and takes logits of every position)."""
    import torch

    from rlfleet.workers.models import materialize
    from rlfleet.workers.models.config import TinyModel

    directory = materialize(TinyModel(hidden_size=64, num_heads=2), model_cache)
    settings = vars(trainer._parser().parse_args(["--prompts", "2", "--group", "3", "--steps", "1", "--warmup", "0",
                                                  "--threads", str(torch.get_num_threads())]))
    rows = {}
    for name in ("today", "new"):
        parts = _Parts()
        trainer._path(name, settings | {"model_dir": str(directory), "dtype": "float32"}, parts)
        rows[name] = {key: value for part in parts for key, value in part.items()}
    assert rows["today"]["model_flops"] == rows["new"]["model_flops"] > 0
    assert rows["today"]["flops"] > rows["new"]["flops"] >= rows["new"]["model_flops"]


def _killed_after_a_part(name, out):
    import os

    out.put({"seconds": 1.0, "name": name})
    out.close()
    out.join_thread()
    os.kill(os.getpid(), 9)


def test_a_child_killed_after_its_timed_part_keeps_its_row():
    """The FLOP count runs after the timed steps put their part: the kernel's OOM killer there loses the count
    only."""
    assert trainer.in_child(_killed_after_a_part, "new") == {
        "seconds": 1.0, "name": "new", "flops": None, "flops_error": "exited with code -9"}


def test_the_model_config_is_checked_and_llama1b_is_1_07b_parameters():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = trainer._parser().parse_args(["--model-config", "2048,16,32,8,8192,49152"]).model_config
    assert shape == trainer.LLAMA_1B
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         intermediate_size=shape.intermediate, tie_word_embeddings=True)
    with torch.device("meta"):  # shapes only
        lm = LlamaForCausalLM(config)
    assert trainer.linear_flops(lm) / 6 == pytest.approx(1.07e9, rel=0.005)
    for bad in ("2048,16,32,8,8192", "2048,16,30,8,8192,49152", "2048,16,32,8,0,49152", "a,b,c,d,e,f"):
        with pytest.raises(SystemExit):
            trainer._parser().parse_args(["--model-config", bad])
    with pytest.raises(SystemExit):
        trainer._parser().parse_args(["--device", "tpu"])


def test_async_parser_defaults_and_help(capsys):
    args = async_speedup._parser().parse_args([])
    assert (args.steps, args.warmup, args.repeats, args.staleness) == (40, 5, 2, 1)
    assert args.job.endswith("tiny-local.yaml")
    with pytest.raises(SystemExit):
        async_speedup.main(["--help"])
    assert "--staleness" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="staleness >= 1"):
        async_speedup.main(["--staleness", "0"])


def test_async_summary_drops_warmup_and_takes_medians():
    records = [{"step_seconds": 100.0, "generator_busy_seconds": 100.0, "trainer_busy_seconds": 100.0,
                "train_seconds": 100.0}] + [
        {"step_seconds": s, "generator_busy_seconds": s / 2, "trainer_busy_seconds": s / 4, "train_seconds": s / 5}
        for s in (1.0, 2.0, 3.0)]
    summary = async_speedup.summarize(records, warmup=1)
    assert summary == {"step_seconds": 2.0, "generator_busy_seconds": 1.0, "trainer_busy_seconds": 0.5,
                       "train_seconds": 0.4, "sync_pack_seconds": 0.0, "sync_wait_seconds": 0.0, "steps": 3}
    with pytest.raises(ValueError):
        async_speedup.summarize(records, warmup=4)


def test_ideal_ratio_and_comparison():
    assert async_speedup.ideal_ratio(1.0, 1.0) == 2.0
    assert async_speedup.ideal_ratio(3.0, 1.0) == pytest.approx(4 / 3)
    assert async_speedup.ideal_ratio(0.0, 0.0) == 1.0
    sync = [{"step_seconds": 2.0, "generator_busy_seconds": 1.0, "trainer_busy_seconds": 1.0}] * 2
    asyn = [{"step_seconds": 1.25, "generator_busy_seconds": 1.1, "trainer_busy_seconds": 1.2}] * 2
    result = async_speedup.compare(sync, asyn)
    assert result["achieved"] == pytest.approx(1.6) and result["ideal"] == 2.0
    assert result["of_ideal"] == pytest.approx(0.8)
    table = async_speedup.markdown(result, "x")
    assert "| 2.000 | 1.250 | 1.60 |" in table and "80%" in table


def test_generator_parser_and_overhead(capsys):
    args = generator_overhead._parser().parse_args(["--sequences", "4", "--max-tokens", "2"])
    assert (args.sequences, args.max_tokens, args.repeats, args.warmup, args.threads) == (4, 2, 10, 2, 1)
    with pytest.raises(SystemExit, match="repeats >= 1"):
        generator_overhead.main(["--repeats", "0"])
    result = generator_overhead.overhead([1.1, 1.2, 5.0], [1.0, 1.0, 1.0])
    assert result["service_s"] == 1.2 and result["bare_s"] == 1.0
    assert result["overhead"] == pytest.approx(0.2)
    assert "+20.0%" in generator_overhead.markdown(result, "x")


def test_plan_command_prints_tables(capsys):
    assert cli.main(["plan", "--model", "8b", "--gpus", "64"]) == 0
    assert "| generator GPUs |" in capsys.readouterr().out
    assert cli.main(["plan", "--paper"]) == 0
    assert "| 405B |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--generator-gpus must be between"):
        cli.main(["plan", "--params-b", "8", "--gpus", "16", "--generator-gpus", "16"])


def test_async_run_settings_and_environment(monkeypatch):
    job = make_job(generation={"maxNewTokens": 3, "segmentTokens": 2}, checkpoint={"everySteps": 5})
    run = async_speedup.with_settings(job, staleness=0, steps=12, max_new_tokens=8)
    assert run.spec.algorithm.max_staleness == 0 and run.spec.algorithm.steps == 12
    assert run.spec.generation.max_new_tokens == 8 and run.spec.generation.segment_tokens is None
    assert run.spec.checkpoint.every_steps == 12
    assert async_speedup.with_settings(job, 1, 12).spec.generation.max_new_tokens == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    import os

    with async_speedup.environment(async_speedup.SPLIT_CORES_ENV):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_sync_strategies_are_compared_to_wait_and_set_the_trainers_switch():
    from rlfleet.workers.spec import load_job

    job = load_job(async_speedup.DEFAULT_JOB)
    assert {name: async_speedup.with_settings(job, 1, 10, snapshot=on).spec.weight_sync.snapshot
            for name, on in async_speedup.STRATEGIES.items()} == {"wait": False, "snapshot": True}
    run = {f: 1.0 for f in async_speedup.FIELDS}
    result = async_speedup.compare_strategies({"wait": [run, run | {"step_seconds": 3.0}],
                                               "snapshot": [run | {"step_seconds": 2.5}]})
    assert result["wait"]["step_seconds"] == 2.0 and result["wait"]["ratio"] == 1.0
    assert result["snapshot"]["ratio"] == 1.25
    assert "| snapshot | 2.500 |" in async_speedup.strategies_markdown(result, "x")


def test_model_override_is_validated_like_a_job():
    from rlfleet.workers.spec import load_job

    job = load_job(async_speedup.DEFAULT_JOB)
    assert async_speedup.with_model(job, {"type": "tiny", "hiddenSize": 512}).spec.model.hidden_size == 512
    with pytest.raises(ValueError):
        async_speedup.with_model(job, {"type": "tiny", "hiddenSize": 1})


def test_parity_compares_the_losses_and_a_kl_to_the_reference_side_by_side():
    runs = parity.variants("losses", [2])
    assert [(r.name, r.staleness, r.loss.type, r.kl) for r in runs] == [
        ("aipo", 2, "aipo", 0.0), ("ppo", 2, "ppo", 0.0), ("aipo+kl", 2, "aipo", parity.KL_COEF)]
    assert parity.with_variant(make_job(), runs[1]).spec.algorithm.loss.eps_high == 0.28
    assert parity.with_variant(make_job(), runs[1]).spec.roles.reference is None
    with_kl = parity.with_variant(make_job(), runs[2])
    assert with_kl.spec.roles.reference is not None and with_kl.spec.algorithm.kl.coef == parity.KL_COEF
    assert [r.name for r in parity.variants("staleness", [1])] == ["sync", "async"]
    assert [(r.name, r.staleness) for r in parity.variants("staleness", [1, 4])] == [
        ("sync", 0), ("async-1", 1), ("async-4", 4)]
    row = {"staleness": 2, "samples": 640, "step": 1.0, "total": 200}
    rows = [row | {"name": "aipo", "loss": "aipo", "kl": 0.0, "wall": 300.0, "correct": 100},
            row | {"name": "ppo", "loss": "ppo", "kl": 0.0, "wall": 150.0, "correct": 120},
            row | {"name": "aipo+kl", "loss": "aipo", "kl": 0.05, "wall": 400.0, "correct": 90}]
    text = parity.markdown(rows, (40, 200), "settings")
    assert "| ppo | 2 | ppo | 0 | 640 | 150 | 1.0 | 0.200 (40/200) | 0.600 (120/200) |" in text
    assert "| aipo+kl | 2 | aipo | 0.05 | 640 | 400 | 1.0 | 0.200 (40/200) | 0.450 (90/200) |" in text
    assert "Wall-time ratio aipo / ppo: 2.00; accuracy after, ppo minus aipo: +0.100" in text
    assert "Wall-time ratio aipo / aipo+kl: 0.75; accuracy after, aipo+kl minus aipo: -0.050" in text


def test_parity_sets_each_runs_in_loop_accuracy_by_the_samples_trained_into_the_weights_evaluated():
    records = [{"policy_version": 1, "samples_trained": 64, "eval_accuracy": 0.2, "eval_policy_version": 0},
               {"policy_version": 2, "samples_trained": 60},
               {"policy_version": 3, "samples_trained": 64, "eval_accuracy": 0.4, "eval_policy_version": 2}]
    assert parity.by_samples(records) == {0: (0, 0.2), 2: (124, 0.4)}
    rows = [{"name": "sync", "by_samples": {0: (0, 0.2), 2: (124, 0.4)}},
            {"name": "async-4", "by_samples": {0: (0, 0.2), 4: (250, 0.5)}}]
    text = parity.by_samples_markdown(rows)
    assert "| run | 0 | 2 | 4 |" in text and "| sync | 0.200 @0 | 0.400 @124 | - |" in text
    assert "| async-4 | 0.200 @0 | - | 0.500 @250 |" in text
    assert parity._parser().parse_args(["--staleness", "1,4", "--task", "arith99"]).staleness == [1, 4]


def test_the_pools_bench_predicts_a_step_from_the_replicas_rates():
    from rlfleet.benchmarks import pools

    def step(time, share):
        return {"time": time, "tokens_generated": 1000, "generator_throughput/0": 3000.0,
                "generator_throughput/1": 1000.0, "generator_share/0": 1 - share, "generator_share/1": share}

    split = pools.summarize([step(10.0, 0.5), step(10.3, 0.25), step(10.5, 0.25)], warmup=1, replicas=2)
    assert split["step"] == pytest.approx(0.25), "the mean over the kept steps, from the records' times"
    assert (split["predicted"], split["share1"]) == (0.25, 0.25)  # 1000 tokens / (3000 + 1000) tokens/s
    alone = pools.summarize([{"time": 0.0, "tokens_generated": 1000, "generator_throughput/0": 2000.0},
                             {"time": 0.5, "tokens_generated": 1000, "generator_throughput/0": 2000.0}], 1, 1)
    text = pools.markdown({"fast alone": alone, "split by throughput": split}, "x")
    assert "| fast alone | 0.500 | 1000 | 2000 | - | - | 0.500 | 1.00 | 0.500 | 1.00 |" in text
    assert "| split by throughput | 0.250 | 1000 | 3000 | 1000 | 0.25 | 0.250 | 1.00 | 0.375 | 0.67 |" in text
    with pytest.raises(ValueError, match="warm-up"):
        pools.summarize([step(1.0, 0.5)], warmup=0, replicas=2)


def test_a_profiled_step_leaves_a_trace_and_a_table_of_its_operators(tmp_path):
    import gzip
    import json

    import torch

    a = torch.randn(64, 64)
    trainer._profile(lambda: a @ a, torch.device("cpu"), tmp_path / "prof" / "new-float32")
    events = json.loads(gzip.decompress((tmp_path / "prof" / "new-float32.json.gz").read_bytes()))["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)
    table = (tmp_path / "prof" / "new-float32.txt").read_text()
    assert table.startswith("No device kernels in the trace") and "aten::mm" in table
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["new-float32.json.gz", "new-float32.txt"]


def test_the_device_is_busy_for_the_union_of_its_kernels_over_their_span():
    events = [{"cat": "kernel", "ts": 0.0, "dur": 2000.0}, {"cat": "gpu_memcpy", "ts": 1000.0, "dur": 2000.0},
              {"cat": "kernel", "ts": 7000.0, "dur": 3000.0}, {"cat": "cpu_op", "ts": 0.0, "dur": 50000.0}]
    assert trainer.device_busy(events) == ("Device busy 6.0 ms of the 10.0 ms from its first kernel to its last "
                                           "(60%), 3 kernels and copies.")
    assert trainer.device_busy(events[3:]) == "No device kernels in the trace (a CPU step)."


def test_parity_settings_go_into_every_runs_job_and_its_relative_paths_stay_the_callers(tmp_path, monkeypatch):
    """`--settings` (e.g. a trainer its generators outpace): merged into a task's job, or into --job's, whose
    relative paths, taken from where the bench was started, are written absolute (its runs start elsewhere)."""
    settings = '{"algorithm": {"epochs": 4}}'
    task = parity._parser().parse_args(["--task", "letter_counting", "--settings", settings, "--limit", "20"])
    job = load_job(parity._job_file(task, tmp_path))
    assert job.spec.algorithm.epochs == 4 and job.spec.evaluation.limit == 20
    monkeypatch.chdir(ROOT)
    own = parity._parser().parse_args(["--job", OWN_TASK, "--settings", settings])
    job = load_job(parity._job_file(own, tmp_path))
    assert job.spec.algorithm.epochs == 4
    assert job.spec.data.path == str(ROOT / "manifests" / "examples" / "own-task" / "train.jsonl")
    assert parity._job_file(parity._parser().parse_args(["--job", OWN_TASK]), tmp_path) == OWN_TASK
    with pytest.raises(SystemExit):
        parity._parser().parse_args(["--settings", "[4]"])
