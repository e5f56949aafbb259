#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for hpc_rl's tests and for trying het jobs by hand.
#
#   tools/local_slurm.sh up       install (if missing) + configure + start; idempotent; waits until idle
#   tools/local_slurm.sh down     cancel every job, stop every daemon (state is kept for the next `up`)
#   tools/local_slurm.sh status   which daemons run, and `sinfo`
#
# What comes up (all on loopback, from Debian's packages; needs root, no systemd):
#   munged, a private MariaDB on 127.0.0.1:3307 + slurmdbd (accounting: submitit learns that a job was
#   cancelled or timed out only from sacct), slurmctld, and one slurmd per virtual node node1..nodeN
#   (N = HPC_RL_SLURM_NODES, default 3; each node: 16 CPUs, 8 fake GPUs = gres files -> /dev/null, so
#   Slurm itself sets CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS in every step that asks for GPUs).
#   Partitions `debug` (default) and `gpu` both hold node1..nodeN, so the reference recipes
#   (partition: gpu) can be submitted here too.
#   Partition `sortorder` holds a second set, node9 node10 node11 (HPC_RL_SLURM_SORTORDER_NODES): names
#   whose sorted order (node10 < node11 < node9, as torchrun sorts them) differs from Slurm's, for the
#   multi-node placement tests; no other partition uses them, so other tests never land there.
# Facts behind the settings: /work/shared/notes/slurm.md (Slurm 22.05 without cgroups or systemd).
set -euo pipefail

NODES=${HPC_RL_SLURM_NODES:-3}
SORTORDER_NODES=${HPC_RL_SLURM_SORTORDER_NODES-node9 node10 node11}
STATE=${HPC_RL_SLURM_STATE:-/var/lib/hpc-rl-slurm}
CONF_DIR=/etc/slurm
CLUSTER=hpcrl-local
DB_PORT=3307
DB_PASS=hpc-rl-local-only
MARKER="# written by hpc_rl tools/local_slurm.sh"
CONFIG_CHANGED=0  # set by write_if_changed: running daemons re-read their config (scontrol reconfigure)
PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)

log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }

alive() {  # alive PIDFILE: the process named in the pid file runs
  [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2; shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ "$SECONDS" -lt "$deadline" ] || die "timed out after ${seconds}s waiting for $what (logs: $STATE/log)"
    sleep 0.2
  done
}

install_packages() {
  local missing=0
  for binary in slurmctld slurmd sinfo munged slurmdbd mariadbd; do
    command -v "$binary" >/dev/null 2>&1 || [ -x "/usr/sbin/$binary" ] || missing=1
  done
  [ "$missing" = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "packages are missing and installing them needs root: ${PACKAGES[*]}"
  log "installing ${PACKAGES[*]}"
  # Debian starts daemons in postinst; a denying policy-rc.d keeps apt from starting anything.
  local policy=/usr/sbin/policy-rc.d restore=""
  if [ -e "$policy" ]; then restore=$(mktemp); cp -p "$policy" "$restore"; fi
  printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
  local code=$?
  if [ -n "$restore" ]; then mv "$restore" "$policy"; else rm -f "$policy"; fi
  return "$code"
}

write_if_changed() {  # write_if_changed PATH MODE < content
  local path=$1 mode=$2 tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if [ -f "$path" ] && cmp -s "$tmp" "$path"; then rm -f "$tmp"; return 0; fi
  if [ -f "$path" ] && ! grep -qF "$MARKER" "$path"; then
    rm -f "$tmp"
    die "$path exists and was not written by this script; move it away to use the local cluster"
  fi
  install -m "$mode" "$tmp" "$path"; rm -f "$tmp"
  CONFIG_CHANGED=1
}

all_nodes() {  # every virtual node's name, node1..nodeN then the sortorder set
  local i
  for i in $(seq 1 "$NODES"); do echo "node$i"; done
  for name in $SORTORDER_NODES; do echo "$name"; done
}

node_port() {  # node_port NAME: nodeK listens on 6830+K
  local number=${1#node}
  [[ "$number" =~ ^[0-9]+$ ]] || die "node name $1 must be node<number>"
  echo $((6830 + number))
}

configured_nodes() {  # the node names of the slurm.conf in place (empty when none)
  [ -f "$CONF_DIR/slurm.conf" ] && grep -oE '^NodeName=[^ ]+' "$CONF_DIR/slurm.conf" | cut -d= -f2 | tr '\n' ' '
  return 0
}

write_configs() {
  mkdir -p "$CONF_DIR" "$STATE"/{log,run,ctld,gpu} "$STATE"/spool
  for i in 0 1 2 3 4 5 6 7; do ln -sfn /dev/null "$STATE/gpu/nvidia$i"; done
  local node_lines="" names="" gres_lines="" name sortorder_line=""
  [ -z "$(all_nodes | sort | uniq -d)" ] || die "node names repeat: $(all_nodes | tr '\n' ' ')"
  for name in $(all_nodes); do
    node_lines+="NodeName=$name NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(node_port "$name") CPUs=16 RealMemory=64000 Gres=gpu:8 State=UNKNOWN"$'\n'
    gres_lines+="NodeName=$name Name=gpu File=$STATE/gpu/nvidia[0-7]"$'\n'
    names+="$name "
  done
  local first
  first=$(for i in $(seq 1 "$NODES"); do echo -n "node$i,"; done)
  if [ -n "$SORTORDER_NODES" ]; then
    sortorder_line="PartitionName=sortorder Nodes=$(echo $SORTORDER_NODES | tr ' ' ',') Default=NO MaxTime=INFINITE State=UP"
  fi
  write_if_changed "$CONF_DIR/slurm.conf" 644 <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
# A dead node (slurmd and its steps killed) is marked DOWN after SlurmdTimeout: 10 s instead of 300 s,
# so the node-death tests see Slurm's verdict in seconds (slurmctld pings every SlurmdTimeout/3).
SlurmdTimeout=10
MailProg=/bin/true
GresTypes=gpu
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
${node_lines}PartitionName=debug Nodes=${first%,} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=${first%,} Default=NO MaxTime=INFINITE State=UP
$sortorder_line
EOF
  write_if_changed "$CONF_DIR/gres.conf" 644 <<EOF
$MARKER
AutoDetect=off
${gres_lines%$'\n'}
EOF
  write_if_changed "$CONF_DIR/cgroup.conf" 644 <<EOF
$MARKER
CgroupPlugin=cgroup/v1
EOF
  write_if_changed "$CONF_DIR/slurmdbd.conf" 600 <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  # Node names from SLURM_JOB_NODELIST must resolve (every virtual node is this machine).
  if ! grep -qE "^127\.0\.0\.1[[:space:]].*# hpc_rl local slurm" /etc/hosts; then
    echo "127.0.0.1 ${names}# hpc_rl local slurm" >>/etc/hosts
  elif ! grep -qE "^127\.0\.0\.1 ${names}# hpc_rl local slurm" /etc/hosts; then
    sed -i -E "s|^127\.0\.0\.1[[:space:]].*# hpc_rl local slurm$|127.0.0.1 ${names}# hpc_rl local slurm|" /etc/hosts
  fi
}

start_munge() {
  if alive /run/munge/munged.pid && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  [ -s /etc/munge/munge.key ] || { mungekey --create --force >/dev/null; chown munge:munge /etc/munge/munge.key; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 10 munge sh -c 'munge -n | unmunge'
}

db_client() { mariadb --no-defaults --socket="$STATE/run/mysqld.sock" -uroot "$@"; }

start_mariadb() {
  if alive "$STATE/run/mysqld.pid"; then return 0; fi
  if [ ! -d "$STATE/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --user=root --datadir="$STATE/mysql" --skip-test-db \
      --auth-root-authentication-method=socket >"$STATE/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed (see $STATE/log/mariadb-install.log)"
  fi
  setsid nohup /usr/sbin/mariadbd --no-defaults --user=root --datadir="$STATE/mysql" \
    --bind-address=127.0.0.1 --port="$DB_PORT" --socket="$STATE/run/mysqld.sock" \
    --pid-file="$STATE/run/mysqld.pid" --log-error="$STATE/log/mariadb.log" \
    --innodb-buffer-pool-size=64M --skip-log-bin </dev/null >/dev/null 2>&1 &
  wait_for 30 mariadb db_client -e "SELECT 1"
  db_client <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

start_slurm() {
  local previous_nodes=$1 name
  if ! alive "$STATE/run/slurmdbd.pid"; then
    /usr/sbin/slurmdbd
    wait_for 30 slurmdbd sacctmgr -n -i list cluster
  fi
  if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
  if alive "$STATE/run/slurmctld.pid" && [ "$previous_nodes" != "$(configured_nodes)" ]; then
    # 22.05 cannot add nodes on reconfigure: restart slurmctld (running jobs are kept in its state)
    log "node set changed ($previous_nodes-> $(configured_nodes)): restarting slurmctld"
    stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  fi
  if ! alive "$STATE/run/slurmctld.pid"; then
    /usr/sbin/slurmctld -i
    [ "$CONFIG_CHANGED" = 1 ] && { wait_for 30 slurmctld scontrol ping; scontrol reconfigure || true; }
  elif [ "$CONFIG_CHANGED" = 1 ]; then
    # running jobs keep running: slurmctld and every slurmd re-read slurm.conf
    scontrol reconfigure && log "configuration changed: scontrol reconfigure"
  fi
  wait_for 30 slurmctld scontrol ping
  for name in $(all_nodes); do
    alive "$STATE/run/slurmd-$name.pid" || /usr/sbin/slurmd -N "$name"
  done
  # Nodes that were down (e.g. after an unclean stop) come back with ReturnToService=2 once slurmd
  # registers; resume any that stay DOWN/DRAIN.
  local deadline=$((SECONDS + 40)) states
  while :; do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u)
    if [ -n "$states" ] && ! echo "$states" | grep -qvE ' (idle|mixed|allocated)$'; then break; fi
    if echo "$states" | grep -qE ' (down|drained|draining)'; then
      scontrol update nodename="$(all_nodes | tr '\n' ',' | sed 's/,$//')" state=resume >/dev/null 2>&1 || true
    fi
    [ "$SECONDS" -lt "$deadline" ] || die "nodes not idle after 40s: $(echo "$states" | tr '\n' ' ')"
    sleep 0.3
  done
}

stop_pidfile() {  # stop_pidfile PIDFILE NAME
  local pidfile=$1 name=$2 pid
  alive "$pidfile" || return 0
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || { log "stopped $name"; return 0; }; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
  log "killed $name"
}

cmd_up() {
  local start=$SECONDS
  [ "$(id -u)" = 0 ] || die "run as root (the daemons run as root on this test cluster)"
  install_packages
  local previous_nodes
  previous_nodes=$(configured_nodes)
  write_configs
  start_munge
  start_mariadb
  start_slurm "$previous_nodes"
  log "up in $((SECONDS - start))s: $NODES node(s) in partitions debug (default) and gpu; sortorder: ${SORTORDER_NODES:-none}"
  sinfo
}

cmd_down() {
  if alive "$STATE/run/slurmctld.pid"; then
    scancel --full --quiet --user=root 2>/dev/null || true
    scancel --full --quiet 2>/dev/null || true
    # Let slurmd kill the job steps before the daemons go.
    for _ in $(seq 1 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for pidfile in "$STATE"/run/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pidfile "$pidfile" "$(basename "$pidfile" .pid)"
  done
  stop_pidfile "$STATE/run/slurmctld.pid" slurmctld
  stop_pidfile "$STATE/run/slurmdbd.pid" slurmdbd
  stop_pidfile "$STATE/run/mysqld.pid" mariadb
  stop_pidfile /run/munge/munged.pid munged
}

cmd_status() {
  local name pidfile
  for pidfile in /run/munge/munged.pid "$STATE/run/mysqld.pid" "$STATE/run/slurmdbd.pid" \
    "$STATE/run/slurmctld.pid" "$STATE"/run/slurmd-*.pid; do
    name=$(basename "$pidfile" .pid)
    if alive "$pidfile"; then echo "$name: running (pid $(cat "$pidfile"))"; else echo "$name: stopped"; fi
  done
  if command -v sinfo >/dev/null && sinfo -h >/dev/null 2>&1; then sinfo; squeue; else echo "slurmctld: not answering"; exit 1; fi
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
