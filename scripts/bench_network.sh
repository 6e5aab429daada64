#!/usr/bin/env bash
# Runs a command on a shaped network: in a private user and network namespace
# (`unshare -rn`, no root needed), whose own loopback is brought up and limited to RATE
# Gbit/s by a token-bucket filter (tc tbf). Every process the command starts (ts.launch's
# replicas included) talks over that loopback, so any benchmark of this repository runs as
# if its replicas were on machines joined by a RATE Gbit/s link (shared by both
# directions: loopback is one device). netem (added latency) is not used: it is missing
# from many kernels; tbf is everywhere.
#
#   scripts/bench_network.sh 2                                   # scripts/bench_network.py at 2 Gbit/s
#   scripts/bench_network.sh 2 -- .venv/bin/python scripts/bench_allreduce.py --quick
#   scripts/bench_network.sh 10 -- .venv/bin/python scripts/bench_step.py
#
# With no command after `--`, runs scripts/bench_network.py --rate RATE (which shapes its
# namespace the same way itself; further arguments before `--` go to it).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: $0 RATE_GBIT [bench_network.py arguments] [-- command ...]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
rate=$1
shift
if ! [[ "$rate" =~ ^[0-9]+([.][0-9]+)?$ ]] || [ "$(echo "$rate" | tr -d '0.')" = "" ]; then
  echo "bench_network.sh: RATE_GBIT must be a positive number of Gbit/s (1, 2, 10), got '$rate'." >&2
  exit 2
fi
python=.venv/bin/python
[ -x "$python" ] || python=python3

own_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do own_args+=("$1"); shift; done
if [ $# -eq 0 ]; then   # no command: the network benchmark itself (it shapes on its own)
  exec "$python" scripts/bench_network.py --rate "$rate" ${own_args[@]+"${own_args[@]}"}
fi
shift   # the `--`
[ $# -ge 1 ] || usage
[ ${#own_args[@]} -eq 0 ] || { echo "bench_network.sh: arguments before -- are for bench_network.py; with a command, put them after it." >&2; exit 2; }

for tool in unshare tc ip; do
  if ! command -v "$tool" > /dev/null; then
    echo "bench_network.sh: '$tool' is not installed; it is needed to shape a private network (apt-get install util-linux iproute2)." >&2
    exit 3
  fi
done
if ! err=$(unshare -rn true 2>&1); then
  echo "bench_network.sh: 'unshare -rn' failed ($err): unprivileged user namespaces are disabled here (sysctl kernel.unprivileged_userns_clone=1, or run in a container that allows them)." >&2
  exit 3
fi
# tbf's burst must hold at least one timer tick of traffic: 4 ms at the rate, 1 MiB at least.
burst=$(awk -v r="$rate" 'BEGIN { b = r * 1e9 / 8 * 0.004; if (b < 1048576) b = 1048576; printf "%d", b }')
export BENCH_NETWORK_RATE_GBIT=$rate
exec unshare -rn sh -c '
  ip link set lo up &&
  tc qdisc add dev lo root tbf rate "$0"gbit burst "$1" latency 50ms &&
  echo "shaped loopback: $(tc qdisc show dev lo)" >&2 &&
  shift && exec "$@"' "$rate" "$burst" "$@"
