"""Published measurements the simulator is judged on: data only, one row per measurement, each with its source.

Every row is a measurement published by the party named in ``source`` (nothing here is estimated by us); ``setup``
holds what is needed to rebuild it in the simulator. Rows are grouped in families, chip x strategy, and the families
are split ONCE into a calibration half (the only rows ``sim_validation.fit`` may look at) and a validation half
(``SPLIT``). A family is never split, so a validation figure always comes from a chip/strategy pair whose rows the
fit did not see.

Kinds and units:
- ``collective``: nccl-tests bus bandwidth, GB/s (busbw = S/t x 2(n-1)/n for all_reduce, x (n-1)/n otherwise;
  nccl-tests doc/PERFORMANCE.md); setup: preset, hardware overrides, kind, ranks, bytes, forced algorithm.
- ``gemm`` / ``attention`` / ``hbm``: kernel throughput, TFLOP/s or TB/s.
- ``training``: step throughput of a training run, tokens/s/device or TFLOP/s/device counted with the source's own
  FLOP formula (``flops``: "megatron" = Narayanan et al. 2021 eq. 3 without recompute, "maxtext" = MaxText's
  calculate_tflops_training_per_device before 2025-04, i.e. non-causal attention); ``mem_gib`` the peak memory
  the source reports for the same run, if any; setup ``runtime`` the machinery that ran it, as the memory replay
  holds its buffers (``MemoryResult.reserved_bytes``: "partir", the default, or "eager": FSDP2 and
  torch.utils.checkpoint), with ``fsdp_held`` the parameters FSDP2 keeps gathered through the step.

Sizes in nccl-tests tables are powers of two ("1M" = 2**20 B, "8G" = 2**33 B).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MiB, GiB = 2 ** 20, 2 ** 30


@dataclass(frozen=True)
class Ref:
    name: str            # unique
    kind: str            # collective | gemm | attention | hbm | training
    chip: str            # a100 | h100 | h200 | b200 | v4 | v5e | v5p
    strategy: str        # all_reduce | all_gather | all_to_all | gemm | attention | hbm | fsdp | zero2 | dp | tp ...
    #                      (attention-fwd+bwd: forward + backward attention kernel rows)
    measured: float
    unit: str
    source: str
    setup: dict = field(default_factory=dict, hash=False)
    mem_gib: float | None = None      # peak memory per device the source reports (training rows)
    mem_kind: str = "allocated"       # what mem_gib measures: "allocated" (max_memory_allocated: live tensors) or
    #                                   "reserved" (max_memory_reserved: the caching allocator's segments)

    @property
    def family(self) -> str:
        return f"{self.chip}/{self.strategy}"


AZ_A100 = "Azure/AI-benchmarking-guide Azure_Results/ND_A100_v4_results.md (NCCL 2.18.5, in-place)"
AZ_H100 = "Azure/AI-benchmarking-guide Azure_Results/ND_H100_v5_results.md (NCCL 2.18.5, in-place)"
AZ_H200 = "Azure/AI-benchmarking-guide Azure_Results/ND_H200_v5_results.md (NCCL 2.20)"
GTC = "NVIDIA GTC'25 S72583 (via docs/hardware.md)"
FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
TITAN_A100 = "pytorch/torchtitan docs/performance.md (2024, 64 A100-80G)"
TITAN_H100 = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (vanilla TP, bf16)"
TITAN_H100_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (async TP, bf16)"
TITAN_H100_MEM = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MEGATRON = "NVIDIA/Megatron-LM README images/model_table.png (H100, seq 4096, vocab 131072)"
MAXTEXT = "AI-Hypercomputer/maxtext src/maxtext/configs/tpu/{gen}/README.md"
MAXTEXT_A3 = "AI-Hypercomputer/maxtext src/maxtext/configs/gpu/a3/llama_2_7b/README.md"


def _curve(chip, preset, sizes_gbs, source, **extra):
    return [Ref(f"{chip} 8x all_reduce {_sz(s)}", "collective", chip, "all_reduce", v, "GB/s", source,
                dict(preset=preset, kind="all_reduce", n=8, bytes=s, **extra)) for s, v in sizes_gbs]


def _sz(b):
    return f"{b // GiB} GiB" if b >= GiB else f"{b // MiB} MiB"


_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB, 8 * GiB]

COLLECTIVES = [
    *_curve("a100", "a100-80g", zip(_SIZES, [36.22, 71.43, 109.22, 166.63, 213.87, 228.10, 231.58]), AZ_A100),
    *_curve("h200", "h200", zip(_SIZES, [53.0, 138.4, 240.4, 368.1, 432.2, 467.6, 480.0]), AZ_H200),
    *_curve("h100", "h100", zip(_SIZES, [43.70, 128.73, 234.45, 361.78, 423.38, 466.35, 478.87]), AZ_H100),
    Ref("a100 8x all_reduce 8 GiB (GTC)", "collective", "a100", "all_reduce", 232, "GB/s", GTC,
        dict(preset="a100-80g", kind="all_reduce", n=8, bytes=8 * GiB)),
    Ref("h100 8x all_reduce NVLS 8 GiB (GTC)", "collective", "h100", "all_reduce", 480, "GB/s", GTC,
        dict(preset="h100", kind="all_reduce", n=8, bytes=8 * GiB, algorithm="nvls")),
    Ref("h100 8x all_reduce ring 8 GiB (GTC)", "collective", "h100", "all_reduce", 370, "GB/s", GTC,
        dict(preset="h100", kind="all_reduce", n=8, bytes=8 * GiB, algorithm="ring")),
    Ref("h100 32x all_reduce 8 GiB (GTC)", "collective", "h100", "all_reduce", 370, "GB/s", GTC,
        dict(preset="h100", kind="all_reduce", n=32, bytes=8 * GiB, hw=dict(nodes=4))),
    Ref("h100 32x all_reduce SHARP 8 GiB (GTC)", "collective", "h100", "all_reduce", 480, "GB/s", GTC,
        dict(preset="h100", kind="all_reduce", n=32, bytes=8 * GiB, hw=dict(nodes=4, ib_sharp=True))),
    # NCCL maintainer (S. Jeaugey), nccl-tests issue #212: "NCCL can get an effective NVLink bandwidth of 370GB/s,
    # which you can observe as BusBw when running non-allreduce operations" (8xH100, large sizes).
    Ref("h100 8x all_gather large", "collective", "h100", "all_gather", 370, "GB/s",
        "NVIDIA/nccl-tests issue #212 (maintainer comment, 2024-05-06)",
        dict(preset="h100", kind="all_gather", n=8, bytes=8 * GiB)),
    # nccl issue #2169: alltoall_perf on 4 H100 80GB HBM3 of one node, NCCL 2.30.4, 524288000 B, out-of-place.
    Ref("h100 4x all_to_all 500 MiB", "collective", "h100", "all_to_all", 334.90, "GB/s",
        "NVIDIA/nccl issue #2169 (alltoall_perf output, NCCL 2.30.4)",
        dict(preset="h100", kind="all_to_all", n=4, bytes=524288000, hw=dict(gpus_per_node=4))),
    # nccl issue #1807: "should the all_reduce_perf performance of 8 B200s in a single machine reach 900+? Ours is
    # 830+" (NCCL 2.27.1).
    Ref("b200 8x all_reduce large", "collective", "b200", "all_reduce", 830, "GB/s",
        "NVIDIA/nccl issue #1807 (user report, NCCL 2.27.1)",
        dict(preset="b200", kind="all_reduce", n=8, bytes=8 * GiB)),
]

# cuBLASLt GEMMs (random init, 10,000 warm-up iterations): A100 fp16, H100/H200 fp8. (m, n, k, TFLOP/s)
_GEMMS = {
    ("a100", "a100-80g", "float16", AZ_A100): [(1024, 1024, 1024, 119.4), (2048, 2048, 2048, 221.8),
                                                (4096, 4096, 4096, 228.0), (8192, 8192, 8192, 253.7),
                                                (1024, 2145, 1024, 132.8), (6144, 12288, 12288, 250.8),
                                                (802816, 192, 768, 157.8)],
    ("h100", "h100", "float8_e4m3fn", AZ_H100): [(1024, 1024, 1024, 274.1), (2048, 2048, 2048, 1011.3),
                                                  (4096, 4096, 4096, 1216.9), (8192, 8192, 8192, 1290.1),
                                                  (1024, 2145, 1024, 410.7), (6144, 12288, 12288, 1351.4),
                                                  (802816, 192, 768, 663.8)],
    ("h200", "h200", "float8_e4m3fn", AZ_H200): [(1024, 1024, 1024, 290.8), (2048, 2048, 2048, 1013.4),
                                                  (4096, 4096, 4096, 1249.1), (8192, 8192, 8192, 1300.6),
                                                  (1024, 2145, 1024, 407.9), (6144, 12288, 12288, 1318.0),
                                                  (802816, 192, 768, 717.5)],
}
KERNELS = [Ref(f"{chip} gemm {dt} {m}x{n}x{k}", "gemm", chip, "gemm", v, "TFLOP/s", src,
               dict(preset=preset, m=m, n=n, k=k, dtype=dt))
           for (chip, preset, dt, src), rows in _GEMMS.items() for m, n, k, v in rows]
# FlashAttention-2 forward (Dao's benchmark_flash_attention.py, which the guide greps for "batch_size=2,
# seqlen=8192": its first match is causal=False, hidden 2048 = heads x head_dim), bf16/fp16.
KERNELS += [Ref(f"{chip} flash-attention-2 fwd hd{hd}", "attention", chip, "attention", v, "TFLOP/s", src,
                dict(preset=preset, batch=2, seq=8192, heads=2048 // hd, head_dim=hd, causal=False))
            for chip, preset, hd, v, src in [("a100", "a100-80g", 64, 179.5, AZ_A100),
                                             ("h100", "h100", 128, 327.9, AZ_H100),
                                             ("h200", "h200", 128, 329.3, AZ_H200)]]
# FlashAttention-2 forward + backward (one training step's attention: the forward and its backward, 2.5x the
# forward's FLOPs), non-causal and causal, read off the bar labels of the flash-attention README's figures
# (section Performance; assets/flash2_a100_fwd_bwd_benchmark.png, A100 80GB SXM4, and
# assets/flash2_h100_fwd_bwd_benchmark.png, H100 80GB SXM5, both added 2023-07-17 in commit 4f285b3): hidden 2048
# (= heads x head_dim), batch 16k / seqlen, fp16/bf16, TFLOP/s counted by benchmarks/benchmark_flash_attention.py's
# `flops(..., mode="fwd_bwd")`: 3.5 x 4 b s^2 h d, halved when causal. Only the training rows' sequences (2k-8k).
# Their own families, predicted but never fitted (sim_validation.HELD_OUT_ONLY): the simulator's attention cost is
# under study (benchmarks/notes/sim_validation.md, "FlashAttention-2 forward + backward rows").
# (seq, head_dim, causal, TFLOP/s)
FA_README = "Dao-AILab/flash-attention README.md, Performance, {} (assets/flash2_{}_fwd_bwd_benchmark.png)"
_FA2_FWD_BWD = {
    ("a100", "a100-80g"): [(2048, 64, False, 162), (4096, 64, False, 171), (8192, 64, False, 175),
                           (2048, 128, False, 187), (4096, 128, False, 196), (8192, 128, False, 201),
                           (2048, 64, True, 140), (4096, 64, True, 156), (8192, 64, True, 165),
                           (2048, 128, True, 155), (4096, 128, True, 173), (8192, 128, True, 182)],
    ("h100", "h100"): [(2048, 64, False, 274), (4096, 64, False, 288), (8192, 64, False, 294),
                       (2048, 128, False, 320), (4096, 128, False, 326), (8192, 128, False, 335),
                       (2048, 64, True, 232), (4096, 64, True, 257), (8192, 64, True, 273),
                       (2048, 128, True, 265), (4096, 128, True, 294), (8192, 128, True, 308)],
}
KERNELS += [Ref(f"{chip} flash-attention-2 fwd+bwd hd{hd} s{T // 1024}k{' causal' if c else ''}", "attention", chip,
                "attention-fwd+bwd", v, "TFLOP/s", FA_README.format(chip.upper(), chip),
                dict(preset=preset, batch=16384 // T, seq=T, heads=2048 // hd, head_dim=hd, causal=c,
                     mode="fwd+bwd"))
            for (chip, preset), rows in _FA2_FWD_BWD.items() for T, hd, c, v in rows]
# HBM bandwidth, STREAM-style copy kernel (read + write counted), TB/s.
KERNELS += [Ref(f"{chip} hbm copy", "hbm", chip, "hbm", v, "TB/s", src, dict(preset=preset, bytes=2 * GiB))
            for chip, preset, v, src in [("a100", "a100-80g", 1.61, AZ_A100), ("h100", "h100", 2.90, AZ_H100),
                                         ("h200", "h200", 4.01, AZ_H200)]]


def _mpt(size):
    """MPT model configs (llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml): GELU MLP 4d, tied head, q/k/v
    in one GEMM (llm-foundry's attention ``Wqkv``)."""
    d, h, L = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
               "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
               "70b": (8192, 64, 80)}[size]
    return dict(vocab=50368, d=d, heads=h, layers=L, fused_qkv=True)


def _foundry(size, chip, preset, n, seq, mb, strategy, tok_s, ac=False, hw=None):
    """One llm-foundry row with GradAccum 1 (one micro-batch per step). FULL_SHARD = FSDP (ZeRO-3), SHARD_GRAD_OP
    = ZeRO-2; A100-40GB runs: bf16 PURE (parameters in bf16), H100: amp_bf16; both use FlashAttention."""
    return Ref(f"MPT-{size} {chip} x{n} seq {seq} mb {mb}{' AC' if ac else ''}", "training", chip, strategy, tok_s,
               "tokens/s/device", FOUNDRY,
               dict(model=dict(_mpt(size), seq=seq), preset=preset, hw=hw or {}, mesh={"dp": n}, batch=mb,
                    schedule=strategy, remat=ac))


_GPU_NODES = lambda n: {"nodes": n // 8} if n > 8 else {}          # noqa: E731
# torchtitan's H100s (Grand Teton): 96GB HBM2e at 2.4 TB/s, run at the default 500 W power limit; "the actual peak
# TFLOPs number is between SXM and NVL" (989 and 835 dense bf16 TFLOP/s; llama3_h100_202412_torchtitan.md): the
# midpoint.
_TITAN_H100 = {"hbm_bw": 2.4e12, "hbm_bytes": 96e9, "peak_bf16": (989 + 835) / 2 * 1e12}
# Google Cloud A3 High (a3-highgpu-8g): 1,000 Gbps per VM, of which four 200 Gbps NICs carry GPU-to-GPU traffic
# (GPUDirect-TCPX), i.e. 100 GB/s per 8 GPUs (Google Cloud docs, "Networking and GPU machines").
_A3_NIC = {"nic_bw": 800e9 / 8 / 8}

TRAINING = [
    # --- llm-foundry, A100 40GB, 1600 Gb/s RoCE per node (8 x 200 Gb/s): GradAccum 1 rows
    *[_foundry(s, "a100", "a100-40g", n, 2048, mb, "fsdp", t, ac, _GPU_NODES(n)) for s, n, mb, t, ac in [
        ("350m", 16, 18, 55413, False), ("760m", 16, 12, 29607, False), ("1b", 16, 8, 19085, False),
        ("3b", 16, 5, 9750, False), ("7b", 16, 16, 3645, True), ("13b", 16, 10, 1993, True),
        ("30b", 32, 4, 857, True), ("1b", 128, 10, 18647, False), ("7b", 128, 18, 3623, True)]],
    # --- llm-foundry, H100 80GB
    _foundry("7b", "h100", "h100", 8, 2048, 6, "fsdp", 10643),
    *[_foundry(s, "h100", "h100", n, 2048, mb, "fsdp", t, ac, _GPU_NODES(n)) for s, n, mb, t, ac in [
        ("13b", 8, 2, 4792, False), ("13b", 64, 2, 4800, False), ("7b", 128, 6, 10475, False),
        ("13b", 128, 16, 5080, True), ("70b", 128, 8, 1058, True)]],
    *[_foundry(s, "h100", "h100", 128, 2048, mb, "zero2", t, False, _GPU_NODES(128)) for s, mb, t in [
        ("1b", 12, 44123), ("3b", 8, 23422)]],
    # --- torchtitan on 64 A100-80G, FSDP2, bf16 mixed precision
    Ref("Llama-2-13B a100 x64 no AC", "training", "a100", "fsdp", 2162, "tokens/s/device", TITAN_A100,
        dict(model=dict(vocab=32000, seq=4096, d=5120, heads=40, layers=40, hidden=13824, gated=True, tied=False),
             preset="a100-80g", hw={"nodes": 8}, mesh={"dp": 64}, batch=2, schedule="fsdp", remat=False)),
    Ref("Llama-2-70B a100 x64 full AC", "training", "a100", "fsdp", 353, "tokens/s/device", TITAN_A100,
        dict(model=dict(vocab=32000, seq=4096, d=8192, heads=64, kv_heads=8, layers=80, hidden=28672, gated=True,
                        tied=False),
             preset="a100-80g", hw={"nodes": 8}, mesh={"dp": 64}, batch=2, schedule="fsdp", remat=True)),
    Ref("Llama-3-70B a100 x64 full AC", "training", "a100", "fsdp", 331, "tokens/s/device", TITAN_A100,
        dict(model=dict(vocab=128256, seq=8192, d=8192, heads=64, kv_heads=8, layers=80, hidden=28672,
                        gated=True, tied=False),
             preset="a100-80g", hw={"nodes": 8}, mesh={"dp": 64}, batch=1, schedule="fsdp", remat=True)),
    # --- Megatron-LM (Megatron-Core) weak-scaling table, H100: DP 48, distributed optimizer (ZeRO-1), run with
    #     Megatron's communication overlap: the parameter gather overlapped with the next forward
    #     (--overlap-param-gather: partir's zero(3, reshard_after_forward=False)) and tensor-parallel communication
    #     overlapped with the matmuls (--tp-comm-overlap: partir's tp_chunks=4, lower/overlap.py); q/k/v in one GEMM
    #     (Megatron-Core's linear_qkv, head-major: the colwise split gives each TP rank whole heads)
    *[Ref(f"GPT-{size} h100 TP{tp} DP48", "training", "h100", "dp" if tp == 1 else "tp", tflops, "TFLOP/s/device",
          MEGATRON, dict(model=dict(vocab=131072, seq=4096, d=d, heads=h, layers=L, fused_qkv=True), preset="h100",
                         hw={"nodes": 6 * tp}, mesh={"dp": 48, "tp": tp} if tp > 1 else {"dp": 48},
                         batch=192 // 48, schedule=("dp" if tp == 1 else "tp") + "+zero1-overlap", remat=False,
                         flops="megatron", options={"tp_chunks": 4} if tp > 1 else {}))
      # Megatron's distributed optimizer shards flat buffers of any size over the 48 data-parallel ranks; partir's
      # ZeRO tiles a dim the data axis does not divide unevenly, as torch.chunk does (issue 22), so every row runs
      # its Adam update on 1/48 of each (tensor-parallel) shard, e.g. 86 of the 7.1B TP2 shard's 4096 columns
      for size, h, d, L, tp, tflops in [("1.7B", 16, 2048, 24, 1, 408.8), ("7.1B", 32, 4096, 30, 2, 465.9),
                                        ("16B", 48, 6144, 32, 4, 489.1), ("32B", 56, 7168, 48, 8, 459.6)]],
    # --- the same Megatron-Core table, its pipelined rows (TP8 x PP x DP48; global batch 8 sequences per data-parallel
    #     replica, i.e. 8 x PP micro-batches of one sequence: Megatron's default micro-batch size 1). The README does
    #     not give the schedule; Megatron's default with PP > 1 and no virtual stages is 1F1B, which is what is
    #     simulated (Megatron cuts layers / PP blocks per stage, the embedding on the first stage, the head on the
    #     last). The gradient reduction and optimizer are as the TP rows above.
    *[Ref(f"GPT-{size} h100 TP8 PP{pp} DP48", "training", "h100", "tp+pp", tflops, "TFLOP/s/device", MEGATRON,
          dict(model=dict(vocab=131072, seq=4096, d=d, heads=h, layers=L, tied=False, fused_qkv=True), preset="h100",
               hw={"nodes": 6 * 8 * pp}, mesh={"dp": 48, "pp": pp, "tp": 8}, batch=batch // 48,
               schedule="tp+zero1-overlap", remat=False, flops="megatron", options={"tp_chunks": 4},
               pipeline=dict(stages=pp, schedule="1F1B", microbatches=batch // 48)))
      for size, h, d, L, pp, batch, tflops in [("70B", 64, 8192, 84, 2, 384, 419.7),
                                               ("119B", 80, 10240, 92, 4, 768, 420.5)]],
    # --- torchtitan async-TP benchmark, vanilla TP rows (bf16), H100 96GB HBM2e (2.4 TB/s, 500 W): _TITAN_H100.
    #     torchtitan's TP has sequence-parallel norms (enable_sequence_parallel defaults to True); the 8B row ran
    #     per-op selective AC (remat "selective": attention and every other matmul kept), the 70B row full AC
    *(_TITAN_TP := [Ref("Llama-3-8B h100 FSDP8 TP8", "training", "h100", "fsdp+tp", 4378, "tokens/s/device",
                        TITAN_H100,
        dict(model=dict(vocab=128256, seq=8192, d=4096, heads=32, kv_heads=8, layers=32, hidden=14336, gated=True,
                        tied=False),
             preset="h100", hw={"nodes": 8, **_TITAN_H100}, mesh={"dp": 8, "tp": 8},
             batch=12, schedule="fsdp+tp+sp", remat="selective")),
    Ref("Llama-3-70B h100 FSDP32 TP8", "training", "h100", "fsdp+tp", 597.3, "tokens/s/device", TITAN_H100,
        dict(model=dict(vocab=128256, seq=8192, d=8192, heads=64, kv_heads=8, layers=80, hidden=28672,
                        gated=True, tied=False),
             preset="h100", hw={"nodes": 32, **_TITAN_H100}, mesh={"dp": 32, "tp": 8},
             batch=16, schedule="fsdp+tp+sp", remat=True))]),
    # --- the same benchmark's async-TP rows (bf16): the same runs with torchtitan's async TP (Inductor's
    #     micro-pipeline TP: all_gather -> matmul and matmul -> reduce_scatter as symmetric-memory collective
    #     matmuls), simulated through partir's own ring program for them (async_tp=True, lower/ring.py). A family of
    #     its own, held out (never fitted)
    *[Ref(f"{r.name} async-TP", "training", "h100", "fsdp+async-tp", tps, r.unit, TITAN_H100_ASYNC,
          {**r.setup, "options": {"async_tp": True}})
      for r, tps in [(_TITAN_TP[0], 4809.4), (_TITAN_TP[1], 652.4)]],
    # --- torchtitan Llama 3.1 8B, FSDP on 8 / 128 H100 (96GB HBM2e), local batch 2, seq 8192; peak memory
    #     (max reserved) as published; "selective activation checkpointing" (torchtitan's llama3_8b config: the
    #     per-op policy, remat "selective"); eager PyTorch's machinery ran the step (runtime "eager",
    #     sim/allocator.eager_buffers): FSDP2's buffers on its streams, torch.utils.checkpoint's cache of saved outputs
    *[Ref(f"Llama-3.1-8B h100 x{n} FSDP", "training", "h100", "fsdp", tps, "tokens/s/device", TITAN_H100_MEM,
          dict(model=dict(vocab=128256, seq=8192, d=4096, heads=32, kv_heads=8, layers=32, hidden=14336,
                          gated=True, tied=False),
               preset="h100", hw={**_TITAN_H100, **_GPU_NODES(n)}, mesh={"dp": n}, batch=2,
               schedule="fsdp", remat="selective", runtime="eager",
               # FSDP2 keeps these gathered from the forward to the end of the backward: the root module's own
               # parameters (never resharded after the forward) and the last block (reshard_after_forward=False)
               fsdp_held=("emb.*", "norm.*", "head.*", "layers.31.*")), mem_gib=mem, mem_kind="reserved")
      for n, tps, mem in [(8, 5762, 82.4), (128, 5605, 67.0)]],
    # --- MaxText on TPU: FSDP over the slice (ICI), data parallel over slices (DCN); bf16 compute, fp32 weights;
    #     global_parameter_scale s: emb 2048*, heads 16*, mlp 7168*, layers 16* (get_individual_scales), head_dim
    #     128, SwiGLU, vocab 32000, seq 2048.
    *[Ref(f"MaxText-{s}B v5e {k}x256", "training", "v5e", "fsdp" if k == 1 else "fsdp+dcn", tf, "TFLOP/s/device",
          MAXTEXT.format(gen="v5e"),
          dict(model=dict(vocab=32000, seq=2048, d=d, heads=h, head_dim=128, layers=L, hidden=mlp, gated=True,
                          tied=False),
               preset="tpu-v5e", hw=dict(topology=(16, 16), slices=k),
               mesh={"dcn": k, "dp": 256} if k > 1 else {"dp": 256}, batch=pdb,
               schedule="fsdp" if k == 1 else "dcn+fsdp", remat=True, flops="maxtext"))
      for s, d, h, mlp, L, pdb, per_k in [
          (16, 4096, 64, 28672, 32, 6, {1: 120, 2: 117, 4: 117, 8: 115, 16: 111, 32: 108}),
          (32, 8192, 64, 28672, 32, 4, {1: 132, 2: 128, 4: 126, 8: 125, 16: 123, 32: 119}),
          (64, 8192, 64, 28672, 64, 2, {1: 118, 2: 112, 4: 110, 8: 108, 16: 105, 32: 99})]
      for k, tf in per_k.items()],
    # v4: v4-128 = 64 chips (4x4x4), v4-384 = 192 chips (4x4x12); explicit dims from configs/tpu/v4/*.sh
    Ref("MaxText-22B v4 1x128", "training", "v4", "fsdp", 156, "TFLOP/s/device", MAXTEXT.format(gen="v4"),
        dict(model=dict(vocab=32000, seq=2048, d=6144, heads=24, head_dim=128, layers=48, hidden=24576,
                        gated=True, tied=False),
             preset="tpu-v4", hw=dict(topology=(4, 4, 4)), mesh={"dp": 64}, batch=13, schedule="fsdp", remat=True,
             flops="maxtext")),
    Ref("MaxText-52B v4 1x384", "training", "v4", "fsdp", 154, "TFLOP/s/device", MAXTEXT.format(gen="v4"),
        dict(model=dict(vocab=32000, seq=2048, d=12288, heads=32, head_dim=128, layers=32, hidden=49152,
                        gated=True, tied=False),
             preset="tpu-v4", hw=dict(topology=(4, 4, 12)), mesh={"dp": 192}, batch=7, schedule="fsdp",
             remat=True, flops="maxtext")),
    # v5p: v5p-128 = 64 chips (4x4x4); FSDP 16 x TP 4, remat "minimal" (modelled as none)
    *[Ref(f"MaxText-{s}B v5p 1x128", "training", "v5p", "fsdp+tp", tf, "TFLOP/s/device", MAXTEXT.format(gen="v5p"),
          dict(model=dict(vocab=32000, seq=2048, d=d, heads=64, head_dim=128, layers=L, hidden=28672, gated=True,
                          tied=False),
               preset="tpu-v5p", hw=dict(topology=(4, 4, 4)), mesh={"dp": 16, "tp": 4}, batch=pdb,
               schedule="fsdp+tp", remat=False, flops="maxtext"))
      for s, d, L, pdb, tf in [(32, 8192, 32, 6, 328), (64, 8192, 64, 3, 323)]],
    # MaxText Llama2-7B on A3 (8 x H100 per VM): FSDP 8 inside a VM, data parallel over VMs (configs/gpu/a3/
    # llama_2_7b/*vm.sh, per-device batch 4, seq 4096; remat "minimal_with_context" modelled as none)
    *[Ref(f"MaxText-Llama2-7B h100 {k}xA3", "training", "h100", "fsdp" if k == 1 else "fsdp+dcn", tf,
          "TFLOP/s/device", MAXTEXT_A3,
          dict(model=dict(vocab=32000, seq=4096, d=4096, heads=32, layers=32, hidden=11008, gated=True, tied=False),
               preset="h100", hw={**_GPU_NODES(8 * k), **_A3_NIC}, mesh={"dcn": k, "dp": 8} if k > 1 else {"dp": 8},
               batch=4,
               schedule="fsdp" if k == 1 else "dcn+fsdp", remat=False, flops="maxtext"))
      for k, tf in [(1, 492), (2, 422), (4, 407), (8, 409), (16, 375)]],
]

ROWS = COLLECTIVES + KERNELS + TRAINING

# The one split, by family (chip x strategy). Calibration: the families a fit may see. Chosen so each half spans
# GPUs and TPUs, collectives, kernels and training, and every validation family is a chip or a strategy the fit
# has not seen together.
SPLIT = {
    "a100/all_reduce": "cal", "h200/all_reduce": "cal", "h100/all_reduce": "val", "h100/all_gather": "val",
    "h100/all_to_all": "val", "b200/all_reduce": "val",
    "a100/gemm": "cal", "h200/gemm": "cal", "h100/gemm": "val",
    "a100/attention": "cal", "h200/attention": "cal", "h100/attention": "val",
    "a100/attention-fwd+bwd": "val", "h100/attention-fwd+bwd": "val",      # never fitted (HELD_OUT_ONLY)
    "a100/hbm": "cal", "h200/hbm": "cal", "h100/hbm": "val",
    "a100/fsdp": "cal", "h100/fsdp": "val", "h100/zero2": "val", "h100/dp": "cal", "h100/tp": "val",
    "h100/fsdp+tp": "cal", "h100/fsdp+dcn": "val", "h100/tp+pp": "val", "h100/fsdp+async-tp": "val",
    "v5e/fsdp": "cal", "v5e/fsdp+dcn": "val", "v4/fsdp": "val", "v5p/fsdp+tp": "val",
}

# Published cases that measure several configurations of one model on one system: the simulator should order
# them as measured (Kendall's tau). Each is a list of row names.
RANKING = {
    "MaxText-16B v5e, 1-32 slices (DCN data parallel)": [r.name for r in TRAINING if r.name.startswith("MaxText-16B")],
    "MaxText-32B v5e, 1-32 slices (DCN data parallel)": [r.name for r in TRAINING if r.name.startswith("MaxText-32B")],
    "MaxText-64B v5e, 1-32 slices (DCN data parallel)": [r.name for r in TRAINING if r.name.startswith("MaxText-64B")],
    "MaxText Llama2-7B, 1-16 A3 VMs (DCN data parallel)": [r.name for r in TRAINING
                                                           if r.name.startswith("MaxText-Llama2-7B")],
    "MPT-13B H100, 8/64/128 GPUs": [r.name for r in TRAINING if r.name.startswith("MPT-13b h100")],
}


def split_of(ref: Ref) -> str:
    return SPLIT[ref.family]


def check() -> None:
    """The table's own invariants: unique names, every family in exactly one half, both halves non-empty."""
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names)), "duplicate row names"
    fams = {r.family for r in ROWS}
    missing = fams - set(SPLIT)
    assert not missing, f"families without a split: {sorted(missing)}"
    assert {"cal", "val"} == set(SPLIT[f] for f in fams)
    for case, rows in RANKING.items():
        assert len(rows) >= 2 and set(rows) <= set(names), case
