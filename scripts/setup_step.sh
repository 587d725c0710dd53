# Sourced by the setup_*.sh scripts, after their stamp check: `source scripts/setup_step.sh NAME` makes $log, a
# fresh log file, and step "description" command...: run the command with its output to the log; on failure one
# line ([NAME] FAILED: the step, the log's last line, the log's path) and exit 1.
log=$(mktemp "${TMPDIR:-/tmp}/$1.XXXXXX.log")
step_tag=$1
step() {
  local what=$1; shift
  echo "== $what: $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "[$step_tag] FAILED: $what ($(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-300)); full log: $log" >&2
    exit 1
  fi
}
