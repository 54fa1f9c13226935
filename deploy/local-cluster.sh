#!/usr/bin/env bash
# The compose topology as local processes, one Linux network namespace per role (api,
# 2 prefill, 1 decode) joined by veth pairs on a bridge, so KV crosses a network interface.
# Needs root. Everything after the script name goes to `pdserve local-cluster`:
#   deploy/local-cluster.sh [--name pdc] [--num-prefill 2] [--num-decode 1] [engine flags]
#   deploy/local-cluster.sh --down [--name pdc]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec "$PYTHON" -m pdserve.cli local-cluster "$@"
