#!/usr/bin/env bash
# Audit LoRA adapters before merging them into BASE, and keep only those that pass.
#
#   examples/audit_adapters.sh BASE ADAPTER_OR_FOLDER...
#
# Whoever trains an adapter ships the fingerprint of its base inside the adapter folder, so anyone can
# later check the adapter against the base they are about to merge it into:
#   mergekit-lite audit fingerprint models/pre --out adapters/math-lora/base_fingerprint.json
set -euo pipefail
base=${1:?usage: $0 BASE ADAPTER_OR_FOLDER...}
shift
[ $# -gt 0 ] || { echo "usage: $0 BASE ADAPTER_OR_FOLDER..." >&2; exit 2; }

# Table with every check (-v). Exit status: 0 nothing REJECTED (WARN included), 1 some REJECTED, 2 bad input.
status=0
mergekit-lite audit "$@" --base "$base" -v || status=$?
[ "$status" -le 1 ] || exit "$status"

# The same audit as JSON: list the adapters that may be merged (VERIFIED or WARN).
mergekit-lite audit "$@" --base "$base" --json | python3 -c '
import json, sys
for report in json.load(sys.stdin)["reports"]:
    if report["verdict"] != "REJECTED":
        print(report["adapter"])
' > mergeable.txt || true
echo "mergeable adapters ($(wc -l < mergeable.txt)) written to mergeable.txt"

# With the training data and the evaluation holdout at hand, also check the holdout did not leak:
#   mergekit-lite audit adapters/math-lora --base "$base" --train-data train.jsonl --holdout eval.jsonl --ngram 13
