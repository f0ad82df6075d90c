#!/usr/bin/env bash
# Stop the Slurm started by scripts/slurm-up.sh.
#
#   bash scripts/slurm-down.sh [--purge] [NAME ...]
#
# Stops exactly the PIDs that slurm-up.sh recorded in
# $FERROMPI_SLURM_DIR/pids (default /tmp/ferrompi-slurm), last started first
# (the slurmd, slurmctld, slurmdbd, MariaDB, munged): SIGTERM, then SIGKILL
# after 10 s. A PID is signalled only while it still runs the program that
# was recorded (so a recycled PID is left alone). Jobs still running are
# cancelled first. With NAMEs (e.g. `slurmdbd mariadbd`), stops only those
# and keeps the others listed. Configuration, logs and state stay in the
# folder for inspection; --purge then removes the folder.
set -u
DIR=${FERROMPI_SLURM_DIR:-/tmp/ferrompi-slurm}
PIDS="$DIR/pids"
PURGE=0
if [ "${1:-}" = --purge ]; then
  PURGE=1
  shift
fi
ONLY=" $* "

if [ ! -f "$PIDS" ]; then
  echo "slurm-down: nothing recorded in $PIDS"
  [ "$PURGE" = 1 ] && rm -rf "$DIR"
  exit 0
fi
if [ "$ONLY" = "  " ] && [ -f "$DIR/etc/slurm.conf" ] && grep -q "^slurmctld " "$PIDS"; then
  SLURM_CONF="$DIR/etc/slurm.conf" timeout 10 scancel --full --user="$(id -un)" 2>/dev/null
fi

# is_ours PID NAME: the PID is alive and still runs the program recorded
is_ours() {
  local comm
  comm=$(cat "/proc/$1/comm" 2>/dev/null) || return 1
  [ "$comm" = "${2:0:15}" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}
stop() { # stop NAME PID
  if ! is_ours "$2" "$1"; then
    echo "slurm-down: $1 ($2) was not running"
    return
  fi
  kill -TERM "$2" 2>/dev/null
  for _ in $(seq 100); do
    is_ours "$2" "$1" || break
    sleep 0.1
  done
  if is_ours "$2" "$1"; then
    echo "slurm-down: $1 ($2) ignored SIGTERM for 10 s: SIGKILL"
    kill -KILL "$2" 2>/dev/null
  fi
  echo "slurm-down: $1 ($2) stopped"
}

keep=()
while read -r name pid; do
  [ -n "${pid:-}" ] || continue
  if [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]]; then
    stop "$name" "$pid"
  else
    keep+=("$name $pid")
  fi
done < <(tac "$PIDS")

if [ ${#keep[@]} -gt 0 ]; then
  printf '%s\n' "${keep[@]}" | tac >"$PIDS"
else
  rm -f "$PIDS"
  [ "$PURGE" = 1 ] && rm -rf "$DIR"
fi
exit 0
