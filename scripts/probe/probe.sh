#!/usr/bin/env bash
# The robustness probe of issue #32: kills (SIGKILL at seeded random points during `train`,
# full and LoRA, some landing mid-checkpoint; during `prepare`, with and without
# --val-fraction; during `export`, adapter and --merge) each followed by a resume or rerun
# checked against an uninterrupted reference, and a table of bad inputs (cases.txt) each
# expected to be refused naming what is wrong, never a panic, never exit 0.
#
# Usage: scripts/probe/probe.sh [--quick | --full] [--seed N] [--work DIR] [--trainer PATH]
#                               [--only kills|inputs] [--cases ERE] [--keep]
# Prints a summary table, writes DIR/results.tsv and DIR/summary.txt; exits 1 if any check
# failed. Needs bash, jq, coreutils; no Python, no download. See scripts/probe/README.md.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail
shopt -s nullglob

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=forge.sh
source "$here/forge.sh"
# shellcheck source=runs.sh
source "$here/runs.sh"
# shellcheck source=inputs.sh
source "$here/inputs.sh"

mode=quick
seed=32
work=
trainer=
only=
cases=
keep=0
while (($#)); do
    case $1 in
    --quick) mode=quick ;;
    --full) mode=full ;;
    --seed) seed=$2 && shift ;;
    --work) work=$2 && shift ;;
    --trainer) trainer=$2 && shift ;;
    --only) only=$2 && shift ;;
    --cases) cases=$2 && shift ;;
    --keep) keep=1 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' && exit 0 ;;
    *) echo "probe: unknown argument $1 (see --help)" >&2 && exit 2 ;;
    esac
    shift
done
[[ $only =~ ^(|kills|inputs)$ ]] || { echo "probe: --only takes kills or inputs" >&2 && exit 2; }
command -v jq >/dev/null || { echo "probe: needs jq" >&2 && exit 2; }

# How many of each kind of run: quick (a few minutes on 2 cores) or the issue's counts.
if [[ $mode == full ]]; then
    kills_full=48 kills_lora=47 mid_every=2 kills_prepare=21 kills_export=24
else
    kills_full=3 kills_lora=3 mid_every=3 kills_prepare=6 kills_export=4
fi

if [[ -z $trainer ]]; then
    (cd "$root" && cargo build --release -p trainer --quiet)
    trainer="${CARGO_TARGET_DIR:-$root/target}/release/trainer"
fi
T=$(realpath "$trainer")
W=$(realpath -m "${work:-$root/runs/probe}")
# The work directory is replaced only when an earlier probe made it (its .probe marker).
if [[ -e $W && ! -e $W/.probe ]]; then
    echo "probe: $W exists and is not a probe's work directory; choose another --work" >&2
    exit 2
fi
rm -rf "$W" && mkdir -p "$W" && touch "$W/.probe"
export HF_HOME="$W/home/hf" XDG_CACHE_HOME="$W/home/cache" NO_COLOR=1
RANDOM=$seed
results="$W/results.tsv"
printf 'kind\tclass\tcase\tissue\texpected\tgot\tverdict\tdetail\n' >"$results"

# One result row: kind class case issue expected got verdict detail.
record() {
    local IFS=$'\t'
    printf '%s\n' "$*" | tr -d '\r' >>"$results"
    [[ $7 == pass ]] || echo "FAIL $1 $2 $3: expected $5, got $6: $8" >&2
}

echo "probe: $mode, seed $seed, trainer $T, work $W"
make_fixtures
if [[ $only != inputs ]]; then
    run_kills
fi
if [[ $only != kills ]]; then
    run_inputs
fi
summarise | tee "$W/summary.txt"
((keep)) || rm -rf "$W/kills" "$W/cases"
! grep -q $'\tfail\t' "$results"
