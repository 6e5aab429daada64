#!/usr/bin/env bash
# SLURM's daemons and client on the machine (Debian's slurmctld, slurmd, slurm-client and
# munge), for the tests that start a private cluster; idempotent. Only as root with apt-get:
# otherwise it says why and the SLURM tests skip, saying so. A failing apt-get never fails
# the set-up (those tests skip). It touches no Python environment, so scripts/setup.sh runs
# it beside the environments' set-up; scripts/setup_tests.sh runs it when run alone.
set -euo pipefail
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_slurm.sh: not root or no apt-get; SLURM not installed, the SLURM tests will skip"
  exit 0
fi
if ! command -v slurmctld >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends slurmctld slurmd slurm-client munge; } \
    || echo "setup_slurm.sh: apt-get could not install SLURM; the SLURM tests will skip"
fi
