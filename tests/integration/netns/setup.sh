#!/bin/bash
# Create N fake "hosts" as network namespaces hvdh1..hvdhN attached to a bridge
# in the root namespace.
#   root ns:  bridge hvdbr0 = 10.231.0.1/24
#   hvdhI:    eth0 = 10.231.0.(10+I)/24, lo up, default route via 10.231.0.1
#             /etc/netns/hvdhI/{hostname,hosts} (bind-mounted over /etc by `ip netns exec`)
# Usage: setup.sh [N=2]     (idempotent: runs teardown.sh first)
set -euo pipefail
N=${1:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
BR=hvdbr0
NET=10.231.0
ROOT_HOST=$(hostname)

"$HERE/teardown.sh" >/dev/null 2>&1 || true

ip link add "$BR" type bridge
ip addr add "$NET.1/24" dev "$BR"
ip link set "$BR" up

for i in $(seq 1 "$N"); do
  ns=hvdh$i
  ip=$NET.$((10 + i))
  ip netns add "$ns"
  # root-side end "vhvdhI" goes on the bridge, the other end becomes eth0 in the ns
  ip link add "v$ns" type veth peer name "p$ns"
  ip link set "v$ns" master "$BR" up
  ip link set "p$ns" netns "$ns"
  ip -n "$ns" link set "p$ns" name eth0
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$NET.1"

  # per-ns /etc overlays (ip netns exec bind-mounts /etc/netns/NS/X over /etc/X;
  # target /etc/X must exist, which is the case for hosts and hostname)
  mkdir -p "/etc/netns/$ns"
  echo "$ns" > "/etc/netns/$ns/hostname"
  {
    echo "127.0.0.1 localhost"
    echo "$ip $ns"
    # the root ns hostname must NOT resolve to 127.0.0.1 inside the ns
    # (hydra proxies connect back to mpiexec's host name)
    echo "$NET.1 $ROOT_HOST hvdroot"
    for j in $(seq 1 "$N"); do
      [ "$j" = "$i" ] || echo "$NET.$((10 + j)) hvdh$j"
    done
  } > "/etc/netns/$ns/hosts"
done

# wait until the bridge ports are forwarding (no STP by default -> immediate,
# but the links need a moment to come up)
command -v ping >/dev/null && for i in $(seq 1 "$N"); do
  for _ in $(seq 1 50); do
    ip netns exec "hvdh$i" ping -c1 -W1 -q "$NET.1" >/dev/null 2>&1 && break
    sleep 0.1
  done
done
echo "setup: $N namespaces up"
