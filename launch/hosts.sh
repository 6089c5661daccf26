#!/usr/bin/env bash
# meshrun on a list of ssh-reachable hosts: one process per host (all its GPUs), the first host
# is the coordinator (process 0).
#
#   launch/hosts.sh HOSTFILE CONFIG [section.key=value ...]
#   DRY_RUN=1 launch/hosts.sh hosts.txt configs/llama7b_h100.yaml     # print the ssh commands
#
# HOSTFILE: one host per line (`user@host` works; text after the host, e.g. `slots=8`, and lines
# starting with # are ignored). Every host needs the same checkout at REMOTE_DIR (a shared file
# system, or the same path everywhere) with its .venv, and passwordless ssh from here.
# Per-host logs: LOG_DIR/host<i>.log, each with its process's progress; host 0's start-up block and
# progress also go to this console (stderr), and its JSON result is the last stdout line.
# When one host fails, the others are stopped (their remote pid is in the first log line) and the
# exit status is the failed host's.
#
# Environment:
#   PORT           coordinator port on the first host (default 61234)
#   COORDINATOR    address the others use to reach the first host (default: its name in HOSTFILE
#                  without user@); use the IP of the fast network if names resolve elsewhere
#   REMOTE_DIR     checkout on the hosts (default: this checkout's path)
#   PYTHON         interpreter on the hosts (default: REMOTE_DIR/.venv/bin/python)
#   GPU_ENV=0      do not source launch/gpu_env.sh on the hosts (default 1)
#   SSH            ssh command (default: ssh -o BatchMode=yes -o ConnectTimeout=20)
#   LOG_DIR        default logs/hosts-<date>
#   WALL_LIMIT_S   stop everything after this many seconds (default 86400; exit 124)
#   GRACE_S        seconds between SIGTERM and SIGKILL when stopping (default 30)
#   MESHRUN_HEARTBEAT_S, MESHRUN_INIT_TIMEOUT_S   passed to every host when set
#   QUIET=1        run with --quiet: no progress in the logs or here (warnings, errors and the JSON stay)
#   DRY_RUN=1      print the commands instead of running them
set -euo pipefail

usage() { echo "usage: $0 HOSTFILE CONFIG [section.key=value ...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
HOSTFILE=$1 CONFIG=$2
shift 2
[ -f "$HOSTFILE" ] || { echo "$0: no such hostfile: $HOSTFILE" >&2; exit 2; }

HOSTS=()
while read -r host _rest; do
  case "$host" in "" | \#*) continue ;; esac
  HOSTS+=("$host")
done <"$HOSTFILE"
N=${#HOSTS[@]}
[ "$N" -ge 1 ] || { echo "$0: no hosts in $HOSTFILE" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REMOTE_DIR=${REMOTE_DIR:-$ROOT}
PYTHON=${PYTHON:-$REMOTE_DIR/.venv/bin/python}
PORT=${PORT:-61234}
COORDINATOR=${COORDINATOR:-${HOSTS[0]#*@}}
GPU_ENV=${GPU_ENV:-1}
SSH=${SSH:-ssh -o BatchMode=yes -o ConnectTimeout=20}
LOG_DIR=${LOG_DIR:-logs/hosts-$(date +%Y%m%d-%H%M%S)}
WALL_LIMIT_S=${WALL_LIMIT_S:-86400}
GRACE_S=${GRACE_S:-30}

remote_cmd() {  # the shell command run on host $1 (process id $1); $2... = train arguments
  local env="MESHRUN_COORDINATOR=$COORDINATOR:$PORT MESHRUN_NUM_PROCESSES=$N MESHRUN_PROCESS_ID=$1 PYTHONUNBUFFERED=1"
  shift
  local v
  for v in MESHRUN_HEARTBEAT_S MESHRUN_INIT_TIMEOUT_S; do
    if [ -n "${!v:-}" ]; then env+=" $v=${!v}"; fi
  done
  local cmd="cd $(printf %q "$REMOTE_DIR") && "
  [ "$GPU_ENV" = 1 ] && cmd+="source launch/gpu_env.sh && "
  # `echo REMOTE_PID` first, then exec: the pid stays the training process, so stop_host can signal it.
  local train=(train); [ "${QUIET:-0}" = 1 ] && train+=(--quiet)
  cmd+="echo REMOTE_PID=\$\$ && exec env $env $(printf '%q ' "$PYTHON" -m meshrun.cli "${train[@]}" "$CONFIG" "$@")"
  printf '%s' "$cmd"
}

if [ "${DRY_RUN:-0}" = 1 ]; then
  for ((i = 0; i < N; i++)); do
    echo "$SSH ${HOSTS[$i]} bash -c '$(remote_cmd "$i" "$@")' > $LOG_DIR/host$i.log 2>&1"
  done
  exit 0
fi

mkdir -p "$LOG_DIR"
echo "hosts.sh: $N host(s), coordinator $COORDINATOR:$PORT, logs in $LOG_DIR" >&2
PIDS=()
for ((i = 0; i < N; i++)); do
  # </dev/null: ssh must not read this script's stdin; bash -c: the remote login shell may not be bash.
  $SSH "${HOSTS[$i]}" "bash -c $(printf %q "$(remote_cmd "$i" "$@")")" </dev/null >"$LOG_DIR/host$i.log" 2>&1 &
  PIDS+=($!)
done

stop_host() {  # $1 = index, $2 = signal: signal the remote training process, then the local ssh
  local rpid
  rpid=$(sed -n 's/^REMOTE_PID=\([0-9]*\)$/\1/p' "$LOG_DIR/host$1.log" | head -n 1)
  if [ -n "$rpid" ]; then $SSH "${HOSTS[$1]}" "kill -$2 $rpid" </dev/null >/dev/null 2>&1 || true; fi
  kill "-$2" "${PIDS[$1]}" 2>/dev/null || true
}
stop_all() {
  local i t=0 alive
  for ((i = 0; i < N; i++)); do stop_host "$i" TERM; done
  while [ $t -lt "$GRACE_S" ]; do
    alive=0
    for ((i = 0; i < N; i++)); do kill -0 "${PIDS[$i]}" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1; t=$((t + 1))
  done
  for ((i = 0; i < N; i++)); do stop_host "$i" KILL; done
  for ((i = 0; i < N; i++)); do wait "${PIDS[$i]}" 2>/dev/null || true; done
}
trap 'echo "hosts.sh: interrupted; stopping all hosts" >&2; stop_all; exit 130' INT TERM HUP

SHOWN=0  # lines of host0.log already echoed: host 0's start-up block and progress go to the console
show_host0() {
  local n
  [ -f "$LOG_DIR/host0.log" ] || return 0
  n=$(wc -l <"$LOG_DIR/host0.log")
  [ "$n" -gt "$SHOWN" ] || return 0
  sed -n "$((SHOWN + 1)),${n}p" "$LOG_DIR/host0.log" | grep -v -e '^{' -e '^ *@ ' -e '^\[Gloo\] ' -e '^REMOTE_PID=' >&2 || true
  SHOWN=$n
}

START=$SECONDS
DONE=()
FINISHED=0
while [ "$FINISHED" -lt "$N" ]; do
  for ((i = 0; i < N; i++)); do
    [ -n "${DONE[$i]:-}" ] && continue
    kill -0 "${PIDS[$i]}" 2>/dev/null && continue
    rc=0; wait "${PIDS[$i]}" 2>/dev/null || rc=$?  # 2>/dev/null: no bash job-status line
    DONE[$i]=1; FINISHED=$((FINISHED + 1))
    if [ "$rc" != 0 ]; then
      show_host0
      echo "hosts.sh: host $i (${HOSTS[$i]}) failed with status $rc; stopping the others" >&2
      grep -v -e '^ *@ ' -e '^REMOTE_PID=' "$LOG_DIR/host$i.log" | tail -n 5 >&2 || true
      stop_all
      exit "$rc"
    fi
  done
  if [ $((SECONDS - START)) -ge "$WALL_LIMIT_S" ]; then
    echo "hosts.sh: wall-clock limit WALL_LIMIT_S=$WALL_LIMIT_S s reached; stopping all hosts" >&2
    stop_all
    exit 124
  fi
  show_host0
  sleep 1
done
show_host0
grep '^{' "$LOG_DIR/host0.log" | tail -n 1 || true
