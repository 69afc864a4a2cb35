#!/usr/bin/env bash
# Forwards to gpu/run.sh, the GPU acceptance check's own command (gpu/README.md), with the same
# arguments and exit status: runbooks name this path.
exec bash "$(dirname "$0")/../gpu/run.sh" "$@"
