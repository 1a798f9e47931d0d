# Sourced by scripts/slurm_cluster.sh and scripts/slurm_two_nodes.sh: the slurm.conf lines both test
# clusters share (munge auth, no cgroups, fast scheduling and requeue). Each script adds its own
# names, users, paths, accounting and nodes around them.

# Print the shared lines.
slurm_conf_common() {
    cat <<'CONF'
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire+1 s after it ended (default 120 s).
AuthInfo=cred_expire=10
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
# Try pending jobs every 1-2 s (defaults 30 s / 60 s: a requeued job would wait for them).
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Impossible requests (unknown partition, too many CPUs) are rejected by sbatch at once.
EnforcePartLimits=ALL
ReturnToService=2
JobRequeue=1
# SIGKILL 5 s after SIGTERM.
KillWait=5
JobCompType=jobcomp/none
CONF
}
