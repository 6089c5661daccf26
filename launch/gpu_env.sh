# XLA / NCCL / allocator settings for meshrun on NVIDIA GPU nodes (A100/H100/H200, 8 GPUs each).
# Source it before `meshrun train`:   source launch/gpu_env.sh
# It appends to XLA_FLAGS and sets a variable only when it is not set already, so a value you
# export first wins. Flag names are checked against the installed jaxlib by tests/test_distributed.py
# (XLA aborts on an unknown flag in XLA_FLAGS: flags are renamed/removed between releases).
# Starting points from the JAX GPU performance guide and NVIDIA's JAX-Toolbox; measure before
# keeping one (the step time in metrics.jsonl).

_meshrun_xla_flags=(
  # Schedule async collectives to overlap with compute (TP all-reduce, DP reduce-scatter, PP
  # send/recv); the single biggest win for multi-GPU steps.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # cuBLAS/cuBLASLt beats the Triton GEMM emitter for the large bf16 matmuls of LLM layers.
  --xla_gpu_enable_triton_gemm=false
  # Combine small collectives into large ones (fewer NCCL launches; bigger messages reach line
  # rate on IB). 128 MiB for the DP gradient reduction / ZeRO all-gather; raise with ZeRO-3.
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  # ZeRO-3/FSDP: prefetch the next layer's weight all-gather and overlap the gradient
  # reduce-scatter with the previous layer's backward (inside the layer scan).
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # Unroll the layer/tick while-loops by two so the collectives of iteration i+1 overlap the
  # compute of iteration i (pipeline ticks, scanned layers).
  --xla_gpu_enable_while_loop_double_buffering=true
  # Keep all-gathers/reduce-scatters of different dimensions combinable into one op.
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  # Give collectives the highest-priority CUDA stream so they are not starved by compute kernels.
  --xla_gpu_enable_highest_priority_async_stream=true
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
