# Sourced by the scripts that train a drafter once and reuse it when rerun (bench_dflash.sh, bench_eagle_recipes.sh,
# demo.sh), after setup_env.sh (which moves to the repository root). `trained FOLDER HINT TRAINER [trainer arguments]`:
#   status 0: FOLDER holds the drafter these arguments train (the same settings and inputs, by the trainer's own run
#             record: scripts/same_run.py): reuse it;
#   status 1: FOLDER holds no exported drafter (nothing, or an unfinished run of these settings): train it;
#   otherwise the script stops (exit 2) with one line: FOLDER holds another run, finished or not (what differs,
#             then HINT), or the arguments do not parse, or the check itself failed (its last line).
# So another seed, step count or data file named to an old folder is refused instead of reusing a drafter trained
# with other settings.
trained() {
  local folder=$1 hint=$2
  shift 2
  [ -e "$folder" ] || return 1
  local why status=0
  why=$(python scripts/same_run.py "$@" 2>&1) || status=$?
  why=${why##*$'\n'}  # its one line (after any warning a library printed on importing)
  case $status in
    0) return 0 ;;
    3) return 1 ;;
    4) echo "$why; $hint" >&2; exit 2 ;;
    2) echo "$why" >&2; exit 2 ;;
    *) echo "scripts/same_run.py failed (status $status): $why" >&2; exit 2 ;;
  esac
}
