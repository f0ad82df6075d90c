#!/usr/bin/env bash
# Start a real single-machine Slurm, for the Slurm tests and for trying the
# templates in slurm/.
#
#   bash scripts/slurm-up.sh              # then: source /tmp/ferrompi-slurm/env
#   sbatch --wait slurm/single_node.sbatch
#   bash scripts/slurm-down.sh            # stops exactly what slurm-up started
#
# Debian's slurmctld + slurmd (22.05) with munge, run as root without
# systemd or cgroups (ProctrackType=proctrack/linuxproc, TaskPlugin=task/none).
# With FERROMPI_SLURM_DBD=1 (the default) also slurmdbd over a private
# MariaDB, so that `sacct` works; if that part fails to start, Slurm runs
# without it (jobs are then recorded by jobcomp/filetxt only, and
# FERROMPI_SLURM_ACCOUNTING=0 in the env file says so). Missing packages are
# installed with apt-get when possible.
#
# The machine is presented as FERROMPI_SLURM_NODES (default 2) Slurm nodes,
# each a slurmd of its own (`slurmd -N`), all on 127.0.0.1, so that multi-node
# jobs really span several slurmd and several node entries in Slurm's layout.
# Each node offers FERROMPI_SLURM_CPUS CPUs (default: at least 4, so 4-rank
# jobs fit on one node of a small machine; the CPUs are oversubscribed).
#
# Everything lives under FERROMPI_SLURM_DIR (default /tmp/ferrompi-slurm):
# etc/ (slurm.conf, slurmdbd.conf), log/, state/, spool/, munge/, mysql/,
# jobcomp/, the PID list `pids` (one "name pid" a line) that slurm-down.sh
# stops, and `env`, which exports SLURM_CONF for clients.
#
# Exit status: 0 when every node is idle and accepts jobs; 2 when Slurm cannot
# be started here (not root, packages missing and not installable): the reason
# is written to $FERROMPI_SLURM_DIR/unavailable; 1 on any other failure (the
# daemons already started are stopped again, the logs' tails are printed).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${FERROMPI_SLURM_DIR:-/tmp/ferrompi-slurm}
WANT_DBD=${FERROMPI_SLURM_DBD:-1}
NODES=${FERROMPI_SLURM_NODES:-2}
PORT_BASE=${FERROMPI_SLURM_PORT_BASE:-36810} # slurmctld +7, slurmdbd +9, MariaDB +1, nodes +20...
START=$(date +%s.%N)

mkdir -p "$DIR" || { echo "slurm-up: cannot create $DIR" >&2; exit 1; }
rm -f "$DIR/unavailable"

say() { echo "slurm-up: $*" >&2; }
unavailable() {
  echo "$*" >"$DIR/unavailable"
  say "Slurm unavailable here: $*"
  exit 2
}
fail() {
  say "FAILED: $*"
  for f in "$DIR"/log/*.log "$DIR"/log/*.out "$DIR/munge/munged.log" "$DIR/mysql/mysqld.log"; do
    [ -s "$f" ] && { echo "--- tail of $f" >&2; tail -n 15 "$f" >&2; }
  done
  bash "$HERE/slurm-down.sh" >&2
  exit 1
}
# record NAME PID: slurm-down.sh stops the PIDs listed in $DIR/pids, last first
record() { echo "$1 $2" >>"$DIR/pids"; }
# wait_for SECONDS COMMAND...: poll COMMAND every 0.1 s until it succeeds (status 1 if never)
wait_for() {
  local deadline=$(($(date +%s) + $1))
  shift
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if [ -s "$DIR/pids" ]; then
  say "$DIR/pids lists running daemons: already up? Run scripts/slurm-down.sh first."
  exit 1
fi
[ "$(id -u)" = 0 ] || unavailable "scripts/slurm-up.sh must run as root (it starts munged, slurmctld and slurmd as root, without systemd)"

# --- packages
packages=(slurmctld slurmd slurm-client munge)
[ "$WANT_DBD" = 1 ] && packages+=(slurmdbd mariadb-server)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
need=()
for p in "${packages[@]}"; do installed "$p" || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || unavailable "packages ${need[*]} are missing and there is no apt-get"
  say "installing ${need[*]} (log: $DIR/apt.log)"
  t0=$SECONDS
  lock=(-o DPkg::Lock::Timeout=300) # wait for another apt-get rather than fail
  { timeout 600 apt-get "${lock[@]}" update -qq &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get "${lock[@]}" install -y -qq \
        --no-install-recommends "${need[@]}"; } >"$DIR/apt.log" 2>&1 ||
    unavailable "apt-get install ${need[*]} failed (see $DIR/apt.log: $(tail -n 1 "$DIR/apt.log"))"
  say "installed in $((SECONDS - t0)) s"
fi
for exe in /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch; do
  [ -x "$exe" ] || unavailable "$exe is missing after installing ${packages[*]}"
done

CTLD_PORT=$((PORT_BASE + 7))
DBD_PORT=$((PORT_BASE + 9))
DB_PORT=$((PORT_BASE + 1))
for port in "$CTLD_PORT" $(seq $((PORT_BASE + 20)) $((PORT_BASE + 19 + NODES))); do
  port_free "$port" || fail "port $port is in use (another Slurm?); set FERROMPI_SLURM_PORT_BASE"
done

mkdir -p "$DIR"/{etc,log,state,spool,munge,jobcomp} || fail "cannot create folders in $DIR"
: >"$DIR/pids"
HOST=$(hostname -s)
CPUS=${FERROMPI_SLURM_CPUS:-$(nproc)}
[ -z "${FERROMPI_SLURM_CPUS:-}" ] && [ "$CPUS" -lt 4 ] && CPUS=4
MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / NODES - 256))

# --- munge: a key, socket, pid and log of our own
MUNGE="$DIR/munge"
# munged requires its socket folder to be searchable by all (the key itself is mode 400).
{ chown munge:munge "$MUNGE" && chmod 755 "$MUNGE"; } || fail "cannot give $MUNGE to user munge"
if [ ! -s "$MUNGE/munge.key" ]; then
  dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none || fail "no munge key"
fi
chown munge:munge "$MUNGE/munge.key" && chmod 400 "$MUNGE/munge.key"
rm -f "$MUNGE/munged.pid"
timeout 20 runuser -u munge -- /usr/sbin/munged --socket="$MUNGE/munge.socket" \
  --key-file="$MUNGE/munge.key" --pid-file="$MUNGE/munged.pid" \
  --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munged.seed" ||
  fail "munged did not start"
wait_for 10 test -s "$MUNGE/munged.pid" || fail "munged wrote no pid file"
record munged "$(cat "$MUNGE/munged.pid")"

export SLURM_CONF="$DIR/etc/slurm.conf"

# --- accounting: MariaDB + slurmdbd (optional; on failure Slurm runs without)
start_accounting() {
  local db="$DIR/mysql"
  mkdir -p "$db/data" && chown -R mysql:mysql "$db" || return 1
  if ! { port_free "$DB_PORT" && port_free "$DBD_PORT"; }; then
    say "port $DB_PORT or $DBD_PORT is in use"
    return 1
  fi
  cat >"$db/my.cnf" <<EOF
[mysqld]
datadir=$db/data
socket=$db/mysqld.sock
pid-file=$db/mysqld.pid
log-error=$db/mysqld.log
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
innodb_buffer_pool_size=64M
innodb_lock_wait_timeout=900
EOF
  if [ ! -d "$db/data/mysql" ]; then
    timeout 120 mariadb-install-db --defaults-file="$db/my.cnf" --user=mysql \
      --auth-root-authentication-method=normal >"$DIR/log/mariadb-install.log" 2>&1 || {
      say "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"
      return 1
    }
  fi
  setsid /usr/sbin/mariadbd --defaults-file="$db/my.cnf" --user=mysql \
    >>"$DIR/log/mariadbd.out" 2>&1 </dev/null &
  record mariadbd $!
  wait_for 30 timeout 5 mariadb --socket="$db/mysqld.sock" -uroot -e "select 1" || {
    say "MariaDB did not answer within 30 s (see $db/mysqld.log)"
    return 1
  }
  timeout 20 mariadb --socket="$db/mysqld.sock" -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'ferrompi';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || return 1
  # slurmdbd reads slurmdbd.conf from the folder of $SLURM_CONF; it must be mode 600.
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/state/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=ferrompi
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/etc/slurmdbd.conf"
  setsid /usr/sbin/slurmdbd -D >>"$DIR/log/slurmdbd.out" 2>&1 </dev/null &
  record slurmdbd $!
  write_slurm_conf 1
  # The cluster must exist in the database before slurmctld registers.
  local deadline=$(($(date +%s) + 30))
  until timeout 10 sacctmgr -i add cluster ferrompi >>"$DIR/log/sacctmgr.log" 2>&1 ||
    timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx ferrompi; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      say "slurmdbd did not accept the cluster within 30 s (see $DIR/log/slurmdbd.log)"
      return 1
    fi
    sleep 0.2
  done
}

# write_slurm_conf ACCOUNTING(0|1)
write_slurm_conf() {
  local nodes
  nodes=$(for i in $(seq 1 "$NODES"); do printf '%s,' "$HOST-$i"; done)
  nodes=${nodes%,}
  {
    cat <<EOF
# Written by scripts/slurm-up.sh: a test Slurm on one machine ($NODES nodes on 127.0.0.1).
ClusterName=ferrompi
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
AuthType=auth/munge
# cred_expire: how long a job step credential is valid (long enough for a step to
# start on a loaded machine) and how long a requeued job waits before it may start
# again (default 120 s).
AuthInfo=socket=$MUNGE/munge.socket,cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (a requeued job becomes eligible after cred_expire).
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp/jobcomp.txt
MinJobAge=3600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
EOF
    if [ "$1" = 1 ]; then
      cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
# With slurmdbd, the munge socket that authenticates to it.
AccountingStoragePass=$MUNGE/munge.socket
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
EOF
    fi
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=$HOST-$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT_BASE + 19 + i))" \
        "CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$nodes Default=YES MaxTime=INFINITE State=UP"
  } >"$SLURM_CONF"
}

ACCOUNTING=0
if [ "$WANT_DBD" = 1 ]; then
  if start_accounting; then
    ACCOUNTING=1
  else
    say "accounting (MariaDB + slurmdbd) did not start; going on without it (no sacct)"
    bash "$HERE/slurm-down.sh" slurmdbd mariadbd >&2
  fi
fi
write_slurm_conf "$ACCOUNTING"
cat >"$DIR/env" <<EOF
export SLURM_CONF=$SLURM_CONF
export FERROMPI_SLURM_DIR=$DIR
export FERROMPI_SLURM_ACCOUNTING=$ACCOUNTING
export FERROMPI_SLURM_NODES=$NODES
EOF

# --- slurmctld and one slurmd per node
setsid /usr/sbin/slurmctld -D >>"$DIR/log/slurmctld.out" 2>&1 </dev/null &
record slurmctld $!
for i in $(seq 1 "$NODES"); do
  mkdir -p "$DIR/spool/$HOST-$i"
  setsid /usr/sbin/slurmd -D -N "$HOST-$i" >>"$DIR/log/slurmd-$HOST-$i.out" 2>&1 </dev/null &
  record slurmd $!
done

all_idle() {
  local states
  states=$(timeout 5 sinfo -h -N -o %T 2>/dev/null) || return 1
  [ "$(grep -cx idle <<<"$states")" = "$NODES" ]
}
wait_for 60 all_idle ||
  fail "the nodes are not all idle after 60 s: $(timeout 5 sinfo -h -N -o '%N %T' 2>&1 | tr '\n' ' ')"
say "up in $(awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN {printf "%.1f", e - s}') s:" \
  "$NODES node(s) of $CPUS CPUs, accounting $([ "$ACCOUNTING" = 1 ] && echo slurmdbd || echo off);" \
  "clients: source $DIR/env"
