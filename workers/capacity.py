"""The capacity planner: a step-time model of synchronous and asynchronous RL on a GPU cluster.

Pure arithmetic, no torch. Every constant is a published hardware figure (cited where it is defined)
or a named assumption; none is fitted to LlamaRL's results.

Per step the model prices three things:
- generation (Tg): prefill (compute bound) plus decode, where each decode step reads the replica's
  weights and KV cache from HBM (memory bound) unless its matmuls are the slower part; a synchronous
  batch waits for its longest completion, so decode runs for `gen_max` steps; tensor-parallel
  all-reduces per layer; waves when the KV cache does not fit.
- training (Tt): 6 * params * tokens FLOPs at a model FLOPs utilisation, or FSDP's traffic if slower.
- weight sync (Ts): DDMA, every generator GPU receives its TP slice of the weights while every
  trainer GPU sends its shard to each replica.

sync (split) = Tg + Tt + Ts; async = max(Tg, Tt) + Ts (a conservative bound: our generators stall only
for the load, not the transfer); co-located sync (the paper's DeepSpeed-Chat-like baseline: every GPU
generates, then every GPU trains) = Tg(N) + Tt(N) + offload of the training state over PCIe + reshard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Gpu:
    """One accelerator. Defaults: NVIDIA H100 SXM5 80GB (H100 datasheet, nvidia.com/en-us/data-center/h100)."""

    bf16_tflops: float = 989.4
    """Dense BF16 tensor-core peak (the datasheet's 1,979 is with 2:4 sparsity)."""
    hbm_gb: float = 80.0
    """HBM3 capacity."""
    hbm_gbps: float = 3350.0
    """HBM3 bandwidth, 3.35 TB/s."""
    pcie_gbps: float = 64.0
    """PCIe Gen5 x16, 64 GB/s per direction (used for offloading the co-located baseline's state)."""


@dataclass(frozen=True)
class Network:
    """Interconnect. Defaults: a DGX/HGX H100 node on an NDR InfiniBand fabric."""

    nvlink_gbps: float = 450.0
    """NVLink 4 per GPU and direction: 900 GB/s total bidirectional (H100 datasheet)."""
    inter_node_gbps: float = 50.0
    """Per-GPU network, one ConnectX-7 NDR 400 Gb/s port per GPU = 50 GB/s per direction."""
    gpus_per_node: int = 8
    """GPUs that share NVLink (HGX H100 8-GPU)."""
    allreduce_latency_s: float = 10e-6
    """Assumption: the fixed cost of one small NCCL all-reduce inside a node (a few microseconds)."""


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a real stack reaches. Assumptions, each with its source; not fitted to LlamaRL."""

    train_mfu: float = 0.40
    """Llama 3 pre-training reached 38-43% BF16 MFU on H100 (Llama 3 paper, arXiv 2407.21783, Table 4)."""
    gen_mfu: float = 0.40
    """Matmul efficiency of prefill and of compute-bound decode; assumed equal to training's."""
    memory_efficiency: float = 0.80
    """Achieved / peak HBM bandwidth in decode kernels (assumption; memcpy reaches ~90% on H100)."""
    network_efficiency: float = 0.80
    """Achieved / peak link bandwidth for large NCCL transfers (assumption)."""


@dataclass(frozen=True)
class Model:
    """A dense Llama-like decoder."""

    params_b: float
    """Parameters, billions."""
    layers: int
    hidden: int
    kv_dim: int = 1024
    """Width of K (and of V) per layer: Llama 3 uses 8 KV heads of 128 at every size (GQA)."""
    weight_bytes_per_param: float = 2.0
    """bf16 weights on generators and in the sync."""
    train_bytes_per_param: float = 16.0
    """bf16 weights and grads plus fp32 master weights and two Adam moments (mixed precision)."""

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_dim * self.weight_bytes_per_param


# Published Llama 3.1 shapes (model cards / config.json): layers, hidden.
LLAMA3 = {
    "8b": Model(8.03, 32, 4096),
    "70b": Model(70.6, 80, 8192),
    "405b": Model(405.9, 126, 16384),
}


def llama_like(params_b: float) -> Model:
    """A Llama-3-shaped model of any size: params ~= 12 * layers * hidden^2 with hidden / layers ~= 128
    (8B: 4096/32, 405B: 16384/126); the shape grows with the size, so every cost does too."""
    hidden = (128 * params_b * 1e9 / 12) ** (1 / 3)
    return Model(params_b, max(1, round(hidden / 128)), int(hidden))


@dataclass(frozen=True)
class Workload:
    """One RL step's batch."""

    sequences: int
    """Completions per step (prompts x group size)."""
    prompt_tokens: float
    """Mean prompt length."""
    gen_mean: float
    """Mean completion length."""
    gen_max: float
    """Longest completion: a synchronous batch waits for it."""


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu = Gpu()
    network: Network = Network()
    efficiency: Efficiency = Efficiency()


@dataclass(frozen=True)
class Prediction:
    generator_gpus: int
    trainer_gpus: int
    tp: int
    generate_s: float
    train_s: float
    sync_s: float
    sync_step_s: float
    async_step_s: float
    colocated_step_s: float

    @property
    def speedup(self) -> float:
        return self.colocated_step_s / self.async_step_s

    def bubbles(self, mode: str) -> tuple[float, float]:
        """(generator, trainer) idle fraction of the step: 'sync' (split) or 'async'."""
        step = self.sync_step_s if mode == "sync" else self.async_step_s
        return 1 - self.generate_s / step, 1 - self.train_s / step


def _link_gbps(cluster: Cluster, gpus: int) -> float:
    """Bandwidth of a collective over `gpus` GPUs: NVLink inside a node, the NIC beyond."""
    net = cluster.network
    peak = net.nvlink_gbps if gpus <= net.gpus_per_node else net.inter_node_gbps
    return peak * GB * cluster.efficiency.network_efficiency


def generate_seconds(model: Model, work: Workload, gpus: int, tp: int, cluster: Cluster) -> float:
    """Time for `gpus` generator GPUs (replicas of `tp`) to finish the batch; inf if it cannot fit."""
    gpu, eff = cluster.gpu, cluster.efficiency
    replicas = gpus // tp
    if replicas < 1:
        return math.inf
    weights_per_gpu = model.weight_bytes / tp
    kv_room = gpu.hbm_gb * GB * 0.9 - weights_per_gpu  # 10% for activations and the runtime
    if kv_room <= 0:
        return math.inf
    per_replica = math.ceil(work.sequences / replicas)
    kv_needed = per_replica * (work.prompt_tokens + work.gen_max) * model.kv_bytes_per_token / tp
    waves = max(1, math.ceil(kv_needed / kv_room))
    seqs = per_replica / waves
    flops_rate = tp * gpu.bf16_tflops * TFLOPS * eff.gen_mfu
    memory_rate = gpu.hbm_gbps * GB * eff.memory_efficiency
    prefill = 2 * model.params_b * 1e9 * seqs * work.prompt_tokens / flops_rate
    # Each decode step reads the weights once and the KV cache of the live sequences.
    kv_reads = seqs * (work.prompt_tokens * work.gen_mean + work.gen_mean ** 2 / 2) * model.kv_bytes_per_token / tp
    memory = (work.gen_max * weights_per_gpu + kv_reads) / memory_rate
    compute = 2 * model.params_b * 1e9 * seqs * work.gen_mean / flops_rate
    allreduce = 0.0
    if tp > 1:  # two all-reduces of the activations per layer and token (attention and MLP outputs)
        volume = 2 * model.layers * seqs * work.gen_mean * model.hidden * 2 * 2 * (tp - 1) / tp
        allreduce = volume / _link_gbps(cluster, tp) + 2 * model.layers * work.gen_max * cluster.network.allreduce_latency_s
    return waves * (prefill + max(memory, compute) + allreduce)


def best_tp(model: Model, work: Workload, gpus: int, cluster: Cluster) -> tuple[int, float]:
    """The tensor-parallel size (a power of two dividing into `gpus`) that generates fastest."""
    best = (1, math.inf)
    tp = 1
    while tp <= gpus:
        seconds = generate_seconds(model, work, gpus, tp, cluster)
        if seconds < best[1]:
            best = (tp, seconds)
        tp *= 2
    return best


def train_seconds(model: Model, work: Workload, gpus: int, cluster: Cluster) -> float:
    """One optimizer step on `gpus` FSDP ranks; inf if the training state does not fit."""
    gpu, eff = cluster.gpu, cluster.efficiency
    if gpus < 1 or model.params_b * 1e9 * model.train_bytes_per_param / gpus > gpu.hbm_gb * GB * 0.7:
        return math.inf  # 30% left for activations (with checkpointing)
    tokens = work.sequences * (work.prompt_tokens + work.gen_mean)
    compute = 6 * model.params_b * 1e9 * tokens / (gpus * gpu.bf16_tflops * TFLOPS * eff.train_mfu)
    # FSDP moves about 3x the bf16 weights per GPU per step (all-gather forward and backward,
    # reduce-scatter of the gradients); it overlaps compute, so the slower of the two sets the time.
    traffic = 3 * model.weight_bytes * (gpus - 1) / gpus / _link_gbps(cluster, gpus)
    return max(compute, traffic)


def sync_seconds(model: Model, generator_gpus: int, tp: int, trainer_gpus: int, cluster: Cluster) -> float:
    """DDMA: each generator GPU receives its TP slice; each trainer GPU sends its shard to every replica."""
    link = _link_gbps(cluster, generator_gpus + trainer_gpus)
    replicas = generator_gpus // tp
    receive = model.weight_bytes / tp / link
    send = model.weight_bytes / trainer_gpus * replicas / link
    load = model.weight_bytes / tp / (cluster.gpu.hbm_gbps * GB * cluster.efficiency.memory_efficiency)
    return max(receive, send) + load


def colocated_seconds(model: Model, work: Workload, gpus: int, cluster: Cluster) -> float:
    """The synchronous co-located baseline: all GPUs generate, then all train, state offloaded between."""
    _, generate = best_tp(model, work, gpus, cluster)
    train = train_seconds(model, work, gpus, cluster)
    # Optimizer state and grads leave HBM for generation and come back for training (out and in).
    offload = 2 * model.params_b * 1e9 * (model.train_bytes_per_param - model.weight_bytes_per_param) / gpus / (
        cluster.gpu.pcie_gbps * GB)
    return generate + train + offload


def predict(model: Model, work: Workload, generator_gpus: int, trainer_gpus: int,
            cluster: Cluster = Cluster()) -> Prediction:
    """Step times for a given split of the GPUs between generators and trainers."""
    tp, generate = best_tp(model, work, generator_gpus, cluster)
    train = train_seconds(model, work, trainer_gpus, cluster)
    sync = sync_seconds(model, generator_gpus, tp, max(1, trainer_gpus), cluster)
    return Prediction(generator_gpus, trainer_gpus, tp, generate, train, sync,
                      sync_step_s=generate + train + sync, async_step_s=max(generate, train) + sync,
                      colocated_step_s=colocated_seconds(model, work, generator_gpus + trainer_gpus, cluster))


def best_split(model: Model, work: Workload, total_gpus: int, cluster: Cluster = Cluster(),
               granularity: int | None = None) -> Prediction:
    """The generator/trainer split (in whole nodes by default) with the shortest async step."""
    step = granularity or min(cluster.network.gpus_per_node, max(1, total_gpus // 2))
    candidates = [predict(model, work, g, total_gpus - g, cluster) for g in range(step, total_gpus, step)]
    if not candidates:
        raise ValueError(f"cannot split {total_gpus} GPUs in steps of {step}")
    return min(candidates, key=lambda p: (p.async_step_s, p.generator_gpus))


def with_bandwidth(cluster: Cluster, inter_node_gbps: float) -> Cluster:
    return replace(cluster, network=replace(cluster.network, inter_node_gbps=inter_node_gbps))


# ---------------------------------------------------------------- the paper's three settings

@dataclass(frozen=True)
class PaperSetting:
    name: str
    model: Model
    total_gpus: int
    workload: Workload
    baseline_s: float
    llamarl_s: float


# Published step times (LlamaRL, arXiv 2505.24034: DeepSpeed-Chat-like baseline vs LlamaRL). The GPU
# counts and batch shapes are OUR ASSUMPTIONS (the setup table could not be retrieved here): H100s,
# 2048 completions per step, 1024-token prompts, completions of mean 1024 and at most 4096 tokens.
ASSUMED_WORKLOAD = Workload(sequences=2048, prompt_tokens=1024, gen_mean=1024, gen_max=4096)
PAPER = [
    PaperSetting("8B", LLAMA3["8b"], 128, ASSUMED_WORKLOAD, 22.45, 8.90),
    PaperSetting("70B", LLAMA3["70b"], 256, ASSUMED_WORKLOAD, 82.32, 20.67),
    PaperSetting("405B", LLAMA3["405b"], 1024, ASSUMED_WORKLOAD, 635.8, 59.5),
]


def markdown_plan(model: Model, work: Workload, prediction: Prediction) -> str:
    p = prediction
    sync_bubbles, async_bubbles = p.bubbles("sync"), p.bubbles("async")
    return "\n".join([
        f"Model {model.params_b:g}B ({model.layers} layers, hidden {model.hidden}); {work.sequences} completions "
        f"per step, prompt {work.prompt_tokens:g}, generation mean {work.gen_mean:g} / max {work.gen_max:g} tokens",
        "",
        "| generator GPUs | trainer GPUs | gen TP | Tg s | Tt s | sync s | sync step s | async step s | "
        "co-located sync step s | bubble sync gen/train | bubble async gen/train |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {p.generator_gpus} | {p.trainer_gpus} | {p.tp} | {p.generate_s:.2f} | {p.train_s:.2f} | {p.sync_s:.2f} | "
        f"{p.sync_step_s:.2f} | {p.async_step_s:.2f} | {p.colocated_step_s:.2f} | "
        f"{sync_bubbles[0]:.0%} / {sync_bubbles[1]:.0%} | {async_bubbles[0]:.0%} / {async_bubbles[1]:.0%} |",
    ])


def markdown_paper(cluster: Cluster = Cluster()) -> str:
    lines = [
        "| model | GPUs (assumed) | best split gen/train (TP) | predicted co-located sync s | paper baseline s | "
        "predicted async s | paper LlamaRL s | predicted speed-up | paper speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in PAPER:
        p = best_split(s.model, s.workload, s.total_gpus, cluster)
        lines.append(f"| {s.name} | {s.total_gpus} | {p.generator_gpus}/{p.trainer_gpus} ({p.tp}) | "
                     f"{p.colocated_step_s:.2f} | {s.baseline_s} | {p.async_step_s:.2f} | {s.llamarl_s} | "
                     f"{p.speedup:.2f}x | {s.baseline_s / s.llamarl_s:.2f}x |")
    return "\n".join(lines)
