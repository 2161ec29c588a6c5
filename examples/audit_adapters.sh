#!/usr/bin/env bash
# Audit LoRA adapters before merging them into BASE, and list those that may be merged.
#
#   examples/audit_adapters.sh [--allow-warn] BASE ADAPTER_OR_FOLDER...
#
# Prints the audit table (every check, -v) on stderr and the mergeable adapters on stdout, one per line:
# the VERIFIED ones, and the WARN ones too with --allow-warn (WARN: nothing proves the adapter was made on BASE).
# Exit status as `mergekit-lite audit`: 0 nothing REJECTED, 1 some REJECTED, 2 unusable input.
#
# Runs from any shell: `mergekit-lite` is taken from PATH, else from $MERGEKIT_LITE (e.g. .venv/bin/mergekit-lite).
# Whoever trains an adapter ships the fingerprint of its base inside the adapter folder, so anyone can
# later check the adapter against the base they are about to merge it into:
#   mergekit-lite audit fingerprint models/pre --out adapters/math-lora/base_fingerprint.json
set -euo pipefail
usage="usage: $0 [--allow-warn] BASE ADAPTER_OR_FOLDER..."
accepted=VERIFIED
if [ "${1:-}" = "--allow-warn" ]; then accepted="VERIFIED WARN"; shift; fi
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
base=$1
shift
cli=${MERGEKIT_LITE:-$(command -v mergekit-lite || true)}
[ -n "$cli" ] || { echo "error: mergekit-lite is not on PATH (activate its virtualenv, or set MERGEKIT_LITE)" >&2; exit 2; }

# One audit, as CSV: column 1 is the adapter, column 3 its verdict (the table with every check goes to stderr).
"$cli" audit "$@" --base "$base" -v -q >&2 || { status=$?; [ "$status" -le 1 ] || exit "$status"; }
status=0
report=$("$cli" audit "$@" --base "$base" --csv -q) || status=$?
[ "$status" -le 1 ] || exit "$status"
while IFS= read -r line; do
  verdict=$(printf '%s\n' "$line" | awk -F, '{print $3}')
  adapter=$(printf '%s\n' "$line" | awk -F, '{print $1}')
  case " $accepted " in *" $verdict "*) printf '%s\n' "$adapter" ;; esac
done < <(printf '%s\n' "$report" | tail -n +2)
exit "$status"

# With the training data and the evaluation holdout at hand, also check the holdout did not leak:
#   mergekit-lite audit adapters/math-lora --base "$base" --train-data train.jsonl --holdout eval.jsonl --ngram 13
