#!/usr/bin/env bash
# A real Slurm cluster on this one machine, to try the launcher (launch/ --executor slurm_local) and to test it.
#   bash tools/env/slurm_cluster.sh start|stop|status|env|install
# start: installs the Debian packages if missing (as root: slurmctld slurmd slurm-client munge slurmdbd
#   mariadb-server), writes the config under $MEGATRON_RLVR_SLURM_DIR (default /tmp/megatron-rlvr-slurm), and runs
#   munged, MariaDB, slurmdbd (accounting, so `sacct` and nemo-run's status work), slurmctld and NODES slurmd
#   "nodes" n1..nN on 127.0.0.1. Idempotent: with everything up and the config unchanged it does nothing.
# stop: cancels the cluster's jobs, then ends the processes it started, by their pid files; nothing is left.
# status: each daemon and its pid, and `sinfo`. env: the line to eval to use the cluster (`export SLURM_CONF=...`).
# install: the packages alone, where missing (the test command runs it beside the Python stack's install).
# Everything (config, spool, logs, munge socket, database) lives in the state directory; ports are chosen free once
# and kept there, so several clusters (or other work on the machine) do not collide.
set -euo pipefail
DIR=${MEGATRON_RLVR_SLURM_DIR:-/tmp/megatron-rlvr-slurm}
NODES=${MEGATRON_RLVR_SLURM_NODES:-2}
CPUS=${MEGATRON_RLVR_SLURM_CPUS:-2}   # CPUs each node announces (the nodes share this machine's cores)
CLUSTER=mrlvr
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
CONF=$DIR/etc/slurm.conf

say() { echo "[slurm_cluster] $*"; }
die() { echo "[slurm_cluster] error: $*" >&2; exit 1; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
daemons() {  # name pidfile, in start order
  echo "munged $DIR/run/munged.pid"
  echo "mariadbd $DIR/run/mariadbd.pid"
  echo "slurmdbd $DIR/run/slurmdbd.pid"
  echo "slurmctld $DIR/run/slurmctld.pid"
  local i; for i in $(seq 1 "$NODES"); do echo "slurmd-n$i $DIR/run/slurmd-n$i.pid"; done
}

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "packages ${missing[*]} are missing and installing them needs root"
  command -v apt-get > /dev/null || die "packages ${missing[*]} are missing and there is no apt-get"
  say "installing ${missing[*]}"
  # the packages' own services must not start: this script runs its daemons itself, under $DIR
  local policy=/usr/sbin/policy-rc.d created=0
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; created=1; fi
  # an `apt-get update` only when the package lists are missing (a fresh container); it is the slow part
  ls /var/lib/apt/lists/*_Packages > /dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get update -q > "$DIR/log/apt.log" 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >> "$DIR/log/apt.log" 2>&1 \
    || { [ $created -eq 1 ] && rm -f $policy; tail -20 "$DIR/log/apt.log"; die "apt-get install failed (log: $DIR/log/apt.log)"; }
  [ $created -eq 1 ] && rm -f $policy
  return 0
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
choose_ports() {  # five consecutive free ports below the ephemeral range, chosen once and kept
  [ -f "$DIR/ports" ] && return 0
  local base p ok
  for base in $(seq 16800 10 19990); do
    ok=1; for p in $(seq "$base" $((base + 4 + NODES))); do port_free "$p" || { ok=0; break; }; done
    [ $ok -eq 1 ] && { echo "$base" > "$DIR/ports"; return 0; }
  done
  die "no free port range between 16800 and 20000"
}

cgroup_proctrack() {  # proctrack/cgroup ends every process of a job (torchrun workers run in their own sessions)
  local test_dir=/sys/fs/cgroup/freezer/megatron-rlvr-probe-$$
  if [ -d /sys/fs/cgroup/freezer ] && mkdir "$test_dir" 2>/dev/null; then rmdir "$test_dir"; echo cgroup/v1; return; fi
  if [ -f /sys/fs/cgroup/cgroup.controllers ] && [ -w /sys/fs/cgroup/cgroup.subtree_control ]; then echo cgroup/v2; return; fi
  echo none
}

write_config() {
  local base db_port dbd_port ctl_port host cg proctrack i
  base=$(cat "$DIR/ports"); ctl_port=$base; dbd_port=$((base + 1)); db_port=$((base + 2))
  host=$(hostname -s)
  cg=$(cgroup_proctrack)
  if [ "$cg" = none ]; then
    proctrack=proctrack/linuxproc
  else
    proctrack=proctrack/cgroup
  fi
  mkdir -p "$DIR/etc.new"
  {
    echo "# written by tools/env/slurm_cluster.sh; state under $DIR"
    echo "ClusterName=$CLUSTER"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=$ctl_port"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    # cred_expire: a requeued job may start again only after its credential expired (default 120 s)
    echo "AuthInfo=socket=$DIR/run/munge.socket,cred_expire=10"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    echo "ProctrackType=$proctrack"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SchedulerType=sched/backfill"
    echo "SchedulerParameters=sched_interval=2,bf_interval=2"
    echo "ReturnToService=2"
    echo "SlurmdParameters=config_overrides"
    echo "KillWait=10"
    echo "MinJobAge=600"
    echo "InactiveLimit=0"
    echo "MessageTimeout=20"
    echo "JobRequeue=1"
    echo "MpiDefault=none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=127.0.0.1"
    echo "AccountingStoragePort=$dbd_port"
    # the clients' connection to slurmdbd does not read AuthInfo's socket: for slurmdbd this names the munge socket
    echo "AccountingStoragePass=$DIR/run/munge.socket"
    echo "JobCompType=jobcomp/none"
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 4 + i)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
  } > "$DIR/etc.new/slurm.conf"
  if [ "$cg" != none ]; then
    printf 'CgroupPlugin=%s\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' \
      "$cg" > "$DIR/etc.new/cgroup.conf"
  fi
  {
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$DIR/run/munge.socket"
    echo "DbdHost=localhost"
    echo "DbdAddr=127.0.0.1"
    echo "DbdPort=$dbd_port"
    echo "SlurmUser=root"
    echo "PidFile=$DIR/run/slurmdbd.pid"
    echo "LogFile=$DIR/log/slurmdbd.log"
    echo "StorageType=accounting_storage/mysql"
    echo "StorageHost=127.0.0.1"
    echo "StoragePort=$db_port"
    echo "StorageUser=slurm"
    echo "StoragePass=slurm-local"
    echo "StorageLoc=slurm_acct_db"
  } > "$DIR/etc.new/slurmdbd.conf"
  chmod 600 "$DIR/etc.new/slurmdbd.conf"
  printf '[mysqld]\ndatadir=%s\nsocket=%s\nport=%s\nbind-address=127.0.0.1\npid-file=%s\nlog-error=%s\nuser=root\nskip-name-resolve\ninnodb_buffer_pool_size=32M\ninnodb_log_file_size=8M\nperformance_schema=OFF\n' \
    "$DIR/db" "$DIR/run/mariadb.socket" "$db_port" "$DIR/run/mariadbd.pid" "$DIR/log/mariadb.log" > "$DIR/etc.new/my.cnf"
  echo "$proctrack" > "$DIR/etc.new/proctrack"
}

config_unchanged() { [ -d "$DIR/etc" ] && diff -r -q "$DIR/etc" "$DIR/etc.new" > /dev/null 2>&1; }

wait_for() {  # seconds description command...
  local limit=$1 what=$2; shift 2
  local t0=$SECONDS
  until "$@" > /dev/null 2>&1; do
    [ $((SECONDS - t0)) -ge "$limit" ] && die "$what did not come up within ${limit}s (logs: $DIR/log)"
    sleep 0.5
  done
}

mysql_cmd() { mariadb --no-defaults -S "$DIR/run/mariadb.socket" -uroot "$@"; }

start_daemon() {
  local name=$1 pidfile=$2
  pid_alive "$pidfile" && return 0
  case $name in
    munged)
      [ -f "$DIR/state/munge.key" ] || { dd if=/dev/urandom bs=1 count=1024 of="$DIR/state/munge.key" 2>/dev/null; chmod 400 "$DIR/state/munge.key"; }
      munged --key-file="$DIR/state/munge.key" --socket="$DIR/run/munge.socket" --pid-file="$pidfile" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/state/munge.seed" --force
      wait_for 20 munged munge -n -S "$DIR/run/munge.socket" ;;
    mariadbd)
      if [ ! -d "$DIR/db/mysql" ]; then
        mariadb-install-db --defaults-file="$DIR/etc/my.cnf" --auth-root-authentication-method=normal \
          --skip-test-db > "$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed ($DIR/log/mariadb-install.log)"
      fi
      setsid mariadbd --defaults-file="$DIR/etc/my.cnf" < /dev/null > /dev/null 2>&1 &
      wait_for 60 MariaDB mysql_cmd -e "SELECT 1"
      mysql_cmd -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm-local';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;" ;;
    slurmdbd)
      SLURM_CONF=$CONF slurmdbd
      wait_for 60 slurmdbd env SLURM_CONF="$CONF" sacctmgr -n list cluster ;;
    slurmctld)
      SLURM_CONF=$CONF slurmctld
      wait_for 60 slurmctld env SLURM_CONF="$CONF" scontrol ping ;;
    slurmd-*)
      SLURM_CONF=$CONF slurmd -N "${name#slurmd-}" ;;
  esac
}

start() {
  mkdir -p "$DIR"/{etc,run,log,state,spool,db}
  install_packages
  choose_ports
  write_config
  local name pidfile all_up=1
  while read -r name pidfile; do pid_alive "$pidfile" || all_up=0; done < <(daemons)
  if config_unchanged && [ $all_up -eq 1 ]; then
    rm -rf "$DIR/etc.new"; say "already up, config unchanged: nothing to do"; status; return 0
  fi
  if ! config_unchanged; then
    # a new config: the running daemons (if any) read the old one
    stop_daemons
    rm -rf "$DIR/etc"; mv "$DIR/etc.new" "$DIR/etc"
  else
    rm -rf "$DIR/etc.new"
  fi
  [ "$(cat "$DIR/etc/proctrack")" = proctrack/cgroup ] \
    || say "warning: the cgroup filesystem is not writable here: proctrack/linuxproc (a job's torchrun workers may outlive it)"
  while read -r name pidfile; do start_daemon "$name" "$pidfile"; done < <(daemons)
  # the cluster registers itself in the accounting database when slurmctld first connects; wait for the nodes
  local i
  for i in $(seq 1 "$NODES"); do
    wait_for 90 "node n$i" bash -c "SLURM_CONF=$CONF sinfo -h -n n$i -o %t | grep -qE '^(idle|mix|alloc)'"
  done
  say "up: $NODES nodes ($(cat "$DIR/etc/proctrack")); use it with: export SLURM_CONF=$CONF"
  status
}

stop_daemons() {
  local name pidfile pids=()
  if pid_alive "$DIR/run/slurmctld.pid"; then
    SLURM_CONF=$CONF scancel --full --signal=KILL --state=RUNNING "--user=$(id -un)" 2>/dev/null || true
    SLURM_CONF=$CONF scancel "--user=$(id -un)" 2>/dev/null || true
    local t0=$SECONDS
    while [ -n "$(SLURM_CONF=$CONF squeue -h -t R,CG 2>/dev/null)" ] && [ $((SECONDS - t0)) -lt 30 ]; do sleep 0.5; done
  fi
  # reverse start order: nodes first, the database last
  while read -r name pidfile; do
    if pid_alive "$pidfile"; then
      local pid; pid=$(cat "$pidfile")
      kill "$pid" 2>/dev/null || true
      pids+=("$pid:$pidfile:$name")
    fi
  done < <(daemons | tac)
  local entry pid t0
  for entry in "${pids[@]+"${pids[@]}"}"; do
    pid=${entry%%:*}; t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt 20 ]; do sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { say "${entry##*:} (pid $pid) ignored SIGTERM: SIGKILL"; kill -9 "$pid" 2>/dev/null || true; }
    entry=${entry#*:}; rm -f "${entry%:*}"
  done
  # a job step's slurmstepd ends with its job; any left (a node killed mid-job) are this cluster's if they hold
  # one of its files open (their node's log, their spool)
  local step
  for step in $(pgrep -x slurmstepd 2>/dev/null || true); do
    if ls -l "/proc/$step/fd" 2>/dev/null | grep -q " $DIR/"; then kill -9 "$step" 2>/dev/null || true; fi
  done
}

stop() {
  [ -d "$DIR" ] || { say "not set up ($DIR absent): nothing to stop"; return 0; }
  stop_daemons
  say "stopped"
}

status() {
  local name pidfile up=0 total=0
  while read -r name pidfile; do
    total=$((total + 1))
    if pid_alive "$pidfile"; then up=$((up + 1)); say "  $name: pid $(cat "$pidfile")"; else say "  $name: down"; fi
  done < <(daemons)
  if pid_alive "$DIR/run/slurmctld.pid"; then SLURM_CONF=$CONF sinfo -N -o "%N %t %c" 2>/dev/null | sed 's/^/[slurm_cluster]   /'; fi
  [ $up -eq "$total" ]
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  install) mkdir -p "$DIR/log"; install_packages ;;
  *) echo "usage: $0 start|stop|status|env|install" >&2; exit 2 ;;
esac
