#!/usr/bin/env bash
# Kafila NAT lab: network namespaces + veth + a bridge + nftables NATs (DESIGN §9.3,
# ../shared/natlab.md). Needs root, iproute2 and nftables.
#
#   scripts/natlab.sh up O C S S   rendezvous kf-rdv (172.16.0.10 and .11) and member i in
#                                  namespace kf-m<i> (10.0.i.2) behind NAT kf-nat<i>
#                                  (WAN 172.16.0.(20+i)) of the given class:
#                                    O  full cone: endpoint-independent mapping and filtering
#                                    C  port-restricted cone: EIM + address-and-port-dependent filtering
#                                    S  symmetric: a random port per flow (masquerade random)
#                                    N  no NAT: the member sits on the WAN bridge itself (172.16.0.(20+i))
#                                    @K behind member K's NAT, on the same LAN (10.0.K.x): two
#                                       members behind one NAT, e.g. "up S @1"
#   scripts/natlab.sh down         delete every kf-* namespace (safe to run when none exist)
#   scripts/natlab.sh exec NS CMD  run CMD in namespace NS: rdv, wan, m<i>, nat<i> or kf-...
#   scripts/natlab.sh status       list kf-* namespaces and the class of each member
#
# "up" runs "down" first, so it can be repeated. Only private addresses inside namespaces this
# script creates are used; nothing outside them is touched.
set -euo pipefail

STATE_DIR=${NATLAB_STATE_DIR:-/run/kafila-natlab}

die() { echo "natlab: $*" >&2; exit 1; }

need_tools() {
  [[ $(id -u) -eq 0 ]] || die "must run as root (network namespaces and nftables need it)"
  command -v ip >/dev/null || die "ip (iproute2) not found; apt-get install -y iproute2"
  command -v nft >/dev/null || die "nft not found; apt-get install -y nftables"
}

down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^kf-' || true); do
    # Kill what still runs inside (our own test servers), then drop the namespace.
    local pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -n $pids ]] && kill $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$STATE_DIR"
}

nft_in() { ip netns exec "$1" nft "${@:2}"; }

make_nat() {  # make_nat <i> <class>
  local i=$1 cls=$2 ns=kf-nat$1
  ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1
  nft_in "$ns" add table ip nat
  nft_in "$ns" add chain ip nat prerouting '{ type nat hook prerouting priority dstnat; policy accept; }'
  nft_in "$ns" add chain ip nat postrouting '{ type nat hook postrouting priority srcnat; policy accept; }'
  case $cls in
    C) nft_in "$ns" add rule ip nat postrouting oifname wan masquerade ;;
    S) nft_in "$ns" add rule ip nat postrouting oifname wan masquerade random ;;
    O)
      nft_in "$ns" add map ip nat fullcone '{ type inet_service : ipv4_addr . inet_service; flags dynamic,timeout; timeout 300s; size 65536; }'
      nft_in "$ns" add rule ip nat prerouting iifname wan meta l4proto udp dnat ip to udp dport map @fullcone
      nft_in "$ns" add rule ip nat postrouting oifname wan meta l4proto udp update @fullcone '{ udp sport timeout 300s : ip saddr . udp sport }'
      nft_in "$ns" add rule ip nat postrouting oifname wan masquerade
      ;;
  esac
  # The home router's input drop on the WAN side: without it conntrack hands the mapped port to
  # the first unsolicited packet (../shared/natlab.md).
  nft_in "$ns" add table ip filter
  nft_in "$ns" add chain ip filter input '{ type filter hook input priority 0; policy accept; }'
  nft_in "$ns" add rule ip filter input iifname wan ct state established,related accept
  nft_in "$ns" add rule ip filter input iifname wan drop
}

up() {
  need_tools
  [[ $# -ge 1 ]] || die "usage: natlab.sh up CLASS... (each O, C, S or N)"
  local cls
  local -a classes=("$@")
  local k=0
  for cls in "$@"; do
    k=$((k + 1))
    if [[ $cls =~ ^@([0-9]+)$ ]]; then
      local owner=${BASH_REMATCH[1]}
      (( owner >= 1 && owner < k )) || die "member $k: '@$owner' must name an earlier member"
      [[ ${classes[$((owner - 1))]} =~ ^[OCS]$ ]] || die "member $k: member $owner has no NAT of its own to share"
      continue
    fi
    [[ $cls =~ ^[OCSN]$ ]] || die "unknown NAT class '$cls' (use O, C, S, N or @K)"
  done
  [[ $# -le 200 ]] || die "at most 200 members"
  down

  ip netns add kf-wan; ip -n kf-wan link set lo up
  ip -n kf-wan link add br0 type bridge; ip -n kf-wan link set br0 up
  ip netns add kf-rdv; ip -n kf-rdv link set lo up
  ip link add rdv0 netns kf-rdv type veth peer name p-rdv netns kf-wan
  ip -n kf-wan link set p-rdv master br0 up
  ip -n kf-rdv addr add 172.16.0.10/24 dev rdv0
  ip -n kf-rdv addr add 172.16.0.11/24 dev rdv0
  ip -n kf-rdv link set rdv0 up

  local i=0
  local -A hosts_on=()  # NAT index -> members on its LAN so far
  mkdir -p "$STATE_DIR"
  : > "$STATE_DIR/classes"
  for cls in "$@"; do
    i=$((i + 1))
    echo "m$i $cls" >> "$STATE_DIR/classes"
    ip netns add "kf-m$i"; ip -n "kf-m$i" link set lo up
    if [[ $cls == N ]]; then
      ip link add eth0 netns "kf-m$i" type veth peer name "p-m$i" netns kf-wan
      ip -n kf-wan link set "p-m$i" master br0 up
      ip -n "kf-m$i" addr add "172.16.0.$((20 + i))/24" dev eth0
      ip -n "kf-m$i" link set eth0 up
      continue
    fi
    local nat=$i
    if [[ $cls =~ ^@([0-9]+)$ ]]; then
      nat=${BASH_REMATCH[1]}
    else
      ip netns add "kf-nat$i"; ip -n "kf-nat$i" link set lo up
      ip link add wan netns "kf-nat$i" type veth peer name "p-nat$i" netns kf-wan
      ip -n kf-wan link set "p-nat$i" master br0 up
      ip -n "kf-nat$i" addr add "172.16.0.$((20 + i))/24" dev wan
      ip -n "kf-nat$i" link set wan up
      # the LAN: a bridge, so that several members can sit behind this NAT ("@K")
      ip -n "kf-nat$i" link add lan type bridge
      ip -n "kf-nat$i" addr add "10.0.$i.1/24" dev lan
      ip -n "kf-nat$i" link set lan up
      make_nat "$i" "$cls"
    fi
    hosts_on[$nat]=$(( ${hosts_on[$nat]:-0} + 1 ))
    ip link add "l-m$i" netns "kf-nat$nat" type veth peer name eth0 netns "kf-m$i"
    ip -n "kf-nat$nat" link set "l-m$i" master lan up
    ip -n "kf-m$i" addr add "10.0.$nat.$((1 + ${hosts_on[$nat]}))/24" dev eth0
    ip -n "kf-m$i" link set eth0 up
    ip -n "kf-m$i" route add default via "10.0.$nat.1"
  done
  echo "natlab: up: rdv 172.16.0.10 172.16.0.11; members $*"
}

ns_name() {
  case $1 in
    kf-*) echo "$1" ;;
    *) echo "kf-$1" ;;
  esac
}

cmd=${1:-}
[[ -n $cmd ]] && shift
case $cmd in
  up) up "$@" ;;
  down) need_tools; down ;;
  exec)
    [[ $# -ge 2 ]] || die "usage: natlab.sh exec NS CMD..."
    ns=$(ns_name "$1"); shift
    exec ip netns exec "$ns" "$@"
    ;;
  status)
    ip netns list | awk '{print $1}' | grep '^kf-' || echo "natlab: no kf-* namespaces"
    [[ -f $STATE_DIR/classes ]] && cat "$STATE_DIR/classes"
    ;;
  *) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; [[ -z $cmd || $cmd == -h || $cmd == --help ]] || exit 2 ;;
esac
