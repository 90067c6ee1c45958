#!/usr/bin/env bash
# The tests start their own redis-server processes on free loopback ports (never the machine's
# own Redis on 6379), so redis-server and redis-cli must be installed. As root on Debian/Ubuntu
# this installs the `redis-server` package (which brings redis-cli); otherwise it stops at once
# and prints the command to run.
set -euo pipefail

have() { command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; }

if have; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_redis: installing the Debian package redis-server (the tests need it)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    if have; then
        exit 0
    fi
    echo "ensure_redis: redis-server was installed but redis-server/redis-cli are not on PATH" >&2
    exit 1
fi
echo "ensure_redis: redis-server and redis-cli are missing; the tests need them. Run:" >&2
echo "    sudo apt-get install redis-server" >&2
exit 1
