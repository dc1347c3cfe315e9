#!/usr/bin/env bash
# Runs the test suite (go test -race over every package). A top-level test
# that fails is run once more, alone in its package; the suite passes only
# if every such test passes on that rerun, and those tests are then listed
# as FLAKY so they are seen and fixed. A build failure, a panic or a
# timeout (a package that fails without naming a failed test) is never
# rerun: it fails the suite at once.
set -uo pipefail
GO=${GO:-go}
TIMEOUT=${TEST_TIMEOUT:-15m}
PKGS=${PKGS:-./...}
log=$(mktemp)
trap 'rm -f "$log"' EXIT

$GO test -race -count=1 -timeout "$TIMEOUT" $PKGS 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ]; then
  exit 0
fi

# go test prints each package's output as one block: the "--- FAIL: Name"
# lines of its failed top-level tests, then "FAIL<TAB>package".
declare -A failed=()
pending=()
panicked=0
hard=0
while IFS= read -r line; do
  case "$line" in
    "panic: "*)
      panicked=1
      ;;
    "--- FAIL: "*)
      name=${line#--- FAIL: }
      pending+=("${name%% *}")
      ;;
    FAIL$'\t'*)
      pkg=$(printf '%s' "$line" | cut -f2)
      if [ ${#pending[@]} -eq 0 ] || [ "$panicked" -ne 0 ]; then
        echo "== $pkg failed with a build failure, a panic or a timeout: not rerun" >&2
        hard=1
      else
        failed[$pkg]="${failed[$pkg]:-}${failed[$pkg]:+|}$(IFS='|'; echo "${pending[*]}")"
      fi
      pending=()
      panicked=0
      ;;
  esac
done <"$log"
if [ "$hard" -ne 0 ] || [ ${#failed[@]} -eq 0 ]; then
  exit "$rc"
fi

flaky=()
for pkg in "${!failed[@]}"; do
  tests=${failed[$pkg]}
  echo "== rerunning once in $pkg: ${tests//|/ }"
  if ! $GO test -race -count=1 -timeout "$TIMEOUT" -run "^(${tests})\$" "$pkg"; then
    echo "== $pkg: ${tests//|/ } failed again" >&2
    exit 1
  fi
  flaky+=("$pkg: ${tests//|/ }")
done
echo "== FLAKY (failed, then passed when rerun alone; fix them):"
printf '   %s\n' "${flaky[@]}"
exit 0
