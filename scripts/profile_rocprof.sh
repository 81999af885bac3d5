#!/usr/bin/env bash
# Profile one decode shape with rocprofv3 and print the per-kernel summary.
#   scripts/profile_rocprof.sh [--shape 64x8k] [--format mxfp4] [--iters 20] [--out DIR] [--dry-run]
set -euo pipefail
exec python3 -m hipmla profile "$@"
