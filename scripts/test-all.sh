#!/usr/bin/env bash
# Everything CI runs (`make test`, called by .ci/run), stage by stage: the environment, lint,
# types, the suite on Python 3.11, the unit tests on 3.12. At the end, whatever failed: each
# stage's wall time, the CPU (vLLM's CPU build takes other kernels where AMX exists), the
# slowest tests, the expensive starts (engines, servers, Prefect stacks), a warning past the
# time budget, and a row for bench/ci-times.md (the figures of green runs, kept for review).
#
#   HSX_CI_BUDGET_S   the budget the warning watches (default 2700: 45 minutes; CI allows 90)
#   HSX_PYTEST_ARGS   extra pytest arguments for the 3.11 suite (e.g. "-x")
#   HSX_TEST_WORKERS  test worker processes for the 3.11 suite (pytest-xdist, whole modules per
#                     worker; default 2, measured in bench/ci-times.md); 1 runs it in this process
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
budget=${HSX_CI_BUDGET_S:-2700}
report="$(mktemp -d "${TMPDIR:-/tmp}/hsx-ci-XXXXXX")"
export TESTS_START_LOG="$report/starts.jsonl"
started=$(date +%s)
stages=()
failed=""

run_stage() {  # run_stage NAME COMMAND...: times it; a failure ends the run after the summary
  local name=$1; shift
  local begin=$(date +%s)
  echo "[ci] stage $name: $*"
  "$@"
  local rc=$?
  stages+=("$name $(( $(date +%s) - begin )) $rc")
  if [[ $rc -ne 0 ]]; then failed="$name (exit $rc)"; exit "$rc"; fi
}

summary() {
  local rc=$? total=$(( $(date +%s) - started ))
  set +e
  local cpu amx
  cpu=$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | xargs)
  amx=$(grep -o -w -E 'amx_(tile|bf16|int8|fp16|complex)' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
  echo
  echo "================================ CI summary ================================"
  echo "CPU: ${cpu:-unknown}; $(nproc) cores; AMX flags: ${amx:-none}"
  local row="" line name seconds code
  for line in "${stages[@]}"; do
    read -r name seconds code <<<"$line"
    printf '  %-10s %6d s  %s\n' "$name" "$seconds" "$([[ $code == 0 ]] && echo ok || echo "FAILED ($code)")"
    row+=" $seconds |"
  done
  [[ -z $failed && $rc -ne 0 ]] && failed="the script itself (exit $rc)"
  printf '  %-10s %6d s  (%s)\n' total "$total" "$([[ -z $failed ]] && echo green || echo "failed in $failed")"
  if [[ -f "$report/junit.xml" ]]; then
    echo "slowest 25 tests (setup + call + teardown):"
    "$root/.venv/bin/python" -m tests.ci_report slowest "$report/junit.xml" 25
  fi
  if [[ -f "$TESTS_START_LOG" ]]; then
    echo "expensive starts: $("$root/.venv/bin/python" -m tests.ci_report starts "$TESTS_START_LOG")"
  fi
  if (( total > budget )); then
    echo "WARNING: this run took $total s, past the budget of $budget s (HSX_CI_BUDGET_S): CI allows 5400 s on the slowest machine; cut before adding"
  fi
  echo "row for bench/ci-times.md: | $(date -u +%F) | ${cpu:-unknown}, AMX: ${amx:-none} |$row $total |"
  echo "============================================================================"
  rm -rf "$report"
  exit "$rc"
}
trap summary EXIT

run_stage bootstrap bash scripts/bootstrap.sh
run_stage lint bash -c '.venv/bin/ruff check hsx settings tasks flows tests bench scripts && .venv/bin/ruff format --check hsx settings tasks flows tests bench scripts'
run_stage types .venv/bin/mypy
workers=${HSX_TEST_WORKERS:-2}
parallel=()
# Whole modules per worker, in the order tests/conftest.py gives (longest first).
if (( workers > 1 )); then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
# Its own temporary folder: pytest's default (/tmp/pytest-of-USER/pytest-N) keeps the newest three
# runs and removes older ones, a running suite's included when other pytest runs start beside it.
# shellcheck disable=SC2086  # HSX_PYTEST_ARGS is a list of words
run_stage pytest .venv/bin/python -m pytest -m "not gpu" -p no:cacheprovider -q -rs \
  "${parallel[@]}" --basetemp="$report/tmp" --junitxml="$report/junit.xml" ${HSX_PYTEST_ARGS:-}
run_stage py3.12 bash scripts/unit-tests-on.sh 3.12
