# XLA / NCCL / allocator settings for meshrun on NVIDIA GPU nodes (A100/H100/H200, 8 GPUs each).
# Source it before `meshrun train`:   source launch/gpu_env.sh
# It appends to XLA_FLAGS and sets a variable only when it is not set already, so a value you
# export first wins. Flag names are checked against the installed jaxlib by tests/test_distributed.py
# (XLA aborts on an unknown flag in XLA_FLAGS: flags are renamed/removed between releases), and
# bench/gpu.py records the overlap and bucket flags it ran with (`comm_flags` in its JSON line).
# Starting points from the JAX GPU performance guide and NVIDIA's JAX-Toolbox; measure before
# keeping one (the step time in metrics.jsonl).

_meshrun_xla_flags=(
  # --- Overlap: communication runs while compute does -------------------------------------------
  # Schedule async collectives to overlap with independent compute (TP all-reduces with the next
  # matmul, PP send/recv with the stage's work, DP reduction buckets with each other, with the
  # optimizer update of buckets already reduced and, ZeRO-1/3, with the parameter all-gathers);
  # the single biggest win for multi-GPU steps. meshrun reduces DP gradients ONCE per step, after
  # the accumulation loop (never per microbatch): the reduction waits for the last microbatch's
  # backward to finish, so what hides it is the other buckets' work, not that backward.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # Collectives inside while loops (the layer scan, the pipeline's tick phases): start iteration
  # i+1's all-gather / reduce-scatter / all-reduce during iteration i (ZeRO-3 weight prefetch,
  # TP all-reduces of scanned layers) instead of at the top of the iteration.
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # Unroll the layer/tick while-loops by two so the collectives of iteration i+1 overlap the
  # compute of iteration i (pipeline ticks, scanned layers).
  --xla_gpu_enable_while_loop_double_buffering=true
  # Give collectives the highest-priority CUDA stream so they are not starved by compute kernels.
  --xla_gpu_enable_highest_priority_async_stream=true
  # --- Bucket fusion: fewer, larger collectives ---------------------------------------------------
  # XLA combines independent collectives of one kind into one tuple collective up to this many
  # bytes (the "buckets"; `meshrun explain` lists the step's data-parallel ones and their sizes).
  # Why 128 MiB: NCCL needs messages of tens of MiB to reach the NICs' line rate, and each NCCL
  # launch costs ~10 us, so a step's thousands of per-leaf gradients should travel as a few large
  # buckets; since meshrun's gradients are all ready at the same moment (after the loop) a bigger
  # bucket delays nothing. Lower it (e.g. 32 MiB) only if XLA's peak memory grows from the
  # combined buffers; raise the all-gather one with ZeRO-3 on very large layers.
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  # Combine all-gathers/reduce-scatters over different dimensions too (ZeRO shards weights on
  # different dimensions), so they fill the same buckets.
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  # --- Kernels -----------------------------------------------------------------------------------
  # cuBLAS/cuBLASLt beats the Triton GEMM emitter for the large bf16 matmuls of LLM layers.
  --xla_gpu_enable_triton_gemm=false
)
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }${_meshrun_xla_flags[*]}"
unset _meshrun_xla_flags

# The JAX allocator takes 75% of GPU memory at start-up by default; training wants more. Lower it
# if another process (a data loader using CUDA, a profiler) shares the GPU.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
# Preallocate (the default): fragmentation-free, and out-of-memory shows up at the first step.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-true}

# NCCL over InfiniBand (HDR 200 Gb/s on A100 nodes, NDR 400 Gb/s on H100/H200 nodes).
# WARN prints only problems; INFO once per new cluster shows which transport (NET/IB vs Socket)
# and which NICs NCCL chose: "NET/IB : Using [0]mlx5_0:1/IB ..." is what you want to see.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# GPUDirect RDMA: NIC reads/writes GPU memory directly when they share a PCIe switch or host
# bridge (PHB); skips a bounce through host memory.
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
# Keep each ring/tree on the NIC closest to its GPU (rail-optimised fabrics: GPU i <-> NIC i).
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}
# Site specific (uncomment and fill in from `ibv_devinfo` / `ip -br link`):
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7   # the IB NICs
# export NCCL_SOCKET_IFNAME=eth0      # the interface for NCCL's bootstrap / socket fallback
# export NCCL_IB_GID_INDEX=3          # RoCE (Ethernet) fabrics only: the RoCE v2 GID
# NVLink SHARP (H100/H200 NVSwitch) speeds in-node all-reduce; it is on by default (NCCL >= 2.17)
# and costs GPU memory; set 0 to turn it off when memory is tight.
# export NCCL_NVLS_ENABLE=0

# Less C++ log noise from XLA/TSL (errors still print).
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
