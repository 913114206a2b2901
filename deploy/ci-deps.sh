#!/usr/bin/env bash
# Debian packages the deploy tests (tests/deploy) run: promtool (package prometheus) checks and
# unit-tests the chart's alerting rules; haproxy balances two local replicas. Idempotent: does
# nothing when both are installed. Needs root (CI runs as root). Starts no service.
set -euo pipefail
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v haproxy >/dev/null 2>&1 || need+=(haproxy)
if [ ${#need[@]} -eq 0 ]; then
    echo "deploy/ci-deps.sh: promtool and haproxy present"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: the prometheus package's binaries only, no exporters or web assets.
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's postinst may start the daemons where an init system runs; the tests need neither.
for svc in prometheus haproxy; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
        systemctl stop "$svc" || true
    fi
done
echo "deploy/ci-deps.sh: installed ${need[*]}"
