"""Every bench runs at its smoke size, so that none can rot (tier 3: real runs, seconds to a minute each).

Each ``bench/*.py`` takes ``--smoke`` and prints its figure as its last line, in the format that
``bench/RESULTS.md`` quotes. A bench whose smoke size another test already runs names that test here.
"""

from __future__ import annotations

import math
import re
import sys

import pytest

from tests.helpers import REPO, run

BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py") if not p.name.startswith("_"))

LAST_LINE = {
    "agentic.py": r"agent_gain=(?P<gain>\S+) no_tool_gain=(?P<off>\S+) token_exact=(?P<exact>\d) "
    r"multiturn_logprob_diff=(?P<diff>\S+) tool_overlap=(?P<overlap>\S+) multiturn_tokens=(?P<tokens>\d+)",
    "algorithms.py": r"algorithms_learned=(?P<learned>\d+)/(?P<total>\d+)",
    "async_ckpt.py": r"stall_ratio=(?P<stall_ratio>-?[\d.]+)",
    "async_rl.py": r"bound=(?P<bound>\S+) async_over_sync=(?P<x>\S+) overlap_efficiency=(?P<y>\S+) "
    r"async_over_colocated=\S+ reward_gap=(?P<gap>\S+) publish_over_bare=(?P<v>\S+) push_over_vllm_load=(?P<u>\S+) "
    r"tokens=(?P<tokens>\d+)",  # negative when noise exceeds the cost
    "data_scale.py": r"rows=(?P<rows>\d+) first_open_s=(?P<open>\S+) rank_first_batch_s=(?P<first>\S+) rank_anon_mb=(?P<mb>\S+)",
    "controller_scaling.py": r"rank0_data_bytes_ratio=(?P<data>\S+) rank0_total_bytes_ratio=(?P<total>\S+)",
    "dp_balance.py": r"imbalance_before=(?P<before>\S+) imbalance_after=\S+ train_phase_speedup=(?P<speedup>\S+) "
    r"speedup_low=\S+ long_imbalance_before=(?P<long_before>\S+) long_imbalance_after=(?P<long_after>\S+) "
    r"long_train_phase_speedup=(?P<long_speedup>\S+) long_speedup_low=\S+",
    "interrupts.py": r"interrupts=(?P<k>\d+) stopped=(?P<stopped>\d+) continued_to_max_steps=(?P<continued>\d+) "
    r"latest_is_newest=(?P<latest>\d+) resumed_exactly=(?P<resumed>\d+) bitwise_equal_final=(?P<bitwise>\d)",
    "gpu_check.py": r"gpu_check=ok max_logit_diff=(?P<logit_diff>\S+) grad_norm=(?P<grad_norm>\S+) step_ms=\S+",
    "kill_resume.py": r"kills=(?P<kills>\d+) resumed=(?P<resumed>\d+) lost_saved_steps=(?P<lost>\d+) "
    r"corrupt_loaded=(?P<corrupt>\d+) bitwise_equal_final=(?P<bitwise>\d)",
    "learning.py": r"learning_min_margin=(?P<margin>\S+)",
    "lora.py": r"lora_gain=(?P<lora>\S+) full_gain=(?P<full>\S+) trainable_share=(?P<share>\S+) "
    r"sync_bytes_ratio=(?P<sync>\S+) optimizer_bytes_ratio=(?P<opt>\S+) lora_logprob_diff=(?P<diff>\S+)",
    "moe.py": r"ep_over_dp_step=nan push_over_vllm_load=(?P<push>\S+) moe_logprob_diff=(?P<diff>\S+) "
    r"moe_logprob_diff_replay=nan experts_pushed_bytes=(?P<bytes>\d+)",
    "multimodal_controller.py": r"rank0_peak_mem_growth=(?P<parallel>\S+) single_controller_growth=(?P<single>\S+)",
    "placement.py": r"partial_over_full=(?P<ratio>\S+)",
    "stages.py": r"sft_loss_drop=(?P<sft>\S+) rl_steps_to_half_from_sft=(?P<from_sft>\d+) rl_steps_to_half_from_scratch=\S+ "
    r"dpo_heldout_accuracy=(?P<dpo>\S+) distill_kl_drop=(?P<kl>\S+) distill_reward_gap=\S+",
    "step_efficiency.py": r"rollout_over_bare_vllm=(?P<r>\S+) train_over_bare_megatron=(?P<t>\S+) overhead_share=(?P<o>\S+)",
    "step_breakdown.py": r"rollout=\S+ sync=\S+ reward=\S+ train=(?P<train>\S+) other=\S+ peak_rss_gb_max=(?P<rss>\S+)",
}
# Benches whose smoke size another test runs (with stronger assertions than a smoke test makes).
RUN_ELSEWHERE = {
    "rollout_consistency.py": "tests/test_parallel.py::test_layout_trains_and_engine_matches_policy (TP=2, PP=2, DP=2)",
    "vlm_learning.py": "tests/test_vlm_training.py::test_the_tiny_vlm_learns_to_look_on_two_processes_and_exports",
}

# Thresholds measured at the smoke size (2026-12-06, this 2-core VM under load 7-50 from other jobs: rewards and
# losses are deterministic, timings are not), each with what a wrong implementation gives.
LEARN_MIN = 0.03  # learning.py: 0.045 (0.028 -> 0.073); the same 12 steps at lr 1e-12 (no learning): -0.002
OVERHEAD_MAX = 0.3  # step_efficiency.py: 0.010 (untimed generation or passes would leave ~0.9 of the step)
SFT_MIN = 0.65  # stages.py: 0.837 at 40 SFT steps, 0.865 at 60 (held-out loss 5.77 -> 0.78); a policy that learnt
# the answers' form only (a uniform letter of 26 at each of 4 positions, then the end) gives ~0.55
DPO_MIN = 0.8  # stages.py: held-out pairs start at 0.5 (policy = reference)
BOUND_MIN = 1.1  # async_rl.py: 1.535 (probe: 16 tokens); a side that timed nothing gives 1.0
# async_rl.py: 1.799 alone (load 12-18), 0.91 in the clean clone's suite beside the other worker: at the smoke size
# the overlap is not measurable in CI; a lag 1 that deadlocked into its timeouts, or serialised on every version
# with waits, gives far less
ASYNC_MIN = 0.5


def check(name: str, figures: dict[str, float]) -> None:
    """What must hold even at the smoke size (the full size's targets are in bench/RESULTS.md). Each check names
    what a wrong implementation would do that it catches."""
    f = figures
    if name == "agentic.py":
        # The engine's episodes are exact (a turn's prompt that re-tokenised the text, or a mask on an observation
        # token, gives 0); the engine's logprobs match Megatron's over a positive count of sampled tokens (a
        # multi-turn comparison that compared nothing printed 0.0 and passed); 64 episodes of 0.1 s answers take
        # far less than the answers one after another (an agent loop that waited on each tool call gives ~1).
        # The learning runs print nan here: tests/test_soak.py runs the tool run to 200 steps (bench/RESULTS.md has
        # the tool against no tool).
        assert f["exact"] == 1 and f["diff"] < 1e-3 and f["tokens"] > 0 and f["overlap"] < 0.5
    elif name == "algorithms.py":  # every algorithm's tiny config, 20 RL steps: each raises the task reward by
        # more than 0.05 over windows of 5 (an estimator, loss or sign that did not learn stays at +-0.03)
        assert f["total"] == 7 and f["learned"] == f["total"]
    elif name == "async_rl.py":  # tiny model, 4 measured steps, often beside another test (bench/RESULTS.md has
        # the full size). The probe chose the length so that the lag-0 sides are close: a probe that measured
        # nothing or chose the wrong end leaves one side at many times the other (bound near 1).
        assert f["bound"] > BOUND_MIN and f["tokens"] == 16  # (R + T) / max(R, T): 1.0 when a side timed nothing
        # Lag 1 overlaps: its throughput beats lag 0's (a lag 1 that waited for every version, as lag 0 does,
        # gives ~1.0); the two runs train on equal samples and stay close in reward (a stale-weights bug
        # that trained on the wrong version's logprobs would drift).
        assert f["x"] > ASYNC_MIN and abs(f["gap"]) < 0.2
        # a publish moves its bytes and more; a push includes vLLM's load (a push that loaded nothing would
        # give ~0; the tiny model's loads take milliseconds, so the other worker's load moves both figures)
        assert f["v"] > 0.8 and f["u"] > 0.6
    elif name == "controller_scaling.py":  # DP=2, 1 KiB payloads: the parallel controller sends under 0.3 of
        # the single controller's data bytes (one that shipped rows or completions through rank 0 gives ~1)
        assert f["data"] < 0.3 and 0 < f["total"] <= 1
    elif name == "data_scale.py":  # 100,000 verl-layout Parquet rows, 2 ranks: each holds ~51 MB more (datasets'
        # import, the sampler's permutation); rows read into a list, as a JSON-lines file is, hold 205 MB more
        assert f["rows"] == 100_000 and f["mb"] < 120 and f["open"] + f["first"] < 30, f
    elif name == "dp_balance.py":
        # Long sequences: tokens dominate, so the cost model must move them and even the ranks out (a balancer
        # that moved nothing leaves imbalance_after = before); at both sizes a balanced step twice as slow as
        # the unbalanced one would be a wrong decision. The smoke size runs the long distribution only.
        assert f["long_after"] <= 1.1 and f["long_after"] < f["long_before"]
        assert f["long_speedup"] > 0.5 and math.isnan(f["speedup"])
    elif name == "gpu_check.py":  # on CPU: Megatron's logits equal transformers' (a wrong weight layout gives
        # O(1)) and the step produced a gradient (a detached loss gives 0)
        assert f["logit_diff"] < 1e-4 and f["grad_norm"] > 0
    elif name == "interrupts.py":  # every Ctrl-C stops the run with its newest step saved, named by `latest`,
        # resumed from exactly there, and the chain ends bit for bit on the uninterrupted run's weights
        assert f["k"] >= 2 and f["stopped"] == f["latest"] == f["resumed"] == f["k"]
        assert f["continued"] == 0 and f["bitwise"] == 1
    elif name == "kill_resume.py":  # SIGKILLs anywhere, the finalisation window included: no reported save
        # lost or corrupt, every run resumed, the final weights bitwise those of an uninterrupted run
        assert f["kills"] >= 2 and f["resumed"] == f["kills"]
        assert f["lost"] == f["corrupt"] == 0 and f["bitwise"] == 1
    elif name == "learning.py":  # 12 deterministic steps of configs/grpo_tiny.yaml, windows of 3 (LEARN_MIN): a
        # learner that does not update (or updates the wrong way) stays near 0 or below
        assert f["margin"] > LEARN_MIN, f["margin"]
    elif name == "lora.py":  # the tiny model (377984 parameters; rank 8 on 7 projections of 2 layers: 32768),
        # fp32 and Adam's two moments: what is pushed and what the optimizer holds are the adapters' share exactly
        # (a push of the merged weights, or an optimizer over the base, gives 1); the engine serves the adapter
        # (an engine that ignored it differs from Megatron's logprobs after the first update).
        share = 32768 / 377984
        assert abs(f["share"] - share) < 1e-4 and abs(f["sync"] - share) < 1e-4 and abs(f["opt"] - share) < 1e-4
        assert f["diff"] < 1e-3
    elif name == "moe.py":  # the tiny Qwen3-MoE at EP=2: each rank pushes every expert of both layers into its
        # engine, 2 x 8 x (128x128 + 128x64) fp32 (a push of the rank's own 4 experts gives half), and the engine
        # holds them (without repacking the experts after a reload, 0.1 off from the first push on); the push
        # includes the engine's load (one that skipped it would be ~0)
        # (the smoke runs EP=2 only: the DP=2 comparison is the full size's, bench/RESULTS.md)
        assert f["bytes"] == 2 * 8 * (128 * 128 + 128 * 64) * 4 and f["diff"] < 1e-3 and f["push"] > 0.6
    elif name == "multimodal_controller.py":  # 1 and 2 ranks, 64 KB images, the parallel controller only: rank
        # 0's peak memory does not grow with the ranks (one that held every rank's images grows with them; a
        # figure below 0.9 would mean the 1-rank run measured something else)
        assert 0.9 < f["parallel"] <= 1.1
    elif name == "placement.py":  # 1 step: noisy, but a partial placement that serialised (or waited out a
        # timeout) on its judge would be far outside this
        assert 0.2 < f["ratio"] < 5
    elif name == "stages.py":  # SFT 60 steps, its export loaded by GRPO (Megatron and vLLM), DPO 10, distillation
        # 25, held-out rows on prompts no training row has (checked below): the held-out SFT loss halves and DPO
        # ranks held-out pairs (a stage that memorised its training prompts, or a loss on the wrong tokens, does
        # not); GRPO from the SFT export starts at half reward (an export vLLM loaded wrongly starts at ~0.1);
        # the student's KL to the teacher falls.
        assert f["sft"] >= SFT_MIN and f["from_sft"] == 1 and f["dpo"] >= DPO_MIN and f["kl"] > 0.15
    elif name == "step_efficiency.py":  # one measured step of 16 tokens. The step's rollout and train phases take
        # at least about the bare engine's and bare Megatron's time (a step that skipped work would be far
        # below), and the timed generation, forward/backward and push account for most of the step (timers
        # that missed the engine's steps or the model's passes leave the whole step as overhead, ~1).
        assert f["r"] > 0.5 and f["t"] > 0.5 and f["o"] < OVERHEAD_MAX
    elif name == "step_breakdown.py":  # training takes a share strictly inside (0, 1) (a phase not timed gives
        # 0 or everything), and no rank holds 3 GB (the tiny model and its engine hold well under 1)
        assert 0 < f["train"] < 1 and f["rss"] < 3


def test_the_async_probe_chooses_the_length_where_its_lines_cross():
    """bench/async_rl.py's probe (its full size; the smoke gives 16 tokens): each side's time is a line through
    its means at the two probed lengths, and the length chosen is where the predicted bound peaks, where the
    lines cross when they do inside the range (a probe that swapped the sides, or dropped the wrong step as
    warm-up, chooses elsewhere)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_async_rl", REPO / "bench" / "async_rl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    top = 240
    steps = [max(1, round(top * f)) for f in bench.PROBE]  # 240, 60, 240, 60, 240 tokens
    rows = [{"produce": 0.1 + 0.002 * n, "train": 0.3 + 0.0005 * n} for n in steps]
    rows[0] = {"produce": 9.0, "train": 9.0}  # the warm-up step, slow: left out
    chosen, why = bench.choose_length(rows, top)
    assert chosen == 133 and "R and T cross here" in why, why  # 0.1 + 0.002 n = 0.3 + 0.0005 n at n = 133.3
    rows = [{"produce": 0.1 + 0.01 * n, "train": 0.3 + 0.001 * n} for n in steps]  # R longer everywhere
    chosen, why = bench.choose_length(rows, top)
    assert chosen == 60 and "R is the longer side at every length" in why, why


def test_every_bench_has_a_smoke_test():
    assert sorted([*LAST_LINE, *RUN_ELSEWHERE]) == BENCHES


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAST_LINE))
def test_bench_runs_at_its_smoke_size(name, tmp_path):
    proc = run([sys.executable, str(REPO / "bench" / name), "--smoke"], cwd=tmp_path, timeout=800)
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(LAST_LINE[name], last)
    assert m, f"{name}: last line {last!r} is not in the format bench/RESULTS.md quotes"
    check(name, {k: float(v) for k, v in m.groupdict().items()})
    if name == "async_ckpt.py":  # its wall figures at 4 MiB beside another test measure the contention (CI's
        # stall_ratio was 2.02 and 2.09, 3.7 beside two burned cores, 0.3 quiet); in CPU, the training thread does
        # little of an async save's work (0.11-0.13 here, quiet or beside two burned cores; ~1 if it wrote inline)
        share = re.search(r"^main_thread_share=(\S+)$", proc.stdout, re.M)
        assert share and float(share.group(1)) < 0.5, proc.stdout[-2000:]
    if name == "stages.py":  # vLLM and Megatron, both loading the SFT checkpoint's export, give the same logprobs
        diff = re.search(r"^sft_export_engine_vs_policy_logprob_diff=(\S+)$", proc.stdout, re.M)
        assert diff and float(diff.group(1)) < 1e-3, proc.stdout[-2000:]
    if name == "async_rl.py":  # lag 0 never ran ahead, lag 1 did (by exactly one version); both from the figure
        # each run logged (a run that logged none fails); the smoke runs at 16 tokens without the probe (its
        # choice has a pure test above); the colocated run ran and the fastest placement is named
        assert "lag0_staleness_max=0 lag1_staleness_max=1" in proc.stdout.splitlines()
        assert "16 tokens, as given (no probe)" in proc.stdout.splitlines()
        assert re.search(r"^fastest placement on these \d+ cores: ", proc.stdout, re.M), proc.stdout[-2000:]
        # the runs generated at the chosen length (the tiny random model rarely stops early): a run that kept
        # the config's 6 tokens would not
        tokens = int(m["tokens"])
        for mode in ("lag0", "lag1", "colocated"):  # the smoke size skips the one-process colocated run
            length = float(re.search(rf"^{mode}: .* response length (\S+) ", proc.stdout, re.M).group(1))
            assert tokens / 2 < length <= tokens, (mode, length, tokens)
    if name == "stages.py":  # the held-out rows share no prompt with the training rows, as the bench ran them
        for config in ("sft_tiny", "dpo_tiny"):
            assert re.search(rf"^{config} split: .* 0 held-out prompts in training", proc.stdout, re.M), proc.stdout
    if name == "lora.py":  # the full and the LoRA run start from one base with the adapters at zero: their first
        # step samples the same completions (an adapter initialised non-zero, or a different base, does not)
        first = re.findall(r"^(?:full|LoRA): reward (\S+) at step 1", proc.stdout, re.M)
        assert len(first) == 2 and first[0] == first[1], proc.stdout[-2000:]
    if name == "step_efficiency.py":  # the engine sampled the bare vLLM's tokens (same seeds, same weights)
        assert "same tokens as the bare engine: True" in proc.stdout.splitlines(), proc.stdout[-2000:]
