#!/bin/bash
# Remove everything setup.sh created. Idempotent; always exits 0.
# Kills any process still living in an hvdh* namespace first (otherwise the
# netns would be kept alive by its processes after `ip netns del`).
BR=hvdbr0
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^hvdh[0-9]+$'); do
  pids=$(ip netns pids "$ns" 2>/dev/null)
  if [ -n "$pids" ]; then
    kill -TERM $pids 2>/dev/null; sleep 0.5
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
  fi
  ip netns del "$ns" 2>/dev/null      # also destroys the veth pair (peer of eth0)
  rm -rf "/etc/netns/$ns"
done
# leftover root-side veths (e.g. if a ns was deleted by hand)
for v in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^vhvdh[0-9]+$'); do
  ip link del "$v" 2>/dev/null
done
ip link del "$BR" 2>/dev/null
rmdir /etc/netns 2>/dev/null
# `ip netns add` turns /run/netns into a (shared) bind mount of itself; undo it
# when no namespace is left at all (it is recreated on the next `ip netns add`)
if [ -d /run/netns ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
  while grep -q ' /run/netns ' /proc/self/mountinfo; do umount /run/netns 2>/dev/null || break; done
  rmdir /run/netns 2>/dev/null
fi
exit 0
