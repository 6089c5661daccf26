#!/usr/bin/env bash
# Run one `meshrun train` job as N processes on this machine, each with K simulated CPU devices:
# the multi-host code path (jax.distributed, gloo collectives, per-process data) on a laptop.
#
#   launch/local.sh N K CONFIG [section.key=value ...] [--fast-compile]
#   launch/local.sh 2 4 configs/tiny_cpu.yaml train.steps=10     # 2 "hosts" x 4 devices = 8
#
# XLA runs at its default flags (plus the device count, and whatever XLA_FLAGS you export);
# `--fast-compile` (passed on to `meshrun train`) compiles faster and runs slower.
#
# The coordinator listens on a free loopback port. Each rank writes RUN_DIR/logs/rank<i>.log
# (RUN_DIR = train.run_dir of the config; LOG_DIR overrides; with MAX_RESTARTS, LOG_DIR/attempt<j>/).
# When any rank fails, the others get PEER_WAIT_S to end by themselves, then SIGTERM (they save a
# checkpoint when they can), then SIGKILL
# after GRACE_S; the exit status is the failed rank's. On success the last stdout line is rank 0's JSON result.
#
# Environment:
#   WALL_LIMIT_S   stop everything after this many seconds (default 3600; exit 124)
#   GRACE_S        seconds between SIGTERM and SIGKILL when stopping (default 20)
#   PEER_WAIT_S    seconds the other ranks get to end by themselves after one failed (default 5)
#   LOG_DIR        where the per-rank logs go (default RUN_DIR/logs)
#   PYTHON         interpreter (default: the checkout's .venv/bin/python, else python3)
#   MESHRUN_HEARTBEAT_S, MESHRUN_INIT_TIMEOUT_S   passed through (see meshrun/runtime/distributed.py)
#   DRY_RUN=1      print each rank's command line instead of running it
#   MAX_RESTARTS=K when a rank dies (or the job exits 3 on a NaN loss), restart the whole job from
#                  its newest intact checkpoint, up to K times (`meshrun supervise`; one line each)
#   ELASTIC=1      with MAX_RESTARTS: a rank that dies before training gets going -> restart on one
#                  process fewer (mesh.data shrinks, train.global_batch stays); MIN_PROCESSES (default 1)
set -euo pipefail

usage() { echo "usage: $0 N K CONFIG [section.key=value ...]" >&2; exit 2; }
[ $# -ge 3 ] || usage
N=$1 K=$2 CONFIG=$3
shift 3
case "$N$K" in *[!0-9]*) usage ;; esac
[ "$N" -ge 1 ] && [ "$K" -ge 1 ] || usage
[ -f "$CONFIG" ] || { echo "$0: no such config: $CONFIG" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
WALL_LIMIT_S=${WALL_LIMIT_S:-3600}
GRACE_S=${GRACE_S:-20}
PEER_WAIT_S=${PEER_WAIT_S:-5}

# train.run_dir after the overrides (the config loader is the only YAML reader we trust).
RUN_DIR=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c '
import sys
from meshrun.config import load_config
from meshrun.errors import ConfigError
try:
    print(load_config(sys.argv[1], [a for a in sys.argv[2:] if not a.startswith("--")]).train.run_dir)
except ConfigError as e:  # one line, as the CLI says it, not a traceback
    sys.exit(f"launch/local.sh: error: {e}")' "$CONFIG" "$@") || exit 2
LOG_DIR=${LOG_DIR:-$RUN_DIR/logs}${MESHRUN_ATTEMPT:+/attempt$MESHRUN_ATTEMPT}  # set by the supervisor
if [ "${MAX_RESTARTS:-0}" != 0 ] && [ "${DRY_RUN:-0}" != 1 ]; then
  # The supervisor runs this script once per attempt (MAX_RESTARTS=0 there), {processes} = N or fewer.
  ELASTIC_FLAG=(); [ "${ELASTIC:-0}" = 1 ] && ELASTIC_FLAG=(--elastic)
  exec env MAX_RESTARTS=0 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m meshrun.cli supervise \
    --max-restarts "$MAX_RESTARTS" --processes "$N" ${ELASTIC_FLAG[@]+"${ELASTIC_FLAG[@]}"} \
    --min-processes "${MIN_PROCESSES:-1}" --launcher "$(printf '%q ' bash "$ROOT/launch/local.sh") {processes} $K" \
    "$CONFIG" "$@"
fi
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
XLA_FLAGS="$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g') --xla_force_host_platform_device_count=$K"

rank_env() {  # the environment of rank $1, as shown by DRY_RUN (the launch loop below sets the same)
  echo "JAX_PLATFORMS=cpu XLA_FLAGS=\"${XLA_FLAGS# }\" MESHRUN_COORDINATOR=127.0.0.1:$PORT" \
    "JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$PORT MESHRUN_NUM_PROCESSES=$N MESHRUN_PROCESS_ID=$1" \
    "MESHRUN_LOCAL_DEVICES=$K PYTHONUNBUFFERED=1"
}
QUIET_FLAG=(); [ "${QUIET:-0}" = 1 ] && QUIET_FLAG=(--quiet)  # QUIET=1: no progress in the logs or here
CMD=("$PYTHON" -m meshrun.cli train ${QUIET_FLAG[@]+"${QUIET_FLAG[@]}"} "$CONFIG" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  for ((i = 0; i < N; i++)); do echo "$(rank_env "$i") ${CMD[*]} > $LOG_DIR/rank$i.log 2>&1"; done
  exit 0
fi

mkdir -p "$LOG_DIR"
echo "local.sh: $N processes x $K CPU devices, coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2

PIDS=()
stop_all() {  # SIGTERM the ranks still running, SIGKILL what is left after GRACE_S
  local pid t=0
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  while [ $t -lt $((GRACE_S * 10)) ]; do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1; t=$((t + 1))
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap 'echo "local.sh: interrupted; stopping all ranks" >&2; stop_all; exit 130' INT TERM HUP

for ((i = 0; i < N; i++)); do
  (
    export JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS# }" PYTHONUNBUFFERED=1
    export MESHRUN_COORDINATOR=127.0.0.1:$PORT JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:$PORT
    export MESHRUN_NUM_PROCESSES=$N MESHRUN_PROCESS_ID=$i MESHRUN_LOCAL_DEVICES=$K
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    exec "${CMD[@]}"
  ) >"$LOG_DIR/rank$i.log" 2>&1 &
  PIDS+=($!)
done

describe_status() {  # "status S" or "signal NAME" for an exit status
  if [ "$1" -gt 128 ]; then echo "signal $(kill -l $(($1 - 128)) 2>/dev/null || echo $(($1 - 128)))"; else echo "status $1"; fi
}

SHOWN=0  # lines of rank0.log already echoed: rank 0's start-up block and progress go to the console
show_rank0() {
  local n
  [ -f "$LOG_DIR/rank0.log" ] || return 0
  n=$(wc -l <"$LOG_DIR/rank0.log")
  [ "$n" -gt "$SHOWN" ] || return 0
  sed -n "$((SHOWN + 1)),${n}p" "$LOG_DIR/rank0.log" | grep -v -e '^{' -e '^ *@ ' -e '^\[Gloo\] ' >&2 || true
  SHOWN=$n
}

START=$SECONDS
DONE=()  # DONE[i]=1 once rank i exited 0 (indexed arrays: bash 3 on macOS has no -A)
FINISHED=0
while [ "$FINISHED" -lt "$N" ]; do
  BAD=() BAD_RC=()
  for ((i = 0; i < N; i++)); do
    [ -n "${DONE[$i]:-}" ] && continue
    pid=${PIDS[$i]}
    kill -0 "$pid" 2>/dev/null && continue
    rc=0; wait "$pid" 2>/dev/null || rc=$?  # 2>/dev/null: no bash "Killed (subshell ...)" job-status line
    DONE[$i]=1; FINISHED=$((FINISHED + 1))
    if [ "$rc" != 0 ]; then BAD+=("$i"); BAD_RC+=("$rc"); fi
  done
  if [ ${#BAD[@]} -gt 0 ]; then
    # Several ranks may end within one poll: a survivor exits 6 ("lost contact") right after its
    # peer died, so the rank to blame is one that did not exit 6, where there is one.
    j=0
    for ((b = 0; b < ${#BAD[@]}; b++)); do [ "${BAD_RC[$b]}" != 6 ] && { j=$b; break; }; done
    i=${BAD[$j]} rc=${BAD_RC[$j]}
    echo "local.sh: rank $i (pid ${PIDS[$i]}) failed with $(describe_status "$rc"); stopping the other ranks" >&2
    echo "local.sh: --- last lines of $LOG_DIR/rank$i.log ---" >&2
    grep -v '^ *@ ' "$LOG_DIR/rank$i.log" | tail -n 5 >&2 || true
    # first give the others PEER_WAIT_S to notice the dead peer and end with their own line (exit 6);
    # a SIGTERM right away would cut that line off
    t=0
    while [ $t -lt $((PEER_WAIT_S * 10)) ]; do
      alive=0
      for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ $alive = 0 ] && break
      sleep 0.1; t=$((t + 1))
    done
    stop_all
    exit "$rc"
  fi
  if [ $((SECONDS - START)) -ge "$WALL_LIMIT_S" ]; then
    echo "local.sh: wall-clock limit WALL_LIMIT_S=$WALL_LIMIT_S s reached; stopping all ranks" >&2
    stop_all
    exit 124
  fi
  show_rank0
  sleep 0.2
done
show_rank0
grep '^{' "$LOG_DIR/rank0.log" | tail -n 1 || true
