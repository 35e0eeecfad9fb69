#!/bin/bash
# Emulate a heterogeneous fleet on one Linux machine with cgroup v1 CPU quotas and memory limits
# (DESIGN §9 item 4; ../shared/fleet-emulation.md). Needs root and cgroup v1 cpu + memory controllers.
# Groups are named fleet_<NAME>.
#
#   cg.sh mk NAME QUOTA_PCT MEM_MB [PERIOD_US]   QUOTA_PCT 0 = unlimited; MEM_MB 0 = unlimited.
#                                                 Pass PERIOD_US=10000: the default 100000 is too
#                                                 coarse (steps turn bimodal, DESIGN §9).
#   cg.sh run NAME cmd...      exec cmd inside both groups
#   cg.sh runmem NAME cmd...   exec cmd inside the memory group only (join the CPU group after loading
#                              by writing the PID to /sys/fs/cgroup/cpu/fleet_NAME/cgroup.procs)
#   cg.sh stat NAME            throttling counters and memory peak
#   cg.sh rm NAME              remove both groups (they must be empty)
#
# Memory groups nest under this shell's own memory cgroup, so the sandbox's accounting stays intact.
set -e
CPU=/sys/fs/cgroup/cpu
MEMROOT=/sys/fs/cgroup/memory$(grep ':memory:' /proc/self/cgroup | cut -d: -f3)
if [ $# -lt 2 ]; then sed -n '2,16p' "$0" >&2; exit 64; fi
cmd=$1; name=fleet_$2; shift 2
case $cmd in
mk)
  q=$1; m=$2; p=${3:-100000}
  if [ -z "$q" ] || [ -z "$m" ]; then echo "usage: cg.sh mk NAME QUOTA_PCT MEM_MB [PERIOD_US]" >&2; exit 64; fi
  mkdir -p "$CPU/$name" "$MEMROOT/$name"
  echo "$p" > "$CPU/$name/cpu.cfs_period_us"
  if [ "$q" = 0 ]; then echo -1 > "$CPU/$name/cpu.cfs_quota_us"
  else echo $(( q * p / 100 )) > "$CPU/$name/cpu.cfs_quota_us"; fi
  if [ "$m" != 0 ]; then echo $(( m * 1024 * 1024 )) > "$MEMROOT/$name/memory.limit_in_bytes"; fi
  echo "$name: period=$(cat "$CPU/$name/cpu.cfs_period_us") quota=$(cat "$CPU/$name/cpu.cfs_quota_us") mem=$(cat "$MEMROOT/$name/memory.limit_in_bytes")";;
run)
  echo $$ > "$CPU/$name/cgroup.procs"; echo $$ > "$MEMROOT/$name/cgroup.procs"; exec "$@";;
runmem)
  echo $$ > "$MEMROOT/$name/cgroup.procs"; exec "$@";;
stat)
  echo "$name: $(tr '\n' ' ' < "$CPU/$name/cpu.stat") mem_peak_MB=$(( $(cat "$MEMROOT/$name/memory.max_usage_in_bytes") / 1048576 )) failcnt=$(cat "$MEMROOT/$name/memory.failcnt")";;
rm)
  rmdir "$CPU/$name" 2>/dev/null || true; rmdir "$MEMROOT/$name" 2>/dev/null || true;;
*)
  echo "cg.sh: unknown command $cmd" >&2; exit 64;;
esac
