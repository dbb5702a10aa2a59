#!/usr/bin/env bash
# A one-node SLURM on this machine, without systemd, for trying scripts/slurm/ray_cluster.sbatch
# (the slurm test tier: make test-slurm). Everything it writes lives in $FINEENVS_SLURM_DIR
# (default /tmp/fineenvs-slurm): munge key and socket, slurm.conf, state, logs, pid files.
#   scripts/slurm/local_slurm.sh start   # installs slurm-wlm + munge if missing, starts munged, slurmctld, slurmd
#   scripts/slurm/local_slurm.sh stop    # stops exactly those three, by their pid files
#   scripts/slurm/local_slurm.sh env     # the line to source so sbatch/squeue use this cluster
# Clients find the cluster through SLURM_CONF=$FINEENVS_SLURM_DIR/slurm.conf (not /etc/slurm: the
# machine's own configuration is left alone). Daemons and jobs run as root here (a test machine).
set -euo pipefail

dir=${FINEENVS_SLURM_DIR:-/tmp/fineenvs-slurm}
conf=$dir/slurm.conf
# SLURM's default ports; set these when the machine runs another slurmctld/slurmd.
ctld_port=${FINEENVS_SLURMCTLD_PORT:-6817}
slurmd_port=${FINEENVS_SLURMD_PORT:-6818}

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing and installing them needs root. Fix: apt-get install -y slurm-wlm munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge >/dev/null \
    || die "apt-get install slurm-wlm munge failed (see above). Fix: apt-get update, then rerun"
}

write_conf() {
  # The node line as slurmd sees the hardware (CPUs, sockets, RealMemory): a node that declares
  # more than it has is drained by slurmctld.
  local node
  node=$(slurmd -C | head -1)
  [[ $node == NodeName=* ]] || die "slurmd -C printed no node line: $node"
  cat >"$conf" <<EOF
ClusterName=fineenvs
SlurmctldHost=$(hostname)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/slurmd
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# No cgroups here (no systemd, maybe no writable cgroupfs): processes are tracked by parentage,
# which still finds an agent started in a session of its own (proctrack/pgid would not).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
# scancel: SIGTERM, then SIGKILL after KillWait seconds.
KillWait=30
$node
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  install
  mkdir -p "$dir"/munge "$dir"/ctld "$dir"/slurmd
  chmod 700 "$dir"/munge
  if ! alive "$dir/munged.pid"; then
    [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none; chmod 400 "$dir/munge/munge.key"; }
    # --force: munged refuses root and a socket under /tmp otherwise; this is a test machine.
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
      --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/munged.seed" \
      || die "munged did not start: $(tail -5 "$dir/munged.log" 2>/dev/null)"
  fi
  write_conf
  alive "$dir/slurmctld.pid" || slurmctld -f "$conf" || die "slurmctld did not start: $(tail -5 "$dir/slurmctld.log")"
  alive "$dir/slurmd.pid" || slurmd -f "$conf" || die "slurmd did not start: $(tail -5 "$dir/slurmd.log")"
  # Ready when the node takes jobs (idle), not when the daemons have forked.
  local state=""
  for _ in $(seq 60); do
    state=$(SLURM_CONF=$conf sinfo -h -N -o %t 2>/dev/null | head -1) || true
    [[ $state == idle* || $state == mix* || $state == alloc* ]] && { echo "SLURM up: $(hostname) $state; export SLURM_CONF=$conf"; return; }
    sleep 1
  done
  die "the node is not idle after 60 s (state '$state'). See $dir/slurmctld.log and $dir/slurmd.log"
}

stop_one() {
  local pidfile=$dir/$1.pid pid
  alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  kill -TERM "$pid"
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || { rm -f "$pidfile"; return 0; }; sleep 0.5; done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

stop() {
  # slurmd first: slurmctld would otherwise mark its node down while it stops.
  stop_one slurmd
  stop_one slurmctld
  stop_one munged
  echo "SLURM stopped ($dir kept: logs and state)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$conf" ;;
  *) die "usage: $0 start|stop|env" ;;
esac
